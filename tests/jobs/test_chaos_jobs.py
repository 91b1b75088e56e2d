"""The chaos runner end to end (`python -m oobleck_elastic.chaos`): a short seeded run of the
example job under kills, kills during recovery, two kills at once, hung nodes and replacements,
all from outside the nodes, ends with the weights of a failure-free run and leaves no process
behind (its report and comparison: tests/unit/test_chaos.py)."""

from __future__ import annotations

import subprocess
import sys

from jobs import SCRIPT, job_args


def test_a_short_chaos_run_ends_with_the_failure_free_weights_and_no_process_left(tmp_path):
    args = job_args(tmp_path, "unused")  # the runner sets the record's paths itself (later --set wins)
    proc = subprocess.run(
        [sys.executable, "-m", "oobleck_elastic.chaos", "--nodes=4", "--seed=3", "--mean-interval=2",
         f"--out={tmp_path / 'out'}", "--timeout=400", "--reference-set", "planner.memory_per_worker=1GB",
         SCRIPT, *args, "--set", "train.steps=30", "--set", "checkpoint.interval=4",
         "--set", "elastic.collective_timeout_s=3", "--set", "elastic.lease_timeout_s=5",
         "--set", "elastic.agreement_timeout_s=20"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "final weights vs the failure-free run (float64): EQUAL" in out, out[-3000:]
    assert "orphan processes: 0" in out
    # 30 steps leave float64 rounding at ~1e-14, far inside the report's bounds for long runs: a
    # gradient summed in float32 anywhere (1e-8) would pass those but not this
    diffs = [float(part.split()[0].rstrip(",")) for part in out.split("largest relative difference ")[1:]]
    assert len(diffs) == 2 and max(diffs) < 1e-11, out[-3000:]
    assert "each tensor of the checkpoints of step 30" in out, out[-3000:]
    failed = int(out.split("nodes failed: ")[1].split()[0])
    assert failed >= 2, out[-3000:]  # replacements join slowly on a loaded machine: the schedule waits for them
