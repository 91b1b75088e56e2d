"""`python -m oobleck_elastic.plan`: dry-run the planner and print its plans.

Examples:
    python -m oobleck_elastic.plan --synthetic gpt:24 --nnodes 8 --nproc-per-node 1 \\
        --fault-tolerance 1 --global-batch 256 --microbatch 4 --fail 0,1 --join 2
    python -m oobleck_elastic.plan --profile profile.json ... --evaluate "0-4,4-9,9-12" --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from oobleck_elastic.config import PlannerConfig, load_config, parse_bytes
from oobleck_elastic.errors import ConfigError, OobleckError
from oobleck_elastic.planning import (
    Cluster,
    ModelProfile,
    plan_template,
    reconfigure,
    synthetic_gpt,
    template_from_bounds,
    to_jsonable,
)
from oobleck_elastic.planning.job import make_cluster, plan_job
from oobleck_elastic.planning.profile import GPT3_SIZES
from oobleck_elastic.planning.report import instantiation_table, reconfiguration_text, templates_table
from oobleck_elastic.planning.templates import nominal_microbatches

__all__ = ["main", "build_parser", "add_job_arguments", "job_inputs"]


def add_job_arguments(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """The planner's options (model, nodes, batch, memory, bandwidths), shared by the dry-run
    and the simulator CLIs; `required=False` lets a caller fill them in (a scenario)."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--profile", metavar="FILE", help="profile file written by the profiler")
    src.add_argument("--synthetic", metavar="gpt:LAYERS", help="a synthetic GPT-like profile (gpt: the layers of "
                     "--model-size)")
    p.add_argument("--model-size", metavar="SIZE", help=f"a GPT-3 size for --synthetic: {', '.join(GPT3_SIZES)} "
                   "(hidden size and blocks; default: hidden 4096)")
    p.add_argument("--tflops", type=float, default=None, metavar="T",
                   help="sustained TFLOPS per worker for --synthetic (default 100)")
    p.add_argument("--nnodes", type=int, required=required, help="nodes of the job (N)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="workers per node (G, default 1)")
    p.add_argument("--fault-tolerance", type=int, default=None, help="f: node failures to survive (default 1)")
    p.add_argument("--global-batch", type=int, required=required, help="global batch size in samples (B)")
    p.add_argument("--microbatch", type=int, required=required, help="microbatch size in samples (b)")
    p.add_argument("--memory-per-worker", help="per-worker memory budget, e.g. 16GiB "
                   "(default: planner.memory_per_worker, else the profiled device's memory)")
    p.add_argument("--wide", action="store_true", help="allow stages spanning several workers of a node")
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="stages per worker for the Interleaved1F1B schedule (default 1: one stage per worker)")
    p.add_argument("--config", metavar="FILE", help="job YAML: the planner section sets bandwidths")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oobleck_elastic.plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(p)
    p.add_argument("--fail", metavar="ID,...", help="node ids to fail (0..N-1)")
    p.add_argument("--join", type=int, default=0, metavar="K", help="nodes joining (ids N..N+K-1)")
    p.add_argument("--evaluate", metavar="SPLIT", help='estimate a stage split such as "0-4,4-9,9-12"')
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _profile(args: argparse.Namespace) -> ModelProfile:
    if args.profile:
        if args.model_size or args.tflops is not None:
            raise ConfigError("--model-size and --tflops describe a --synthetic model; a --profile has its own")
        return ModelProfile.load(args.profile)
    kind, _, count = args.synthetic.partition(":")
    if kind != "gpt" or not (count.isdigit() or (not count and args.model_size)):
        raise ConfigError(f"--synthetic expects gpt:LAYERS (e.g. gpt:24), or gpt with --model-size, "
                          f"got {args.synthetic!r}")
    shape = {}
    if args.model_size:
        if args.model_size not in GPT3_SIZES:
            raise ConfigError(f"unknown --model-size {args.model_size!r}; known sizes: {', '.join(GPT3_SIZES)}")
        blocks, hidden = GPT3_SIZES[args.model_size]
        shape = {"hidden": hidden}
        count = count or str(blocks + 2)
    if args.tflops is not None:
        if not args.tflops > 0:
            raise ConfigError(f"--tflops must be > 0, got {args.tflops}")
        shape["tflops"] = args.tflops
    return synthetic_gpt(int(count), microbatch_size=args.microbatch, **shape)


def job_inputs(args: argparse.Namespace) -> tuple[PlannerConfig, ModelProfile, Cluster]:
    """The planner settings, profile and cluster the job options describe (checked first)."""
    args.nproc_per_node = 1 if args.nproc_per_node is None else args.nproc_per_node
    args.fault_tolerance = 1 if args.fault_tolerance is None else args.fault_tolerance
    _positive(args, "nnodes", "nproc_per_node", "global_batch", "microbatch", "virtual_stages")
    if args.wide and args.virtual_stages > 1:
        raise ConfigError("--wide and --virtual-stages > 1 cannot be combined: interleaved stages run "
                          "one per worker")
    if args.fault_tolerance < 0:
        raise ConfigError(f"--fault-tolerance must be >= 0, got {args.fault_tolerance}")
    if args.global_batch % args.microbatch:
        raise ConfigError(f"--global-batch ({args.global_batch}) must be a multiple of --microbatch "
                          f"({args.microbatch})")
    planner = load_config(args.config, args.set).planner if (args.config or args.set) else PlannerConfig()
    profile = _profile(args)
    memory = parse_bytes(args.memory_per_worker, "--memory-per-worker") if args.memory_per_worker else None
    return planner, profile, make_cluster(planner, profile, args.nproc_per_node, memory)


