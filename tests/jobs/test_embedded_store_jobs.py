"""A worker whose agent died before it started watching exits instead of taking init for its
agent (elastic.process.watch_parent, run as a command; the embedded store:
tests/store/test_embedded_store.py)."""

from __future__ import annotations

import os


def test_a_worker_whose_agent_died_before_it_started_watching_exits():
    """A worker still importing when its agent was SIGKILLed is adopted by init; it must not take
    init for its agent (an orphan the chaos run found): it exits as soon as it watches."""
    import subprocess
    import sys

    code = ("from oobleck_elastic.elastic.process import watch_parent\n"
            "watch_parent()\nprint('still here')\n")
    gone = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OOBLECK_AGENT_PID": "1"},
                          capture_output=True, text=True, timeout=120)
    assert gone.returncode == 1 and "still here" not in gone.stdout, gone.stdout + gone.stderr
    alive = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OOBLECK_AGENT_PID": str(os.getpid())},
                           capture_output=True, text=True, timeout=120)
    assert alive.returncode == 0 and "still here" in alive.stdout, alive.stdout + alive.stderr
