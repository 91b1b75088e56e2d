"""Tiny Hugging Face artefacts built locally, for tests and examples that must not download."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

__all__ = ["make_tokenizer"]


def make_tokenizer(directory: str | pathlib.Path, texts: Sequence[str], *,
                   eos_token: str | None = "<eos>") -> pathlib.Path:
    """Trains a word-level tokenizer on `texts`, saves it with save_pretrained; returns the dir.

    Every word of `texts` gets its own id; unseen words map to <unk>. Loadable with
    `AutoTokenizer.from_pretrained(directory, local_files_only=True)`.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>"] + ([eos_token] if eos_token else [])
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        eos_token=eos_token)
    directory = pathlib.Path(directory)
    tokenizer.save_pretrained(directory)
    return directory
