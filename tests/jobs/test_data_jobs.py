"""`python -m oobleck_elastic.data.prepare` as a command: a token file written, and a missing
text file one line with exit status 2 (the CLI in-process and token files:
tests/unit/test_data.py). Its fixtures come from tests/jobs/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_module(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "oobleck_elastic.data.prepare", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_module_entry_point(tokenizer_dir, texts, tmp_path):
    out = tmp_path / "train.bin"
    done = run_module("--tokenizer", str(tokenizer_dir), "--output", str(out), *texts)
    assert done.returncode == 0, done.stderr
    assert "token_dtype: uint16" in done.stdout and out.stat().st_size > 0
    failed = run_module("--tokenizer", str(tokenizer_dir), "--output", str(out), "gone.txt")
    assert failed.returncode == 2 and failed.stderr.startswith("error: no such text file")
