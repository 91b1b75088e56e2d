"""Multi-process harness for runtime tests: real processes, a real TCPStore, real gloo groups.

`run_job(phases, ...)` starts one process per node (one worker each), trains each phase's
layout for its steps in the same processes (rebuilding in place between phases, with the
planner's transfer plan), and returns the final parameters of every layer plus step records.
`reference(...)` trains the same model in one process on whole batches, independently of the
runtime, for comparison.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from dataclasses import dataclass

import torch

from examples.gpt.data import SyntheticTokens
from examples.gpt.model import GPTConfig, gpt_model
from oobleck_elastic.config import load_config
from oobleck_elastic.planning import (
    LayerProfile,
    ModelProfile,
    WorkerRef,
    build_instantiation,
    plan_templates,
)
from oobleck_elastic.planning.cost import Cluster
from oobleck_elastic.runtime.data import SampleOrder
from oobleck_elastic.runtime.layers import LayerState
from oobleck_elastic.runtime.lr import lr_factor
from oobleck_elastic.runtime.model import materialize_layer
from oobleck_elastic.runtime.plan import GenerationPlan

TINY = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=4, dropout=0.0, dataset_size=256)


def model_and_data(key: str):
    """The (ModelSpec, dataset) of a named test model: built the same way in every process."""
    if key == "gpt":
        return gpt_model(TINY), SyntheticTokens(TINY, seed=0)
    if key == "tied_padded":
        from tied_model import tied_padded
        return tied_padded()
    raise KeyError(key)


@dataclass(frozen=True)
class Phase:
    pipelines: tuple[tuple[int, ...], ...]
    """Node ids of each pipeline, in stage order (one worker a node)."""
    steps: int


def job_config(overrides=()):
    # train.device=cpu: in-process workers run on the CPU even where the pytest process sees GPUs
    return load_config(None, ["train.device=cpu", "train.dtype=float64", "train.global_batch_size=24",
                              "train.microbatch_size=2", "train.optimizer.lr=0.01", "elastic.collective_timeout_s=60",
                              "elastic.lease_timeout_s=90", "elastic.agreement_timeout_s=120", *overrides])


def templates_for(num_layers: int, max_nodes: int, virtual_stages: int = 1):
    layer = LayerProfile(name="l", forward_ms=1.0, backward_ms=2.0, param_bytes=1, grad_bytes=1,
                         optimizer_bytes=2, activation_bytes=1, output_bytes=1)
    profile = ModelProfile(signature="uniform", microbatch_size=1, dtype="float64", device="test",
                           torch_version="n/a", device_memory_bytes=None, layers=(layer,) * num_layers)
    return plan_templates(profile, Cluster(workers_per_node=1, memory_per_worker=10**9), max_nodes=max_nodes,
                          fault_tolerance=0, total_microbatches=64, virtual_stages=virtual_stages)


def plans_for(phases, num_layers, global_batch, microbatch, virtual_stages=1):
    ts = templates_for(num_layers, max(max(n for p in ph.pipelines for n in p) for ph in phases) + 1,
                       virtual_stages)
    plans = []
    start = 0
    for g, phase in enumerate(phases):
        inst = build_instantiation([ts.get(len(p)) for p in phase.pipelines], phase.pipelines,
                                   global_batch, microbatch)
        plans.append(GenerationPlan(generation=g, start_step=start, workers_per_node=1, instantiation=inst,
                                    templates=ts))
        start += phase.steps
    return ts, plans


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forbid_pickled_exchanges() -> None:
    """Makes any object exchange between peers fail in this process: nothing a worker receives
    may be unpickled (runtime.generation Note: [static stage shapes])."""
    def refuse(*args, **kwargs):
        raise AssertionError("a worker exchanged pickled objects with a peer")
    torch.distributed.send_object_list = torch.distributed.recv_object_list = refuse
    torch.distributed.broadcast_object_list = refuse


def _worker(node: int, nodes: int, port: int, phases, overrides, outdir: str, model_key: str) -> None:
    try:
        from oobleck_elastic.runtime.trainer import Trainer

        forbid_pickled_exchanges()
        torch.set_num_threads(1)
        cfg = job_config(overrides)
        store = torch.distributed.TCPStore("127.0.0.1", port, nodes, is_master=False,
                                           timeout=__import__("datetime").timedelta(seconds=60))
        spec, data = model_and_data(model_key)
        ts, plans = plans_for(phases, spec.num_layers, cfg.train.global_batch_size, cfg.train.microbatch_size,
                              cfg.train.stages_per_worker)
        me = WorkerRef(node, 0)
        trainer = Trainer(model=spec, dataset=data, cfg=cfg, me=me, store=store)
        records = []
        usage = []
        previous = None
        for phase, plan in zip(phases, plans):
            transfers = ()
            if previous is not None:
                lost = set(previous.instantiation.nodes) - set(plan.instantiation.nodes)
                assert not (lost & {n for p in plan.instantiation.pipelines for n in p.nodes})
                transfers = transfers_between(ts, previous, plan)
                trainer.close()  # generation g is gone before g+1 is measured and built
                usage.append(_usage())
            if me.node in plan.instantiation.nodes:
                trainer.build(plan, transfers)
                for _ in range(phase.steps):
                    s = trainer.step()
                    records.append({"step": s.step, "loss": s.loss, "samples": s.samples,
                                    "generation": plan.generation, "consumed": list(s.consumed),
                                    "replica_sets": len(trainer.generation.grad_groups),
                                    "overlapped": trainer.generation.overlapped})
            else:
                trainer.leave()
            previous = plan
        sums = norms = None
        if trainer.generation is not None:
            sums, norms = trainer.layer_summaries()
        state = {i: {k: v.detach().clone() for k, v in trainer.layers[i].module.state_dict().items()}
                 for i in trainer.layers.layers}
        torch.save({"records": records, "state": state, "sums": sums, "norms": norms, "usage": usage},
                   os.path.join(outdir, f"node{node}.pt"))
        trainer.shutdown()
    except BaseException:
        with open(os.path.join(outdir, f"node{node}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _usage() -> dict[str, int]:
    import gc

    import psutil

    gc.collect()
    proc = psutil.Process()
    return {"threads": proc.num_threads(), "fds": proc.num_fds(), "rss": proc.memory_info().rss}


def transfers_between(ts, before: GenerationPlan, after: GenerationPlan):
    """The transfers that take `before`'s holders to `after`'s layout (the planner's own)."""
    from oobleck_elastic.planning import plan_transfers

    gone = set(before.instantiation.nodes) - set(after.instantiation.nodes)
    return plan_transfers(ts, before.instantiation, after.instantiation, gone)


def spawn_ranks(target, world: int, *args, timeout: float = 120.0) -> list[tuple]:
    """Runs `target(rank, *args, queue)` in `world` spawned processes and returns what each put
    on the queue (one tuple each, its rank first), in arrival order; the processes are joined,
    or killed, whatever happens."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        return [queue.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def _context():
    # A fork server that has imported torch once makes each worker start in milliseconds
    # instead of paying the multi-second torch import per process; unlike plain fork it never
    # copies a parent that has already started torch's thread pools.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.pipelining", "runtime_harness", "tied_model",
                                "oobleck_elastic.runtime.trainer"])
    return ctx


def run_job(phases, tmp_path, overrides=(), timeout=240, model="gpt"):
    nodes = 1 + max(n for ph in phases for p in ph.pipelines for n in p)
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, nodes + 1, is_master=True,
                                       timeout=__import__("datetime").timedelta(seconds=60),
                                       wait_for_workers=False)
    ctx = _context()
    procs = [ctx.Process(target=_worker, args=(n, nodes + 1, port, phases, overrides, str(tmp_path), model))
             for n in range(nodes)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [open(tmp_path / f).read() for f in os.listdir(tmp_path) if f.endswith(".err")]
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    del store
    return {n: torch.load(tmp_path / f"node{n}.pt") for n in range(nodes)}


def reference(steps: int, overrides=()):
    """Single-process training on whole global batches, independent of the runtime."""
    cfg = job_config(overrides)
    spec = gpt_model(TINY)
    data = SyntheticTokens(TINY, seed=0)
    order = SampleOrder(len(data), cfg.train.seed)
    layers = [LayerState(materialize_layer(spec, i, seed=cfg.train.seed, dtype=torch.float64), cfg.train)
              for i in range(spec.num_layers)]
    model = torch.nn.Sequential(*(s.module for s in layers))
    params = [p for s in layers for p in s.params]
    for step in range(steps):
        x, y = data.batch(order.indices(step, cfg.train.global_batch_size))
        loss = spec.loss(model(x), y)  # a mean over the whole global batch
        loss.backward()
        if cfg.train.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip_norm)
        for s in layers:
            s.set_lr(lr_factor(cfg.train.lr_schedule, step, cfg.train.steps))
            s.optimizer.step()
            s.zero_grad()
    return {i: s.module.state_dict() for i, s in enumerate(layers)}
