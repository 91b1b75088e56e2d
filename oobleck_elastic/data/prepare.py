"""`python -m oobleck_elastic.data.prepare`: text files -> a token file that `TokenFile` reads.

Each text file is one document. Documents are tokenized with a local Hugging Face tokenizer
(never downloaded) and concatenated with the tokenizer's eos token between them, if it has
one. The ids are written as uint16 when the vocabulary fits (halving the file and the page
cache it takes) and as uint32 otherwise; the file appears atomically, so a job never reads a
half-written one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from oobleck_elastic.data.tokens import TOKEN_DTYPES
from oobleck_elastic.errors import ConfigError, exit_status

__all__ = ["main", "choose_dtype"]

_LIMITS = {"uint16": 2**16, "uint32": 2**32}


def choose_dtype(vocab_size: int, forced: str | None = None) -> str:
    """uint16 when every id of a vocabulary of `vocab_size` fits, else uint32 (or `forced`)."""
    if forced is None:
        return "uint16" if vocab_size <= _LIMITS["uint16"] else "uint32"
    if vocab_size > _LIMITS[forced]:
        raise ConfigError(f"--dtype {forced} holds ids below {_LIMITS[forced]}, but the "
                          f"tokenizer's vocabulary has {vocab_size} tokens; use --dtype uint32")
    return forced


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m oobleck_elastic.data.prepare",
        description="Tokenize text files into a flat token file for data.tokens.")
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="folder of a saved Hugging Face tokenizer (read locally, never downloaded)")
    p.add_argument("--output", required=True, metavar="FILE", help="token file to write")
    p.add_argument("--dtype", choices=sorted(_LIMITS), default=None,
                   help="element type (default: uint16 if the vocabulary fits, else uint32)")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="text files, one document each")
    return p


def _load_tokenizer(directory: str) -> Any:
    if not os.path.isdir(directory):
        raise ConfigError(f"--tokenizer {directory!r} is not a directory; pass the folder a "
                          "tokenizer was saved to with save_pretrained()")
    try:
        from transformers import AutoTokenizer  # deferred: an optional dependency
    except ImportError as exc:
        raise ConfigError(
            "preparing data needs transformers: pip install 'oobleck_elastic[hf]'") from exc
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())  # transformers' messages span lines; ours is one
        raise ConfigError(f"could not load a tokenizer from {directory!r}: {reason}") from exc


def _documents(tokenizer: Any, paths: Sequence[str], dtype: str) -> Iterable[np.ndarray]:
    """Each file's ids, with the eos id between files, as arrays of `dtype`."""
    eos = tokenizer.eos_token_id
    for k, path in enumerate(paths):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        # verbose=False: a whole document is longer than model_max_length by design here.
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if k and eos is not None:
            ids = [eos, *ids]
        array = np.asarray(ids, dtype=np.int64)
        if array.size and array.max() >= _LIMITS[dtype]:
            raise ConfigError(f"{path}: token id {int(array.max())} does not fit {dtype}; "
                              "use --dtype uint32")
        yield array.astype(TOKEN_DTYPES[dtype])


def _write_atomically(output: str, arrays: Iterable[np.ndarray]) -> int:
    """Writes the arrays one after another to `output` via a temporary file; returns the count."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    # Beside the output, so os.replace stays on one filesystem; opened "xb" (not mkstemp) so the
    # file gets the user's umask rather than mode 0600.
    tmp = f"{output}.{os.getpid()}.tmp"
    count = 0
    try:
        with open(tmp, "xb") as f:
            for array in arrays:
                f.write(array.tobytes())
                count += array.size
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return count


def _prepare(args: argparse.Namespace) -> None:
    for path in args.texts:
        if not os.path.isfile(path):
            raise ConfigError(f"no such text file {path!r}")
    tokenizer = _load_tokenizer(args.tokenizer)
    vocab_size = len(tokenizer)
    dtype = choose_dtype(vocab_size, args.dtype)
    count = _write_atomically(args.output, _documents(tokenizer, args.texts, dtype))
    print(f"wrote {count} tokens ({dtype}, vocabulary of {vocab_size}) to {args.output}")
    print("in the job config:")
    print(f"  data:\n    tokens: {args.output}\n    token_dtype: {dtype}")
    print(f"or: --set data.tokens={args.output} --set data.token_dtype={dtype}")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (2 for a usage error)."""
    args = _parser().parse_args(argv)
    return exit_status(lambda: _prepare(args))


if __name__ == "__main__":
    sys.exit(main())
