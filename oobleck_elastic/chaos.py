"""`python -m oobleck_elastic.chaos`: a training script on N local nodes under a seeded chaos
schedule (launcher/chaos.py, with the comparison: kills, kills during recovery, two kills within a second, hung
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
import sys
import time
import uuid

from oobleck_elastic.errors import OobleckError
from oobleck_elastic.launch import build_parser, job_config_of
from oobleck_elastic.launcher.chaos import (
    LOSS_RTOL,
    WEIGHTS_RTOL,
    ChaosConfig,
    ChaosSchedule,
    chaos_report,
    compare_losses,
    compare_weights,
    job_args,
    orphans,
    reference_run,
)
from oobleck_elastic.launcher.local_job import run_local_job
from oobleck_elastic.monitoring.metrics import read_records

__all__ = ["main"]

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


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    run_id = f"chaos-{a.seed}-{uuid.uuid4().hex[:6]}"
    job = job_args(a.script_args, a.out, "job")
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
    left = orphans(run_id)
    report = chaos_report(schedule.injections, cfg.monitoring.metrics_path)
    print(f"\nchaos report: seed {a.seed}, {a.nodes} nodes, {report.steps} steps in {wall:.0f} s"
          + (f" (stopped at --timeout {a.timeout:.0f} s before its last step: no hang is told apart from a"
             " slow run, see the node logs)" if schedule.timed_out else ""))
    for line in report.lines():
        print(f"  {line}")
    print(f"  orphan processes: {len(left)}{' ' + str(left) if left else ''}")
    if rc != 0 or report.final is None:
        print("  the run did not finish", file=sys.stderr)
        return 1
    ref_args = job_args([*a.script_args, *(x for kv in a.reference_set for x in ("--set", kv))], a.out, "reference")
    reference_run(a.script, ref_args, a.out)
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
    return 0 if equal and not left else 1

if __name__ == "__main__":
    from oobleck_elastic.launcher.process_exit import exit_now

    exit_now(main())
