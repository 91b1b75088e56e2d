"""`python -m oobleck_elastic.simulate`: replay a failure trace against a job, for our runtime
(the real planner, recovery costs fitted to our measured recoveries) and its baselines.

Examples:
    python -m oobleck_elastic.simulate --scenario paper-table2
    python -m oobleck_elastic.simulate --synthetic gpt --model-size 6.7B --nnodes 64 --nproc-per-node 8 \\
        --global-batch 4096 --microbatch 2 --wide --trace poisson:7.7min --events 200 --replace-after 5min
    python -m oobleck_elastic.simulate --fit runs/gpt/metrics.jsonl          # constants from a run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from oobleck_elastic.errors import ConfigError, OobleckError
from oobleck_elastic.plan import add_job_arguments, job_inputs
from oobleck_elastic.simulation import report
from oobleck_elastic.simulation.baselines import SOURCES, Baselines
from oobleck_elastic.simulation.engine import SYSTEMS, SimJob, layout_step_model, simulate
from oobleck_elastic.simulation.recovery_cost import RecoveryConstants, default_constants, fit_constants, load_constants
from oobleck_elastic.simulation.trace import Trace, fixed_trace, parse_duration, trace_from_spec

__all__ = ["main", "build_parser", "PAPER_TABLE2_SETUP"]

PAPER_TABLE2_SETUP = {
    "synthetic": "gpt", "model_size": "6.7B", "nnodes": 30, "nproc_per_node": 1, "fault_tolerance": 1,
    "global_batch": 1024, "microbatch": 2, "memory_per_worker": "48GB", "tflops": 60.0,
}
"""The paper's GPT-3 6.7B job (its Table 1: global batch 1024, microbatch 2) on 30 nodes of one
48 GB GPU (A40-class); 60 sustained TFLOPS per GPU (40% of an A40's dense BF16 peak) and f = 1
are our assumptions. Every value can be overridden with its option."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like every other error of this CLI
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m oobleck_elastic.simulate", description=__doc__.split("\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_job_arguments(p, required=False)
    p.add_argument("--trace", metavar="FILE|fixed:INTERVAL|poisson:MEAN",
                   help="a CSV of time,kind,node lines, the paper's fixed removals (e.g. fixed:10min) or "
                        "Poisson preemptions (e.g. poisson:7.7min)")
    p.add_argument("--events", type=int, default=100, metavar="K", help="preemptions of a poisson trace (default 100)")
    p.add_argument("--replace-after", default="0", metavar="DURATION",
                   help="a preempted node is replaced after this long (e.g. 90s, 5min; 0: never)")
    p.add_argument("--end-nodes", type=int, default=None, help="a fixed trace stops at this many nodes (default N/2)")
    p.add_argument("--duration", default=None, metavar="DURATION", help="length of a CSV trace (default: its last "
                   "event plus 5%%)")
    p.add_argument("--seed", type=int, default=0, help="picks the failing nodes and the Poisson gaps")
    p.add_argument("--scenario", choices=["paper-table2"], help="the Oobleck paper's Table 2, beside its numbers")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="predict the time to train N steps instead of the throughput over the trace")
    p.add_argument("--checkpoint-interval", type=int, default=50, metavar="STEPS",
                   help="our runtime's checkpoint.interval (default 50; 0: none)")
    p.add_argument("--host-cores", type=int, default=0, metavar="K",
                   help="the job's workers share one host of K cores (a local CPU job; default 0: a device each)")
    p.add_argument("--checkpoint-write", default="0", metavar="DURATION",
                   help="training stall per checkpoint of our runtime (default 0: not modelled)")
    p.add_argument("--baseline", action="append", default=[], metavar="SYSTEM.FIELD=VALUE",
                   help="a baseline constant, e.g. restart.restart_s=120 (fields: see simulation/baselines.py)")
    p.add_argument("--layouts", choices=["exact", "per-count"], default="exact",
                   help="exact: plan every change as the runtime does; per-count: plan each (node count, "
                        "change) once and reuse it (fast at 1,000+ nodes)")
    p.add_argument("--constants", metavar="FILE", help="recovery constants written by --fit (default: the "
                   "ones measured for this project)")
    p.add_argument("--fit", nargs="+", metavar="METRICS", help="fit recovery constants to metrics logs and print "
                   "them (with the job options, the step overhead too)")
    p.add_argument("--fit-out", metavar="FILE", help="with --fit: also write the constants to FILE")
    p.add_argument("--fit-source", metavar="TEXT", help="with --fit: where the logs come from (kept with the "
                   "constants; default: the command)")
    p.add_argument("--plot", default="runs/simulate/throughput.png", metavar="PNG", help="where to draw the "
                   "throughput over time ('' for none)")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} instead of tables')
    return p


