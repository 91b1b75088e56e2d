"""A training worker's process entry: reads who it is from its agent's environment (or trains
alone without one), connects to the membership store, and runs the run (elastic/run.py, driven
by elastic/controller.py) until it ends, closing everything it opened on every way out."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import torch
import torch.distributed as dist

from oobleck_elastic.config import JobConfig
from oobleck_elastic.elastic.controller import MAX_REPLAYS_WITHOUT_LOSS
from oobleck_elastic.elastic.job import WorkerIdentity
from oobleck_elastic.elastic.process import check_lease, stop_or_die, watch_parent
from oobleck_elastic.elastic.protocol import AgentSide, Liveness, Side
from oobleck_elastic.elastic.run import Run
from oobleck_elastic.elastic.stores import StoreUnreachable, connect_store, host_store
from oobleck_elastic.errors import ConfigError, OobleckError, RunFailed
from oobleck_elastic.runtime.fault_hook import NO_FAULTS
from oobleck_elastic.runtime.model import ModelSpec
from oobleck_elastic.runtime.trainer import Dataset
from oobleck_elastic.testing.faults import FaultInjector

__all__ = ["MAX_REPLAYS_WITHOUT_LOSS", "run_worker", "worker_from_environ"]

logger = logging.getLogger(__name__)


def worker_from_environ() -> tuple[str, WorkerIdentity] | None:
    """(store URL, identity) as the agent tells its workers, or None outside an oobleck job."""
    env = os.environ
    if "OOBLECK_STORE" not in env:
        return None
    return env["OOBLECK_STORE"], WorkerIdentity(env["OOBLECK_RUN_ID"], int(env["OOBLECK_NODE_ID"]),
                                                int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]))


def _publish_failure(store, who: WorkerIdentity, exc: RunFailed) -> None:
    try:
        Side(store).publish_failure(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500],
                                        f"node {who.node} rank {who.local_rank}")
    except (OobleckError, RuntimeError) as store_error:  # the store is gone too: the agent's exit tells
        logger.warning("could not publish the run's failure: %s", store_error)


def run_worker(model: ModelSpec, dataset: Dataset, cfg: JobConfig, eval_dataset: Dataset | None = None) -> None:
    """Trains `model` on `dataset` as one worker of the run its agent started; with no oobleck
    environment, trains alone (one node, one worker: the single-process reference).
    `eval_dataset`: the held-out data of eval.interval."""
    if cfg.eval.interval and eval_dataset is None:
        raise ConfigError("eval.interval is set but the job has no eval data: set data.eval_tokens to a token file, "
                          "or pass eval_dataset to run_worker")
    found, alone, fault = worker_from_environ(), None, NO_FAULTS
    if found is None:  # the store lives as long as this process
        alone = host_store("127.0.0.1", 0, "standalone")
        found = alone.url, WorkerIdentity("standalone", 0, 0, 1)
        AgentSide(alone).begin(min_nodes=1, max_nodes=1)
        if cfg.fault_tolerance:
            logger.warning("running alone: fault_tolerance=%d needs more nodes, using 0", cfg.fault_tolerance)
            cfg = dataclasses.replace(cfg, fault_tolerance=0)
    else:
        watch_parent()
    url, who = found
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    store = connect_store(url, who.run_id, timeout=cfg.elastic.join_timeout_s,  # a shorter outage is ridden out
                          outage_timeout=cfg.elastic.lease_timeout_s, lost_after=cfg.elastic.lease_timeout_s / 2)
    if alone is None:
        check_lease(store, who.node, cfg)
        fault = FaultInjector.from_environ(who.node, Liveness(store))
    run = Run(model, dataset, cfg, who, store, fault, eval_dataset if cfg.eval.interval else None)

    standalone = alone is not None

    def stop(signum, frame) -> None:  # Note: [stop on request]: the run stops after its step
        if standalone:
            run.stop_requested = True
        else:
            stop_or_die(who.node, who.local_world_size, lambda: setattr(run, "stop_requested", True))
    signal.signal(signal.SIGTERM, stop)
    try:
        reason = run.run()
    except (dist.DistNetworkError, dist.DistStoreError, StoreUnreachable) as exc:
        said = str(exc).splitlines()[0] if isinstance(exc, StoreUnreachable) else \
            f"the membership store at {store.url} is unreachable ({str(exc).splitlines()[0][:120]})"
        raise OobleckError(
            f"{said}; "
            "the embedded store does not outlive the process hosting it. Host it on a machine that stays "
            "up (the launcher does for local jobs) or use the etcd store") from exc
    except RunFailed as exc:  # say so to the others (joiners, the launcher), then fail as before
        _publish_failure(store, who, exc)
        raise
    finally:
        run.close()
        del alone
    if reason == "fenced":
        raise SystemExit(3)  # after cleanup: the agent sees this worker leave as fenced
