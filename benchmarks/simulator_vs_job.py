"""The simulator against a real job: the GPT example on 5 local nodes with 3 nodes SIGKILLed
(the third forces a checkpoint restore), then simulated from its own profile, its kill times and
the shipped constants (never fitted to this run). Prints the predicted and the measured time from
the first step's start to the last step's end, and their ratio (issue 16's bound: within 25%).

    python benchmarks/simulator_vs_job.py

The profile is measured first by the job's script alone (one step, cached under the key the
5-node job looks up), so the profiler is not timed while four other workers import torch.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    from jobs import SCRIPT, job_args, records

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        steps = 30
        own = ["--set", f"planner.profile_dir={tmp_path / 'profiles'}"]  # not the session's shared cache
        alone = subprocess.run([sys.executable, SCRIPT, *job_args(tmp_path, "profile"), *own, "--set", "train.steps=1",
                                "--set", "planner.memory_per_worker=1GB"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=300)
        if not (alone.returncode == 0):
            raise SystemExit(alone.stderr[-3000:])
        env = {**os.environ, "OOBLECK_FAULT_LOG": str(tmp_path / "kills.jsonl"),
               "OOBLECK_FAULT": "node=1,step=6,phase=backward;node=3,step=12,phase=backward;node=4,step=18,phase=backward"}
        proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=5",
                               "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                               *job_args(tmp_path, "run"), *own, "--set", f"train.steps={steps}",
                               "--set", "checkpoint.interval=5"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        if not (proc.returncode == 0):
            raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
        log = [r for r in records(tmp_path / "run/metrics.jsonl") if "step" in r and "event" not in r]
        start = log[0]["time"] - log[0]["step_time_s"]
        measured = log[-1]["time"] - start
        kills = records(tmp_path / "kills.jsonl")
        if not (len(kills) == 3):
            raise SystemExit('len(kills) == 3')
        trace = tmp_path / "kills.csv"
        trace.write_text("".join(f"{k['time'] - start:.3f},remove,{k['node']}\n" for k in kills))
        (profile,) = (tmp_path / "profiles").glob("*.json")  # the job used the one measured alone
        out = subprocess.run([sys.executable, "-m", "oobleck_elastic.simulate", "--profile", str(profile), "--nnodes", "5",
                              "--global-batch", "64", "--microbatch", "4", "--memory-per-worker", "16MB",
                              "--checkpoint-interval", "5", "--trace", str(trace), "--steps", str(steps),
                              "--systems", "oobleck", "--json", "--plot", ""],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
        if not (out.returncode == 0):
            raise SystemExit(out.stderr)
        (row,) = json.loads(out.stdout)["rows"]
        predicted = row["finished_at_s"]
        print(f"measured {measured:.2f} s, predicted {predicted:.2f} s, predicted/measured "
              f"{predicted / measured:.2f} (goal 0.75-1.25); recoveries {row['recoveries']} (3), "
              f"fallbacks {row['fallbacks']} (1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
