"""The etcd membership store across processes: compare-and-set with exactly one winner and
exact counters under contention from spawned processes, and gloo process groups bootstrapped
through it for several generations (the store within one process:
tests/store/test_etcd_store.py). `etcd_port` is the root conftest's: one server per module."""

from __future__ import annotations

import multiprocessing as mp

import torch
import torch.distributed as dist
from runtime_harness import spawn_ranks

from oobleck_elastic.elastic.stores import connect_store


def _contend(port: int, worker: int, queue) -> None:
    store = connect_store(f"etcd://127.0.0.1:{port}", "contend")
    won = store.create_json("decision", {"by": worker})
    counts = [store.add("counter", 1) for _ in range(25)]
    queue.put((worker, won, counts))


def test_compare_and_set_and_counters_across_processes(etcd_port):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(etcd_port, w, queue)) for w in range(4)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    winners = [w for w, won, _ in results if won]
    assert len(winners) == 1
    store = connect_store(f"etcd://127.0.0.1:{etcd_port}", "contend")
    assert store.get_json("decision", 1.0) == {"by": winners[0]}
    seen = sorted(c for _, _, counts in results for c in counts)
    assert seen == list(range(1, 101)), "every add saw a distinct value: none lost, none doubled"


def _generations(rank: int, port: int, world: int, queue) -> None:
    store = connect_store(f"etcd://127.0.0.1:{port}", "groups", timeout=60)
    sums = []
    for generation in range(3):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{generation}", store.torch_store()),
                                rank=rank, world_size=world)
        x = torch.full((4,), float(rank + generation))
        dist.all_reduce(x)
        sums.append(x[0].item())
        dist.destroy_process_group()
    queue.put((rank, sums))


def test_process_groups_bootstrap_through_etcd_for_several_generations(etcd_port):
    world = 3
    results = dict(spawn_ranks(_generations, world, etcd_port, world, timeout=180))
    expected = [sum(r + g for r in range(world)) for g in range(3)]
    assert all(results[r] == expected for r in range(world)), results
