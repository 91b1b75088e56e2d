"""A training worker under the oobleck agent: joins the run, plans, trains, reports.

Every worker reads the same generation record and the same profile (measured once, by the
first worker of the first node, and published in the store), so all compute the same plan.
Global rank 0 writes the metrics log, TensorBoard and the progress record.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.store import EmbeddedStore, MembershipStore, host_store
from oobleck_elastic.monitoring.layout import render_layout
from oobleck_elastic.monitoring.metrics import JsonlSink, MetricsSink, MultiSink
from oobleck_elastic.monitoring.tensorboard import TensorBoardSink
from oobleck_elastic.planning import ModelProfile, TemplateSet, WorkerRef, instantiate, layer_holders, plan_templates
from oobleck_elastic.planning.job import make_cluster
from oobleck_elastic.planning.report import instantiation_table
from oobleck_elastic.planning.values import from_jsonable, to_jsonable
from oobleck_elastic.runtime.model import ModelSpec
from oobleck_elastic.runtime.plan import GenerationPlan
from oobleck_elastic.runtime.profiler import load_or_profile
from oobleck_elastic.runtime.trainer import Dataset, StepStats, Trainer

__all__ = ["WorkerEnv", "run_worker"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEnv:
    """What the agent tells a worker through its environment."""

    store_host: str
    store_port: int
    run_id: str
    node: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> WorkerEnv | None:
        if "OOBLECK_STORE" not in os.environ:
            return None
        host, _, port = os.environ["OOBLECK_STORE"].rpartition(":")
        return cls(store_host=host, store_port=int(port), run_id=os.environ["OOBLECK_RUN_ID"],
                   node=int(os.environ["OOBLECK_NODE_ID"]), local_rank=int(os.environ["LOCAL_RANK"]),
                   local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]))


def _watch_parent() -> None:
    """Workers exit when their agent dies (a SIGKILLed agent would otherwise leave orphans)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.2)

    threading.Thread(target=watch, name="oobleck-parent-watch", daemon=True).start()


def _profile(store: MembershipStore, env: WorkerEnv, first_node: int, model: ModelSpec, cfg: JobConfig) -> ModelProfile:
    if env.node == first_node and env.local_rank == 0:
        profile, _ = load_or_profile(model, directory=cfg.planner.profile_dir,
                                     microbatch_size=cfg.train.microbatch_size, dtype=cfg.train.dtype,
                                     seed=cfg.train.seed, iterations=cfg.planner.profile_iterations,
                                     optimizer=cfg.train.optimizer)
        store.set_json("profile", to_jsonable(profile))
        return profile
    return from_jsonable(ModelProfile, store.get_json("profile", cfg.elastic.join_timeout_s))


def _sinks(cfg: JobConfig) -> MetricsSink:
    return MultiSink([JsonlSink(cfg.monitoring.metrics_path), TensorBoardSink(cfg.monitoring.tensorboard_dir)])


def _generation_record(plan: GenerationPlan, ts: TemplateSet, num_layers: int, cfg: JobConfig) -> dict:
    rows = []
    holders = layer_holders(plan.instantiation, ts)
    pipe_of = {n: i for i, p in enumerate(plan.instantiation.pipelines) for n in p.nodes}
    for worker, layers in sorted(holders.items(), key=lambda kv: (pipe_of[kv[0].node], kv[1])):
        rows.append((pipe_of[worker.node], worker.node, worker.local_rank, layers))
    inst = plan.instantiation
    png = os.path.join(cfg.monitoring.tensorboard_dir, f"layout_generation_{plan.generation}.png")
    with open(png, "wb") as f:
        f.write(render_layout(rows, num_layers, f"gen {plan.generation}: {len(inst.pipelines)} pipelines, "
                                                f"{len(inst.nodes)} nodes"))
    return {"event": "generation", "generation": plan.generation, "start_step": plan.start_step,
            "nodes": list(inst.nodes), "spares": list(inst.spares),
            "pipelines": [{"nodes": list(p.nodes), "microbatches": p.microbatches} for p in inst.pipelines],
            "table": instantiation_table(inst), "layout_png": png}


def _step_record(stats: StepStats, plan: GenerationPlan, cfg: JobConfig) -> dict:
    inst = plan.instantiation
    return {"step": stats.step, "loss": stats.loss, "samples": stats.samples,
            "samples_per_s": stats.samples / stats.seconds if stats.seconds else 0.0,
            "step_time_s": stats.seconds, "grad_norm": stats.grad_norm, "generation": plan.generation,
            "nodes": len(inst.nodes), "num_pipelines": len(inst.pipelines),
            "pipelines": [p.microbatches for p in inst.pipelines], "total_steps": cfg.train.steps}


def run_worker(model: ModelSpec, dataset: Dataset, cfg: JobConfig, env: WorkerEnv | None = None) -> None:
    """Trains `model` on `dataset` as one worker of the run described by the environment; with
    no oobleck environment, trains alone (one node, one worker: the single-process reference)."""
    env = env or WorkerEnv.from_environ()
    local_server = None
    if env is None:
        local_server = host_store("127.0.0.1", 0, "standalone")
        env = WorkerEnv("127.0.0.1", local_server.port, "standalone", 0, 0, 1)
        local_server.set_json("generation", {"generation": 0, "nodes": [0], "start_step": 0})
        if cfg.fault_tolerance:
            logger.warning("running alone: fault_tolerance=%d needs more nodes, using 0", cfg.fault_tolerance)
            cfg = type(cfg)(**{**cfg.__dict__, "fault_tolerance": 0})
    else:
        _watch_parent()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    store = EmbeddedStore(env.store_host, env.store_port, env.run_id, timeout=cfg.elastic.join_timeout_s)
    record = store.get_json("generation", cfg.elastic.join_timeout_s)
    nodes = record["nodes"]
    profile = _profile(store, env, min(nodes), model, cfg)
    cluster = make_cluster(cfg.planner, profile, env.local_world_size)
    ts = plan_templates(profile, cluster, max_nodes=len(nodes), fault_tolerance=cfg.fault_tolerance,
                        total_microbatches=cfg.train.num_microbatches)
    inst = instantiate(ts, nodes, cfg.train.global_batch_size, cfg.train.microbatch_size)
    plan = GenerationPlan(generation=record["generation"], start_step=record["start_step"],
                          workers_per_node=env.local_world_size, instantiation=inst, templates=ts)
    me = WorkerRef(env.node, env.local_rank)
    trainer = Trainer(model=model, dataset=dataset, cfg=cfg, me=me, store=store.torch_store())
    sink = _sinks(cfg) if plan.rank_of(me) == 0 else None
    try:
        trainer.build(plan)
        if sink:
            sink.write(_generation_record(plan, ts, model.num_layers, cfg))
        while trainer.completed_steps < cfg.train.steps:
            stats = trainer.step()
            if sink:
                rec = _step_record(stats, plan, cfg)
                sink.write(rec)
                store.set_json("progress", rec)
        sums, norms = trainer.layer_summaries()
        if sink:
            sink.write({"event": "final", "steps": trainer.completed_steps, "param_sums": sums,
                        "param_norms": norms})
            store.set_json("done", {"steps": trainer.completed_steps})
    finally:
        trainer.close()
        if sink:
            sink.close()
        del local_server
