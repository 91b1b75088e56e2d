"""Fixtures this tier's tests take by name: the data.prepare inputs (tests/helpers/hf_fixtures.py,
on the path from tests/conftest.py). A test module that imported them itself would shadow the
import with the argument of the same name."""

from hf_fixtures import texts, tokenizer_dir

__all__ = ["texts", "tokenizer_dir"]
