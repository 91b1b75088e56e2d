"""Planner tour: profile the GPT example here and plan it for a local N-node job.

    python -m examples.gpt.plan_demo                      # 4 nodes x 1 worker
    python -m examples.gpt.plan_demo --nnodes 6 --set fault_tolerance=2

Prints the pipeline templates, the instantiation, and what happens when a node fails and when
a node joins back: the plans the training runtime will execute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from examples.gpt.model import gpt_model, parse_gpt_config
from oobleck_elastic.config import load_config
from oobleck_elastic.errors import exit_status
from oobleck_elastic.planning import reconfigure
from oobleck_elastic.planning.job import make_cluster, plan_job
from oobleck_elastic.planning.report import (
    fmt_bytes,
    instantiation_table,
    reconfiguration_text,
    templates_table,
)
from oobleck_elastic.runtime.profiler import load_or_profile

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.gpt.plan_demo", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(HERE, "config.yaml"), help="job YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--nnodes", type=int, default=4, help="local nodes to plan for")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers per node")
    p.add_argument("--fail", type=int, default=1, help="node id to fail in the demonstration")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.set)
    spec = gpt_model(parse_gpt_config(cfg.model))
    start = time.perf_counter()
    profile, cached = load_or_profile(
        spec, directory=cfg.planner.profile_dir, microbatch_size=cfg.train.microbatch_size,
        precision=cfg.train.precision, seed=cfg.train.seed, iterations=cfg.planner.profile_iterations,
        optimizer=cfg.train.optimizer)
    how = "cached profile" if cached else f"profiled in {time.perf_counter() - start:.1f} s"
    print(f"GPT example: {profile.num_layers} layers, {how} ({profile.device}, {profile.dtype}, "
          f"microbatch {profile.microbatch_size})")
    for layer in profile.layers:
        print(f"  {layer.name:8s} fwd {layer.forward_ms:6.2f} ms  bwd {layer.backward_ms:6.2f} ms  "
              f"state {fmt_bytes(layer.state_bytes):>10s}  activations {fmt_bytes(layer.activation_bytes):>10s}")
    cluster = make_cluster(cfg.planner, profile, args.nproc_per_node)
    nodes = list(range(args.nnodes))
    job = plan_job(profile, cluster, nodes=nodes, fault_tolerance=cfg.fault_tolerance,
                   global_batch=cfg.train.global_batch_size, microbatch_size=cfg.train.microbatch_size,
                   wide=cfg.planner.wide, virtual_stages=cfg.train.stages_per_worker)
    print(f"\nPipeline templates ({args.nnodes} nodes x {args.nproc_per_node} worker(s), "
          f"f = {cfg.fault_tolerance}, {fmt_bytes(cluster.memory_per_worker)} per worker)")
    print(templates_table(job.templates))
    print("\nInstantiation")
    print(instantiation_table(job.instantiation))
    failed = reconfigure(job.templates, job.instantiation, lost=[args.fail])
    print(f"\nNode {args.fail} fails")
    print(reconfiguration_text(failed))
    rejoined = reconfigure(job.templates, failed.instantiation, joined=[args.nnodes])
    print(f"\nNode {args.nnodes} joins")
    print(reconfiguration_text(rejoined))
    print(f"\nProfile file: {os.path.abspath(profile_path_of(cfg, spec))}")
    print("Try other plans with the dry-run CLI, e.g.:\n  python -m oobleck_elastic.plan --profile "
          f"{profile_path_of(cfg, spec)} --nnodes 8 --global-batch {cfg.train.global_batch_size} "
          f"--microbatch {cfg.train.microbatch_size} --memory-per-worker 8MB --fail 0,5 --json")


def profile_path_of(cfg, spec) -> str:
    from oobleck_elastic.runtime.profiler import profile_path

    return profile_path(cfg.planner.profile_dir, spec, microbatch_size=cfg.train.microbatch_size,
                        precision=cfg.train.precision, optimizer=cfg.train.optimizer)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_status(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
