"""Measure the simulator's recovery constants: local jobs with failures, then the fit.

    python benchmarks/recovery_constants.py [--runs 3] [--out oobleck_elastic/simulation/measured_constants.json]

Runs the GPT example (float64, 40 steps, a checkpoint every 5 steps) on 5 local nodes
`--runs` times, each with 3 nodes SIGKILLed at different steps and phases (OOBLECK_FAULT; the
third kill leaves a layer without a replica, so every run also restores a checkpoint; the
profile is measured first by the script run alone, see `profile_alone`), then
fits the constants of simulation/recovery_cost.py to the runs' metrics logs (phases from the
recovery records, the step overhead from the step records against the cost model of each run's
own profile) and writes them with where they came from. `--refit DIR...` fits run directories
kept earlier (`--keep`) without running anything. This is how the shipped
measured_constants.json was made; the machine's load goes into the source line, since the
step overhead and detection times depend on it.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLS = ["node=1,step=8,phase=backward;node=3,step=16,phase=backward;node=4,step=24,phase=backward",
         "node=2,step=6,phase=forward;node=4,step=14,phase=grad_sync;node=1,step=22,phase=backward",
         "node=3,step=9,phase=commit;node=1,step=17,phase=forward;node=2,step=26,phase=optimizer",
         "node=4,step=7,phase=grad_sync;node=2,step=15,phase=backward;node=3,step=23,phase=forward"]
SETS = ["train.steps=40", "train.dtype=float64", "planner.memory_per_worker=16MB", "checkpoint.interval=5"]


def profile_alone(base: str) -> None:
    """The example's profile, measured by its script run alone for one step and cached in
    `base`/profiles for every run: measured beside four workers importing torch, as the first
    worker of a 5-node job does, it comes out 2-4x slow on 2 cores."""
    sets = ["train.steps=1", "train.dtype=float64", "planner.memory_per_worker=1GB",
            f"planner.profile_dir={base}/profiles", f"monitoring.metrics_path={base}/alone/metrics.jsonl",
            f"monitoring.tensorboard_dir={base}/alone/tb", f"checkpoint.dir={base}/alone/checkpoints"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOBLECK_")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples/gpt/train.py"), "--config",
                           os.path.join(ROOT, "examples/gpt/config.yaml"), *(a for s in sets for a in ("--set", s))],
                          cwd=base, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"profiling alone failed:\n{proc.stderr[-2000:]}")


def run_job(work: str, kills: str) -> str:
    sets = [*SETS, f"planner.profile_dir={os.path.dirname(work)}/profiles",
            f"monitoring.metrics_path={work}/metrics.jsonl", f"monitoring.tensorboard_dir={work}/tb",
            f"checkpoint.dir={work}/checkpoints"]
    env = {**os.environ, "OOBLECK_FAULT": kills, "OOBLECK_FAULT_LOG": f"{work}/kills.jsonl"}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=5",
                           "--nproc-per-node=1", f"--oobleck-log-dir={work}/logs",
                           os.path.join(ROOT, "examples/gpt/train.py"), "--config",
                           os.path.join(ROOT, "examples/gpt/config.yaml"), *(a for s in sets for a in ("--set", s))],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"the job in {work} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return f"{work}/metrics.jsonl"


def fit(runs: list[str], source: str, out: str) -> None:
    from oobleck_elastic.config import PlannerConfig
    from oobleck_elastic.planning import ModelProfile
    from oobleck_elastic.planning.job import make_cluster
    from oobleck_elastic.simulation import SimJob, fit_constants
    from oobleck_elastic.simulation.engine import layout_step_model

    models = []
    for run in runs:  # each run's steps against the cost model of the profile it planned with
        found = glob.glob(os.path.join(run, "profiles/*.json")) or glob.glob(os.path.join(run, "../profiles/*.json"))
        profile = ModelProfile.load(found[0])
        cluster = make_cluster(PlannerConfig(memory_per_worker="16MB"), profile, 1)
        models.append(layout_step_model(SimJob(profile=profile, cluster=cluster, fault_tolerance=1,
                                               global_batch=64, microbatch=4)))
    constants = fit_constants([os.path.join(run, "metrics.jsonl") for run in runs], models, source=source)
    constants.save(out)
    print(constants.describe())
    print(f"written to {out}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3, choices=range(1, len(KILLS) + 1))
    p.add_argument("--out", default=os.path.join(ROOT, "oobleck_elastic/simulation/measured_constants.json"))
    p.add_argument("--keep", metavar="DIR", help="keep the runs here (default: a temporary directory)")
    p.add_argument("--refit", nargs="+", metavar="DIR", help="fit these kept run directories instead")
    p.add_argument("--source", help="with --refit: how the runs were made (kept with the constants)")
    args = p.parse_args()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    if args.refit:
        fit(args.refit, args.source or f"benchmarks/recovery_constants.py --refit {' '.join(args.refit)} on {when}",
            args.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base = args.keep or tmp
        runs, load = [], []
        os.makedirs(base, exist_ok=True)
        profile_alone(base)
        for k in range(args.runs):
            runs.append(os.path.join(base, f"run{k}"))
            os.makedirs(runs[-1], exist_ok=True)
            load.append(os.getloadavg()[0])
            run_job(runs[-1], KILLS[k])
            print(f"run {k}: {runs[-1]} (load average {load[-1]:.1f} at its start)")
        fit(runs, f"benchmarks/recovery_constants.py --runs {args.runs} on {when}: the GPT example, 5 local nodes "
                  f"x 1 worker on {os.cpu_count()} CPU cores (load average {min(load):.1f}-{max(load):.1f}), 40 steps, "
                  "3 SIGKILLs per run", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