def _parse_split(text: str, num_layers: int) -> list[int]:
    bounds = [0]
    for part in text.split(","):
        start, sep, end = part.strip().partition("-")
        if not (sep and start.isdigit() and end.isdigit()):
            raise ConfigError(f"--evaluate: '{part}' is not a layer range START-END")
        if int(start) != bounds[-1] or int(end) <= int(start):
            raise ConfigError(f"--evaluate: stages must be contiguous non-empty ranges from 0, "
                              f"got '{part}' after layer {bounds[-1]}")
        bounds.append(int(end))
    if bounds[-1] != num_layers:
        raise ConfigError(f"--evaluate: the split ends at {bounds[-1]} but the model has {num_layers} layers")
    return bounds


def _evaluate(args, profile, cluster, total) -> dict:
    bounds = _parse_split(args.evaluate, profile.num_layers)
    stages = len(bounds) - 1
    g = cluster.workers_per_node
    v = args.virtual_stages
    if stages % (g * v) and not args.wide:
        raise ConfigError(f"--evaluate: {stages} stages do not fill whole nodes of {g} workers "
                          f"({v} stage(s) per worker); use --wide to evaluate stages spanning workers")
    nodes = max(1, stages // (g * v)) if not args.wide else max(1, -(-stages // g))
    m = nominal_microbatches(total, nodes, args.nnodes)
    evaluated = template_from_bounds(profile, cluster, nodes, bounds, m, v)
    best = plan_template(profile, cluster, nodes, m, wide=args.wide, virtual_stages=v)
    over = [i for i, s in enumerate(evaluated.stages) if s.memory_bytes > cluster.memory_per_worker]
    return {"nodes": nodes, "microbatches": m, "iteration_ms": evaluated.iteration_ms,
            "stages": to_jsonable(evaluated.stages), "fits_memory": not over,
            "stages_over_memory": over,
            "optimal_iteration_ms": best.iteration_ms if best else None,
            "optimal_stages": [list(s.layers) for s in best.stages] if best else None}


def run(args: argparse.Namespace) -> dict:
    planner, profile, cluster = job_inputs(args)
    nodes = list(range(args.nnodes))
    job = plan_job(profile, cluster, nodes=nodes, fault_tolerance=args.fault_tolerance,
                   global_batch=args.global_batch, microbatch_size=args.microbatch,
                   wide=args.wide or planner.wide, virtual_stages=args.virtual_stages)
    out = {"templates": job.templates, "instantiation": job.instantiation, "_job": job}
    failed = [int(x) for x in args.fail.split(",") if x.strip()] if args.fail else []
    if failed or args.join:
        plan = reconfigure(job.templates, job.instantiation, lost=failed,
                           joined=range(args.nnodes, args.nnodes + args.join))
        out["reconfiguration"] = plan
    if args.evaluate:
        out["evaluation"] = _evaluate(args, profile, cluster, args.global_batch // args.microbatch)
    return out


def step_parts(job) -> dict[str, float]:
    """The estimated step of the first generation, whole and in its parts: the slowest
    pipeline's, on the stage that bounds it (PipelineTemplate.step_parts)."""
    inst = job.instantiation
    slowest = max(inst.pipelines, key=lambda p: p.iteration_ms)
    template = job.templates.get(slowest.template)
    assert template is not None, f"the instantiation uses the {slowest.template}-node template"
    return {"total": inst.iteration_ms, **template.step_parts(slowest.microbatches, len(inst.pipelines))}


def _print_tables(out: dict) -> None:
    job = out["_job"]
    print("Pipeline templates")
    print(templates_table(job.templates))
    print("\nInstantiation")
    print(instantiation_table(job.instantiation))
    parts = step_parts(job)
    print(f"  a step: {parts['schedule']:.1f} ms of pipeline schedule + {parts['all_reduce']:.1f} ms of gradient "
          f"all-reduce + {parts['optimizer']:.1f} ms of optimizer step (the slowest pipeline's bounding stage)")
    if "reconfiguration" in out:
        print("\nReconfiguration")
        print(reconfiguration_text(out["reconfiguration"]))
    if "evaluation" in out:
        ev = out["evaluation"]
        split = ",".join(f"{s['layers'][0]}-{s['layers'][1]}" for s in ev["stages"])
        best = ",".join(f"{a}-{b}" for a, b in ev["optimal_stages"]) if ev["optimal_stages"] else "none"
        print(f"\nEvaluation on {ev['nodes']} node(s), M = {ev['microbatches']}")
        print(f"  given   {split}: {ev['iteration_ms']:.2f} ms"
              + ("" if ev["fits_memory"] else f" (stages {ev['stages_over_memory']} exceed memory)"))
        if ev["optimal_iteration_ms"] is not None:
            print(f"  optimal {best}: {ev['optimal_iteration_ms']:.2f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except OobleckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        data = {k: to_jsonable(v) for k, v in out.items() if not k.startswith("_")}
        # a flat list of templates; what the set knows besides them sits beside it
        coverage = data.pop("templates")
        data = {"templates": coverage.pop("templates"), "coverage": coverage, **data}
        data["step_ms"] = step_parts(out["_job"])
        if "reconfiguration" in data:
            data["transfers"] = data["reconfiguration"]["transfers"]
        json.dump(data, sys.stdout, indent=1)
        print()
    else:
        _print_tables(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
