"""Simulator speed at scale: a 1,024-node, 8-GPU-per-node job under 1,000 preemptions.

    python benchmarks/simulator.py [--nodes 1024] [--events 1000] [--exact-events 20]

The job is a synthetic GPT-3 6.7B (34 layers, 80 GiB per GPU, global batch 32,768, microbatch
2), the trace 1,000 Poisson preemptions at the paper's EC2 mean of 7.7 min, each node replaced
5 min later (2,000 changes). It prints the wall time of the whole simulation (all four systems,
each beside its failure-free reference) with `--layouts per-count`, and the cost of one exact
change (`--layouts exact`: the runtime's plan_next and transfers_between on every event) timed
on the first `--exact-events` events, with the two modes' samples/s on that prefix side by
side. Goal: the whole trace under 60 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from oobleck_elastic.planning import Cluster, synthetic_gpt
from oobleck_elastic.planning.profile import GPT3_SIZES
from oobleck_elastic.simulation import SimJob, default_constants, poisson_trace, simulate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--events", type=int, default=1000)
    p.add_argument("--exact-events", type=int, default=20)
    args = p.parse_args()
    blocks, hidden = GPT3_SIZES["6.7B"]
    job = SimJob(profile=synthetic_gpt(blocks + 2, hidden=hidden, microbatch_size=2),
                 cluster=Cluster(workers_per_node=8, memory_per_worker=80 * 2**30), fault_tolerance=1,
                 global_batch=32768, microbatch=2)
    trace = poisson_trace(462, nodes=args.nodes, events=args.events, replace_after_s=300, seed=0)
    constants = default_constants()

    start, cpu = time.perf_counter(), time.process_time()
    plan = job.plan(args.nodes)
    planned = time.perf_counter() - start
    results = simulate(job, trace, constants, layouts="per-count", plan=plan)
    total, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"{args.nodes} nodes x 8 GPUs, {len(trace.events)} changes ({args.events} preemptions, mean 7.7 min, "
          f"replaced after 5 min), 4 systems: {total:.1f} s wall, {cpu:.1f} s CPU with --layouts per-count "
          f"(first plan {planned:.1f} s; goal < 60 s; load average {os.getloadavg()[0]:.1f})")
    for r in results:
        print(f"  {r.system:9s} {r.samples_per_s:10.1f} samples/s "
              f"({r.samples_per_s / r.failure_free_samples_per_s:.0%} of failure-free)"
              if r.failure_free_samples_per_s else f"  {r.system:9s} {r.note}")

    prefix = dataclasses.replace(trace, events=trace.events[:args.exact_events],
                                 duration_s=trace.events[args.exact_events].time_s)
    timed = {}
    for layouts in ("exact", "per-count"):
        start, cpu = time.perf_counter(), time.process_time()
        (ours,) = simulate(job, prefix, constants, layouts=layouts, systems=["oobleck"], plan=plan)
        timed[layouts] = (time.perf_counter() - start, ours.samples_per_s, time.process_time() - cpu)
    changes = 2 * len(prefix.events)  # the run's and its failure-free reference's
    wall, _, cpu = timed["exact"]
    print(f"exact layouts, first {len(prefix.events)} changes: {wall:.1f} s wall, {cpu:.1f} s CPU: "
          f"{cpu / changes:.2f} s CPU per planned change, so ~{cpu / changes * 2 * len(trace.events):.0f} s CPU "
          "for the whole trace")
    print(f"samples/s on those changes: exact {timed['exact'][1]:.2f}, per-count {timed['per-count'][1]:.2f} "
          f"(ratio {timed['per-count'][1] / timed['exact'][1]:.4f})")
    return 0 if total < 60 else 1


if __name__ == "__main__":
    sys.exit(main())
