"""`python -m oobleck_elastic.chaos`: a training script on N local nodes under a seeded chaos
schedule (launcher/chaos.py: kills, kills during recovery, two kills within a second, hung
nodes, replacements; all from outside the nodes), then the report: failures by kind, recovered
in memory or from the checkpoint, time lost per failure, steps redone, orphan processes, and
whether the run equals a failure-free run of the same script (run alone, after): every logged
step's loss against the reference's loss of that step, and the final weights tensor by tensor
(from both runs' checkpoints of the last step: a run that ends without its last step's
checkpoint fails the comparison).

    python -m oobleck_elastic.chaos --nodes 4 --seed 1 --out runs/chaos \\
        examples/gpt/train.py --config examples/gpt/config.yaml --set train.dtype=float64 \\
        --reference-set planner.memory_per_worker=1GB

The script must take --config/--set (the job's metrics log is the record read). Exit status 0
when the run finished with the failure-free run's weights and left no process behind.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
import uuid

import psutil
import torch

from oobleck_elastic.elastic.process import run_id_of
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.launch import build_parser, job_config_of
from oobleck_elastic.launcher.chaos import ChaosConfig, ChaosSchedule, chaos_report
from oobleck_elastic.launcher.local_job import run_local_job
from oobleck_elastic.monitoring.metrics import read_records
from oobleck_elastic.runtime.checkpoint import load_model_state, read_manifest

__all__ = ["main"]

# Float64 runs on different layouts sum each gradient in a different order, and training
# amplifies that rounding over steps (measured here: 1e-13 after 1,300 steps, 2.5e-8 after
# 4,500 for the chaos run and the failure-free 5-node run alike). A sample used twice or not at
# all moves its step's loss by ~1e-3 and the weights by ~1e-4; a lost update more. The bounds
# sit between the two, two orders of magnitude from each.
LOSS_RTOL = 1e-7
WEIGHTS_RTOL = 1e-6


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oobleck_elastic.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mean-interval", type=float, default=8.0, help="mean seconds between injections")
    p.add_argument("--hang-seconds", type=float, default=None, help="how long a hung node stays stopped "
                   "(default: its lease timeout plus 3 s)")
    p.add_argument("--timeout", type=float, default=3600.0, help="the run's limit; past it the run is hung")
    p.add_argument("--out", default="runs/chaos", help="node logs, metrics, checkpoints, the reference run")
    p.add_argument("--loss-rtol", type=float, default=LOSS_RTOL,
                   help="largest relative difference of a step's loss from the failure-free run's")
    p.add_argument("--weights-rtol", type=float, default=WEIGHTS_RTOL,
                   help="largest relative L2 distance of a final weight tensor from the failure-free run's")
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
            if run_id_of(proc) == run_id and proc.pid != os.getpid():
                found.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _reference(script: str, args: list[str], out: str) -> None:
    """The failure-free run: the same script, alone (one process trains the whole job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOBLECK_")}
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise OobleckError(f"the failure-free reference run failed:\n{proc.stderr[-2000:]}")


def _relative(diff: float, scale: float) -> float:
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def compare_losses(records: list[dict], reference: list[dict]) -> tuple[int, float, int | None]:
    """(step records compared, largest relative loss difference, its step): every step the run
    logged, including those later redone, against the reference's record of that step."""
    theirs = {r["step"]: r["loss"] for r in reference if "event" not in r and "loss" in r}
    diffs = [(_relative(abs(r["loss"] - theirs[r["step"]]), abs(theirs[r["step"]])) if r["step"] in theirs
              else math.inf, r["step"]) for r in records if "event" not in r and "loss" in r]
    worst, at = max(diffs, default=(0.0, None))
    return len(diffs), worst, at


def compare_weights(job_dir: str, ref_dir: str, final: dict | None, reference: dict | None) -> tuple[float, str]:
    """(largest relative difference, what was compared): both checkpoints of the last step, per
    tensor ||ours - theirs|| / ||theirs||. A run must end with its last step's checkpoint
    published, so a missing one is a failure of the run (infinite difference), not a reason to
    compare something weaker."""
    if final is None or reference is None or final.get("steps") != reference.get("steps"):
        return math.inf, "the runs' final records differ in length or are missing"
    step = final["steps"]
    try:
        layers = read_manifest(job_dir, step)["layers"]
    except (OSError, ValueError) as exc:
        return math.inf, f"the run's checkpoint of its last step {step} is missing or unreadable ({exc})"
    try:
        read_manifest(ref_dir, step)
    except (OSError, ValueError) as exc:
        return math.inf, f"the failure-free run's checkpoint of step {step} is missing or unreadable ({exc})"
    ours, theirs = load_model_state(job_dir, step, layers), load_model_state(ref_dir, step, layers)
    if ours.keys() != theirs.keys():
        return math.inf, f"the checkpoints of step {step} hold different tensors"
    worst = 0.0
    for name, t in theirs.items():
        if t.is_floating_point():
            a, b = ours[name].double(), t.double()
            worst = max(worst, _relative(torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()))
        elif not torch.equal(ours[name], t):
            worst = math.inf
    return worst, f"each tensor of the checkpoints of step {step}"


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
    ref_args = _job_args([*a.script_args, *(x for kv in a.reference_set for x in ("--set", kv))], a.out, "reference")
    _reference(a.script, ref_args, a.out)
    ref_cfg = job_config_of(ref_args)
    assert ref_cfg is not None, "the script takes --set: the job's paths were set with it"
    reference = read_records(ref_cfg.monitoring.metrics_path)
    n, worst_loss, at = compare_losses(read_records(cfg.monitoring.metrics_path), reference)
    finals = [r for r in reference if r.get("event") == "final"]
    worst, what = compare_weights(cfg.checkpoint.dir, ref_cfg.checkpoint.dir, report.final,
                                  finals[-1] if finals else None)
    equal = worst_loss <= a.loss_rtol and worst <= a.weights_rtol
    print(f"  losses of the {n} logged steps vs the failure-free run: largest relative difference "
          f"{worst_loss:.1e} (step {at}; bound {a.loss_rtol:.0e})")
    print(f"  final weights vs the failure-free run (float64): {'EQUAL' if equal else 'DIFFERENT'} "
          f"(largest relative difference {worst:.1e}, bound {a.weights_rtol:.0e}; {what})")
    return 0 if equal and not orphans else 1

if __name__ == "__main__":
    sys.exit(main())
