"""A config error from an entry point run as a command is one line and exit status 2, no
traceback (the config itself: tests/unit/test_config.py)."""

from __future__ import annotations

import subprocess
import sys


def write(tmp_path, text: str):  # as tests/unit/test_config.py's
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_entry_point_prints_message_without_traceback(tmp_path):
    path = write(tmp_path, "train:\n  global_batch_size: 30\n")
    proc = subprocess.run([sys.executable, "-m", "examples.gpt.plan_demo", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: train.global_batch_size (30) must be a multiple" in proc.stderr
    assert "Traceback" not in proc.stderr