def _baselines(items: Sequence[str]) -> Baselines:
    parts: dict[str, dict[str, float]] = {"restart": {}, "redundant": {}, "torchrun": {}}
    for item in items:
        key, sep, value = item.partition("=")
        system, _, field = key.partition(".")
        if not sep or system not in parts:
            raise ConfigError(f"--baseline {item!r}: write SYSTEM.FIELD=VALUE with SYSTEM one of restart, redundant, "
                              "torchrun (e.g. restart.restart_s=120)")
        cls = type(getattr(Baselines(), system))
        names = [f.name for f in dataclasses.fields(cls)]
        if field not in names:
            raise ConfigError(f"--baseline {item!r}: {system} has no field {field!r}; fields: {', '.join(names)}")
        number = parse_duration(value, f"--baseline {key}") if field.endswith("_s") else _number(value, key)
        parts[system][field] = number
    return Baselines(**{name: type(getattr(Baselines(), name))(**fields) for name, fields in parts.items()})


def _number(value: str, key: str) -> float:
    try:
        number = float(value)
    except ValueError as exc:
        raise ConfigError(f"--baseline {key}={value!r}: not a number") from exc
    if number < 0:
        raise ConfigError(f"--baseline {key} must be >= 0, got {value}")
    return number


def _apply_scenario(args: argparse.Namespace) -> None:
    if args.profile:
        raise ConfigError("--scenario paper-table2 plans a synthetic GPT-3 6.7B; drop --profile")
    for name, value in PAPER_TABLE2_SETUP.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.trace:
        raise ConfigError("--scenario paper-table2 replays the paper's fixed traces; drop --trace")


def _job(args: argparse.Namespace) -> SimJob:
    if not (args.profile or args.synthetic) or None in (args.nnodes, args.global_batch, args.microbatch):
        raise ConfigError("describe the job: --profile FILE or --synthetic gpt:LAYERS, with --nnodes, --global-batch "
                          "and --microbatch (or use --scenario paper-table2)")
    planner, profile, cluster = job_inputs(args)
    if args.checkpoint_interval < 0:
        raise ConfigError(f"--checkpoint-interval must be >= 0 steps, got {args.checkpoint_interval}")
    return SimJob(profile=profile, cluster=cluster, fault_tolerance=args.fault_tolerance,
                  global_batch=args.global_batch, microbatch=args.microbatch, wide=args.wide or planner.wide,
                  virtual_stages=args.virtual_stages, checkpoint_interval_steps=args.checkpoint_interval,
                  checkpoint_write_s=parse_duration(args.checkpoint_write, "--checkpoint-write"),
                  host_cores=args.host_cores)


