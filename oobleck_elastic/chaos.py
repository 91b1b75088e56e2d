"""`python -m oobleck_elastic.chaos`: a training script on N local nodes under a seeded chaos
schedule (launcher/chaos.py: kills, kills during recovery, two kills within a second, hung
nodes, replacements; all from outside the nodes), then the report: failures by kind, recovered
in memory or from the checkpoint, time lost per failure, steps redone, orphan processes, and
whether the final weights equal a failure-free run of the same script (run alone, after).

    python -m oobleck_elastic.chaos --nodes 4 --seed 1 --out runs/chaos \\
        examples/gpt/train.py --config examples/gpt/config.yaml --set train.dtype=float64 \\
        --reference-set planner.memory_per_worker=1GB

The script must take --config/--set (the job's metrics log is the record read). Exit status 0
when the run finished with the failure-free run's weights and left no process behind.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid

import psutil

from oobleck_elastic.errors import OobleckError
from oobleck_elastic.launch import build_parser, job_config_of
from oobleck_elastic.launcher.chaos import ChaosConfig, ChaosSchedule, chaos_report
from oobleck_elastic.launcher.local_job import run_local_job

__all__ = ["main"]

REL_TOL = 1e-9  # float64 weights of a run with failures against one without


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oobleck_elastic.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mean-interval", type=float, default=8.0, help="mean seconds between injections")
    p.add_argument("--hang-seconds", type=float, default=None, help="how long a hung node stays stopped "
                   "(default: its lease timeout plus 3 s)")
    p.add_argument("--timeout", type=float, default=3600.0, help="the run's limit; past it the run is hung")
    p.add_argument("--out", default="runs/chaos", help="node logs, metrics, checkpoints, the reference run")
    p.add_argument("--reference-set", action="append", default=[], metavar="KEY=VALUE",
                   help="--set for the failure-free reference run alone (e.g. a memory limit one worker fits in)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def _job_args(script_args: list[str], out: str, name: str) -> list[str]:
    """The script's arguments with the record's paths under `out`/`name` and no resume."""
    paths = {"monitoring.metrics_path": f"{out}/{name}/metrics.jsonl",
             "monitoring.tensorboard_dir": f"{out}/{name}/tb", "checkpoint.dir": f"{out}/{name}/checkpoints"}
    return [*script_args, *(a for k, v in paths.items() for a in ("--set", f"{k}={v}")),
            "--set", "checkpoint.resume=never"]


def _orphans(run_id: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("OOBLECK_RUN_ID") == run_id:
                found.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _reference(script: str, args: list[str], out: str) -> dict:
    """The failure-free run: the same script, alone (one process trains the whole job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOBLECK_")}
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise OobleckError(f"the failure-free reference run failed:\n{proc.stderr[-2000:]}")
    return chaos_report([], f"{out}/reference/metrics.jsonl").final


def _compare(final: dict | None, reference: dict | None) -> tuple[bool, float]:
    if final is None or reference is None:
        return False, float("inf")
    ours = final["param_sums"] + final["param_norms"]
    theirs = reference["param_sums"] + reference["param_norms"]
    worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs)), default=0.0)
    return len(ours) == len(theirs) and worst <= REL_TOL, worst


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    run_id = f"chaos-{a.seed}-{uuid.uuid4().hex[:6]}"
    job = _job_args(a.script_args, a.out, "job")
    try:
        cfg = job_config_of(job)
        if cfg is None:
            raise OobleckError("the chaos run reads the job's metrics log: give the script --config")
        hang = a.hang_seconds if a.hang_seconds is not None else cfg.elastic.lease_timeout_s + 3.0
        chaos = ChaosConfig(seed=a.seed, nodes=a.nodes, mean_interval_s=a.mean_interval, hang_s=hang,
                            timeout_s=a.timeout)
    except (OobleckError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    launch = build_parser().parse_args([f"--oobleck-local-nodes={a.nodes}", "--nproc-per-node=1",
                                        f"--oobleck-log-dir={a.out}/logs", f"--rdzv-id={run_id}",
                                        "--max-restarts=0", a.script, *job])
    schedule = ChaosSchedule(chaos)
    started = time.monotonic()
    rc = run_local_job(launch, cfg, tick=schedule)
    wall = time.monotonic() - started
    time.sleep(1.0)  # the last agents' exits
    orphans = _orphans(run_id)
    report = chaos_report(schedule.injections, cfg.monitoring.metrics_path)
    print(f"\nchaos report: seed {a.seed}, {a.nodes} nodes, {report.steps} steps in {wall:.0f} s"
          + (f" (stopped at --timeout {a.timeout:.0f} s before its last step: no hang is told apart from a"
             " slow run, see the node logs)" if schedule.timed_out else ""))
    for line in report.lines():
        print(f"  {line}")
    print(f"  orphan processes: {len(orphans)}{' ' + str(orphans) if orphans else ''}")
    if rc != 0 or report.final is None:
        print("  the run did not finish", file=sys.stderr)
        return 1
    reference = _reference(a.script, _job_args([*a.script_args, *(x for kv in a.reference_set
                                                                  for x in ("--set", kv))], a.out, "reference"),
                           a.out)
    equal, worst = _compare(report.final, reference)
    print(f"  final weights vs the failure-free run (float64): {'EQUAL' if equal else 'DIFFERENT'} "
          f"(largest relative difference {worst:.1e})")
    return 0 if equal and not orphans else 1


if __name__ == "__main__":
    sys.exit(main())
