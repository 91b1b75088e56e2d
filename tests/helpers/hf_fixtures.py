"""Tiny Hugging Face artefacts built locally, for tests and examples that must not download; and
the fixtures of the data.prepare tests (`tokenizer_dir`, `texts`: a tier's conftest.py imports
them, so its test modules take them as arguments without importing them)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import pytest

__all__ = ["DOCS", "make_tokenizer", "make_causal_lm", "texts", "tokenizer_dir", "write_tokens"]

TINY_GPT2 = dict(n_layer=4, n_embd=32, n_head=4, vocab_size=97, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
TINY_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, bos_token_id=0,
                  eos_token_id=0, pad_token_id=None)


def make_causal_lm(directory: str | pathlib.Path, kind: str, *, seed: int = 0, **overrides) -> pathlib.Path:
    """A tiny random GPT-2 (tied embeddings, no dropout) or Llama (grouped-query attention)
    saved with save_pretrained into `directory`."""
    import torch
    import transformers

    if kind == "gpt2":
        config, cls = transformers.GPT2Config(**{**TINY_GPT2, **overrides}), transformers.GPT2LMHeadModel
    elif kind == "llama":
        config, cls = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides}), transformers.LlamaForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb so every tensor is distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return pathlib.Path(directory)


def write_tokens(path: str | pathlib.Path, count: int, vocab_size: int, *, seed: int = 0) -> pathlib.Path:
    """A token file (uint16) of `count` random ids below `vocab_size`."""
    import numpy as np

    np.random.default_rng(seed).integers(0, vocab_size, count).astype("<u2").tofile(path)
    return pathlib.Path(path)


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


# Two documents, a tokenizer trained on them and their text files: the input of data.prepare.
DOCS = ["the cat sat on the mat", "a dog sat on a log and the cat ran"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("hf") / "tok", DOCS)


@pytest.fixture
def texts(tmp_path):
    paths = []
    for k, doc in enumerate(DOCS):
        paths.append(tmp_path / f"doc{k}.txt")
        paths[-1].write_text(doc + "\n", encoding="utf-8")
    return [str(p) for p in paths]
