"""`TokenFile`: a map-style dataset over a flat binary file of token ids.

The file is what `python -m oobleck_elastic.data.prepare` writes: the token ids of the corpus,
one after another, as little-endian uint16 or uint32 (`data.token_dtype`), with no header.
Sample i of sequence length T has inputs tokens[i*T:(i+1)*T] and targets
tokens[i*T+1:(i+1)*T+1] (the next token of each input), so the file holds (n - 1) // T
samples. Which sample each step takes is `runtime.data.SampleOrder`'s business
(Note: [sample order]); this module only reads samples by index.

The file is memory-mapped, never read whole: a worker touches only the pages of the samples it
loads, and the first pipeline stage reads only inputs, the last only targets.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from oobleck_elastic.config.schema import DataConfig
from oobleck_elastic.errors import ConfigError

__all__ = ["TokenFile", "TOKEN_DTYPES"]

TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""data.token_dtype -> the on-disk element type (little-endian, whatever the host)."""
_OTHER = {"uint16": "uint32", "uint32": "uint16"}


class TokenFile:
    """Samples of `seq_len` tokens and their next-token targets, read from a token file.

    Safe to call from a prefetch thread while the main thread also reads: reads of a read-only
    memory map share no mutable state.
    """

    def __init__(self, path: str | os.PathLike[str], *, seq_len: int, dtype: str = "uint16",
                 vocab_size: int | None = None, key: str = "data.tokens") -> None:
        self.path = os.fspath(path)
        self.key = key  # the config key that names the file, for messages
        if dtype not in TOKEN_DTYPES:
            raise ConfigError(
                f"data.token_dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
        if seq_len < 1:
            raise ConfigError(f"data.seq_len must be >= 1, got {seq_len}")
        if vocab_size is not None and vocab_size < 1:
            raise ConfigError(f"vocab_size must be >= 1, got {vocab_size}")
        self.seq_len = seq_len
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.num_tokens = self._count_tokens()
        self._tokens = self._open()

    @classmethod
    def from_config(cls, cfg: DataConfig, *, vocab_size: int | None) -> TokenFile:
        """The token file a job's `data` section names; vocab_size is the model's."""
        if cfg.tokens is None:
            raise ConfigError("data.tokens is not set: name a token file written by "
                              "`python -m oobleck_elastic.data.prepare`")
        return cls(cfg.tokens, seq_len=cfg.seq_len, dtype=cfg.token_dtype, vocab_size=vocab_size)

    def _count_tokens(self) -> int:
        if not os.path.isfile(self.path):
            raise ConfigError(f"{self.key}: no such file {self.path!r}; write one with "
                              "`python -m oobleck_elastic.data.prepare`")
        size = os.path.getsize(self.path)
        itemsize = TOKEN_DTYPES[self.dtype].itemsize
        if size % itemsize:
            raise ConfigError(
                f"{self.key}: {self.path!r} is {size} bytes, not a multiple of {self.dtype}'s "
                f"{itemsize} bytes: was it written with data.token_dtype={_OTHER[self.dtype]}?")
        n = size // itemsize
        if n < self.seq_len + 1:
            raise ConfigError(
                f"{self.key}: {self.path!r} holds {n} tokens, too few for one sample of "
                f"data.seq_len={self.seq_len} (needs seq_len + 1 = {self.seq_len + 1}); "
                "use more text or a smaller data.seq_len")
        return n

    def _open(self) -> np.memmap:
        return np.memmap(self.path, dtype=TOKEN_DTYPES[self.dtype], mode="r",
                         shape=(self.num_tokens,))

    # A memmap pickles as a full in-memory copy of the file; send the path and reopen instead.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_tokens"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tokens = self._open()

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __repr__(self) -> str:
        return (f"TokenFile({self.path!r}, seq_len={self.seq_len}, dtype={self.dtype!r}, "
                f"samples={len(self)}, tokens={self.num_tokens})")

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [b, T], targets [b, T]) int64 for samples `indices`, from one read each."""
        window = self._read(indices, offset=0, width=self.seq_len + 1)
        return _long(window[:, :-1]), _long(window[:, 1:])

    def inputs(self, indices: Sequence[int]) -> torch.Tensor:
        """Inputs [b, T] int64 of samples `indices` (what the first stage needs)."""
        return _long(self._read(indices, offset=0, width=self.seq_len))

    def targets(self, indices: Sequence[int]) -> torch.Tensor:
        """Targets [b, T] int64 of samples `indices` (what the last stage needs)."""
        return _long(self._read(indices, offset=1, width=self.seq_len))

    def target_count(self, indices: Sequence[int]) -> int:
        """How many target elements of `indices` the loss counts; every one of a token file does."""
        return len(indices) * self.seq_len

    def _read(self, indices: Sequence[int], *, offset: int, width: int) -> np.ndarray:
        rows = [int(i) for i in indices]
        count = len(self)
        for i in rows:
            if not 0 <= i < count:
                raise IndexError(f"sample index {i} is out of range: {self.path!r} holds {count} "
                                 f"samples of seq_len {self.seq_len}")
        T = self.seq_len
        if not rows:
            return np.empty((0, width), dtype=TOKEN_DTYPES[self.dtype])
        window = np.stack([self._tokens[i * T + offset:i * T + offset + width] for i in rows])
        self._check_vocab(window, rows)
        return window

    def _check_vocab(self, window: np.ndarray, rows: list[int]) -> None:
        # One max over the batch: cheap next to the model step, and it turns a device-side
        # index error deep inside an embedding into a message naming the cause.
        if self.vocab_size is None or int(window.max()) < self.vocab_size:
            return
        row, col = np.unravel_index(int(window.argmax()), window.shape)
        raise ConfigError(
            f"{self.key}: token id {int(window[row, col])} in sample {rows[row]} of "
            f"{self.path!r} is >= the model's vocab_size {self.vocab_size}: the tokenizer that "
            "wrote the file and the model do not match; re-run "
            "`python -m oobleck_elastic.data.prepare` with the model's tokenizer")


def _long(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array.astype(np.int64))
