"""Fixtures this tier's tests take by name: the data.prepare inputs (tests/helpers/hf_fixtures.py,
on the path from tests/conftest.py; a test module that imported them itself would shadow the
import with the argument of the same name), and every job of the tier on the session's warm
node starter (tests/helpers/jobs.py)."""

import pytest
from hf_fixtures import texts, tokenizer_dir

from oobleck_elastic.launcher import warm_starter

__all__ = ["texts", "tokenizer_dir"]


@pytest.fixture(autouse=True)
def _warm_jobs(warm_node_starter, monkeypatch):
    """Every local job of this tier gets its node starter from the tier's warm starter; a test
    that wants the cold path removes OOBLECK_NODE_STARTER from its job's environment
    (tests/jobs/test_launcher.py does). Tests of other tiers do not see it."""
    monkeypatch.setenv(warm_starter.ENV_VAR, warm_node_starter)