def _traces(args: argparse.Namespace) -> list[Trace]:
    if args.scenario == "paper-table2":
        return [fixed_trace(parse_duration(i), nodes=args.nnodes, end_nodes=args.end_nodes or args.nnodes // 2)
                for i in ("6h", "1h", "10min")]
    if not args.trace:
        raise ConfigError("--trace is missing: give a CSV file, fixed:INTERVAL (e.g. fixed:1h) or poisson:MEAN "
                          "(e.g. poisson:10min)")
    if args.events < 0:
        raise ConfigError(f"--events must be >= 0, got {args.events}")
    trace = trace_from_spec(args.trace, nodes=args.nnodes, events=args.events, seed=args.seed,
                            replace_after_s=parse_duration(args.replace_after, "--replace-after"),
                            end_nodes=args.end_nodes)
    if args.duration is not None:
        trace = dataclasses.replace(trace, duration_s=parse_duration(args.duration, "--duration"))
    return [trace]


def _fit(args: argparse.Namespace) -> RecoveryConstants:
    described = bool(args.profile or args.synthetic)
    model = layout_step_model(_job(args)) if described else None
    return fit_constants(args.fit, model, source=args.fit_source or "fitted by python -m oobleck_elastic.simulate "
                         "--fit " + " ".join(args.fit))


def run(args: argparse.Namespace) -> dict:
    if args.fit:
        constants = _fit(args)
        if args.fit_out:
            constants.save(args.fit_out)
        return {"constants": constants}
    if args.scenario:
        _apply_scenario(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise ConfigError(f"--systems: unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    job = _job(args)
    traces = _traces(args)
    constants = load_constants(args.constants) if args.constants else default_constants()
    baselines = _baselines(args.baseline)
    started = time.perf_counter()
    plan = job.plan(args.nnodes)
    cache: dict = {}
    results = [r for trace in traces for r in simulate(job, trace, constants, baselines=baselines, systems=systems,
                                                        seed=args.seed, layouts=args.layouts,
                                                        goal_steps=args.steps, plan=plan, cache=cache)]
    return {"results": results, "job": job, "plan": plan, "constants": constants, "baselines": baselines,
            "seconds": time.perf_counter() - started, "traces": traces}


def _describe(args: argparse.Namespace, out: dict) -> list[str]:
    job, plan = out["job"], out["plan"]
    inst = plan.instantiation
    events = sum(len(t.events) for t in out["traces"])
    lines = [f"job: {job.profile.signature}, {args.nnodes} nodes x {job.cluster.workers_per_node} workers, "
             f"f = {job.fault_tolerance}, global batch {job.global_batch}, microbatch {job.microbatch}; first "
             f"layout {len(inst.pipelines)} pipelines, {inst.iteration_ms / 1e3:.3f} s per step (cost model)",
             out["constants"].describe(),
             f"transfers at {job.cluster.inter_node_bandwidth:g} GB/s (planner.inter_node_bandwidth); layouts: "
             f"{args.layouts}; {events} events simulated in {out['seconds']:.2f} s"]
    for name in ("restart", "redundant", "torchrun"):
        values = ", ".join(f"{k}={v:g}" for k, v in dataclasses.asdict(getattr(out["baselines"], name)).items())
        lines.append(f"{name}: {values} ({SOURCES[name]})")
    return lines


def _print(args: argparse.Namespace, out: dict) -> None:
    results = out["results"]
    paper = args.scenario == "paper-table2"
    if args.json:
        json.dump({"rows": report.rows(results, paper=paper)}, sys.stdout, indent=1)
        print()
        return
    print("\n".join(_describe(args, out)))
    print()
    print(report.results_table(results))
    if args.steps is not None:
        for r in results:
            print(f"{r.system}: {args.steps} steps in {r.finished_at:.1f} s" if r.finished_at is not None
                  else f"{r.system}: did not reach {args.steps} steps")
    if paper:
        print("\nThe paper's Table 2 (GPT-3 6.7B, samples/s) beside the simulation")
        print(report.paper_table(results))
        print(report.PAPER_EXPLANATION)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
        if "constants" in out and "results" not in out:
            print(json.dumps(dataclasses.asdict(out["constants"]), indent=1))
            print(out["constants"].describe(), file=sys.stderr)
            return 0
        _print(args, out)
        if args.plot:
            title = f"{out['job'].profile.signature} on {args.nnodes} nodes"
            path = report.plot(out["results"], args.plot, title)
            if not args.json:
                print(f"\nplot: {path}")
    except OobleckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
