"""The `oobleck` rendezvous: nodes register in the membership store, get node ids, keep a
heartbeat lease, and tell their workers where the run lives.

Membership is ours, not torch's: the handler admits nodes into the live membership itself and
reports no waiting nodes, so torch's agent never restarts healthy workers because of a
membership change (its agent restarts workers only when one of them exits or nodes wait).
torch's own per-agent bookkeeping (rank assignment, the exit barrier) gets a private store
prefix per node and a world of one, so no agent ever waits for another one, dead or alive.
Workers find the run through `OOBLECK_STORE`, `OOBLECK_RUN_ID` and `OOBLECK_NODE_ID`, set here
in the agent's environment, which torch copies into every worker it starts; that makes stock
torchrun and our launcher alike:

    torchrun --rdzv-backend=oobleck --rdzv-endpoint=HOST:29400 --nnodes=4 ... train.py
    torchrun --rdzv-backend=oobleck --rdzv-endpoint=ETCD:2379 --rdzv-conf=store=etcd ...

torchrun finds the handler through the `torchrun.handlers` entry point (`handler_entry_point`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch.distributed
from torch.distributed.elastic.rendezvous.api import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

from oobleck_elastic.elastic.logs import Prefixed, agent_prefix
from oobleck_elastic.elastic.protocol import AgentSide, Liveness, WaitTimeout
from oobleck_elastic.elastic.stores import EmbeddedStore, MembershipStore, StoreAddressInUse, StoreUnreachable
from oobleck_elastic.errors import ConfigError

__all__ = ["OobleckRendezvousHandler", "create_handler", "handler_entry_point", "open_store", "store_kind"]

logger = logging.getLogger(__name__)

STORES = ("embedded", "etcd")


def store_kind(conf: dict) -> str:
    """The membership store `--rdzv-conf store=...` names (default `embedded`)."""
    kind = str(conf.get("store", "embedded"))
    if kind not in STORES:
        raise ConfigError(f"--rdzv-conf store={kind} is not a membership store; use one of {', '.join(STORES)}")
    return kind


class OobleckRendezvousHandler(RendezvousHandler):
    """One node's membership: its id, its lease, and the environment of its workers."""

    def __init__(self, store: MembershipStore, *, min_nodes: int, max_nodes: int, timeout: float,
                 heartbeat_interval: float = 0.2) -> None:
        self.store = store
        self.protocol = AgentSide(store)
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.node: int | None = None
        self.log = Prefixed(logger, lambda: agent_prefix(self.store.run_id, self.node))
        self._heartbeat: Heartbeat | None = None

    def get_backend(self) -> str:
        return "oobleck"

    @property
    def use_agent_store(self) -> bool:
        return False

    @property
    def hosting(self) -> bool:
        """Whether this agent hosts the (embedded) store the others use."""
        return isinstance(self.store, EmbeddedStore) and self.store.is_master

    def _refuse_ended_run(self, restarted: bool = False) -> None:
        """A node started with the id of a run that finished or failed would join a run that
        trains no more (a failed one exited 0 on every node without training): it is refused.
        So is a node whose workers torch's agent restarts after the run failed (--max-restarts):
        they would exit 0 as if the run were over."""
        where = f"run '{self.store.run_id}' at {self.store.url}"
        if self.protocol.finished() and not restarted:
            raise RendezvousError(f"{where} has already finished; give each job its own --rdzv-id (a run's "
                                  "records stay in the store)")
        if (failure := self.protocol.failure()) is not None:
            error = (str(failure.get("error", "")).splitlines() or ["unknown error"])[0][:120]
            keys = "" if isinstance(self.store, EmbeddedStore) else f" (the keys under /oobleck/{self.store.run_id}/)"
            raise RendezvousError(
                f"{where} failed ({failure.get('by', 'a worker')}: {error}); give the new job its own --rdzv-id "
                f"(a failed run's records stay in the store, to be looked at), or delete its records{keys} "
                "to reuse this id")

    def _register(self) -> int:
        self._refuse_ended_run(restarted=self.node is not None)
        if self.node is not None:
            # torch's agent restarts this node's workers (one of them exited, and it stopped
            # the others): the run has lost them. Say so at once, so the survivors need not
            # wait for a lease, and come back as a new node that joins like any other.
            self.protocol.liveness.mark_dead(self.node, "its agent restarted its workers")
            assert self._heartbeat is not None, "a registered node beats"
            self._heartbeat.stop()
            self.log.warning("workers restarted: rejoining the run as a new node")
        self.node = self.protocol.register({"host": socket.gethostname(), "pid": os.getpid(),
                                            "heartbeat_s": self.heartbeat_interval})
        self._heartbeat = Heartbeat(self.store, self.node, self.heartbeat_interval)
        self.log.info("registered at %s", self.store.url)
        return self.node

    def _check_limits(self) -> None:
        """A node started with other `--nnodes` than the run's belongs to another job (two jobs
        on one endpoint with torchrun's default id `none`, say): it is refused before it
        registers. Nodes of jobs that differ in their config are refused by their workers
        (WorkerSide.check_same_job)."""
        run = self.protocol.limits()
        if run is not None and (run["min_nodes"], run["max_nodes"]) != (self.min_nodes, self.max_nodes):
            raise RendezvousError(
                f"this node was started with --nnodes={self.min_nodes}:{self.max_nodes}, but run "
                f"'{self.store.run_id}' at {self.store.url} has --nnodes={run['min_nodes']}:{run['max_nodes']}: "
                "it is another job. Give each job its own --rdzv-id (or its own endpoint)")

    def next_rendezvous(self) -> RendezvousInfo:
        if self.node is None:
            self._check_limits()
        node = self._register()
        if not self.protocol.begun():
            try:
                self.protocol.wait(f"{self.min_nodes} nodes to register",
                                   lambda: self.protocol.registered() >= self.min_nodes, self.timeout)
            except WaitTimeout as exc:
                raise RendezvousTimeoutError(
                    f"only {self.protocol.registered()} of {self.min_nodes} nodes joined within {self.timeout:g} s; "
                    "start the other nodes with the same --rdzv-endpoint and --rdzv-id") from exc
            self.protocol.begin(self.min_nodes, self.max_nodes)
        if node not in self.protocol.pointer(self.timeout).nodes:
            # Its workers start at once, get ready (profile, templates) and are admitted at a
            # step boundary (WorkerSide.ready_joiners).
            self.log.info("joining the running job")
        os.environ.update(OOBLECK_STORE=self.store.url, OOBLECK_RUN_ID=self.store.run_id,
                          OOBLECK_NODE_ID=str(node), OOBLECK_AGENT_PID=str(os.getpid()))
        if isinstance(self.store, EmbeddedStore):
            bootstrap = RendezvousStoreInfo(self.store.host, self.store.port)
        else:  # MASTER_ADDR/PORT for the workers; ours do not use them
            bootstrap = RendezvousStoreInfo(socket.gethostname(), _free_port())
        private = torch.distributed.PrefixStore(self.protocol.agent_prefix(node), self.store.torch_store())
        return RendezvousInfo(private, 0, 1, bootstrap)

    def is_closed(self) -> bool:
        return self.protocol.closed()

    def set_closed(self) -> None:
        self.protocol.close()

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.store.run_id

    def shutdown(self) -> bool:
        # Leave, do not close the job for everyone: torch calls this in launch_agent's finally.
        # An agent that stops before the run is done takes its node out of it.
        if self.node is None:
            return True
        assert self._heartbeat is not None, "a registered node beats"
        self._heartbeat.stop()
        if isinstance(self.store, EmbeddedStore) and not self.hosting:
            self.store.set_timeout(10.0)  # leaving is best effort: never block for long
        try:
            if not self.protocol.finished():
                self.protocol.liveness.mark_dead(self.node, "its agent stopped before the run finished")
            self.protocol.leave(self.node)
            if self.hosting:
                self._wait_for_others_to_leave()
            if self.protocol.finished() and self.protocol.everyone_left():  # the last to leave
                self.protocol.forget_working_state()  # Note: [store keys] in elastic/protocol/keys.py
        except (torch.distributed.DistError, StoreUnreachable) as exc:  # its host is gone
            self.log.warning("could not leave the run cleanly: %s", str(exc).splitlines()[0])
            return False
        return True

    def _wait_for_others_to_leave(self) -> None:
        """The agent hosting the embedded store keeps it up until every other node has left
        or is dead (marked, or its lease stopped): the store is the run's, and a host whose
        own workers stopped (fenced, say) must not take it from nodes that still train. So
        there is no deadline while a lease moves; a node that stops renewing its lease is
        given up on after a few heartbeats."""
        watcher = AgentSide(self.store, max(2.0, 4 * self.heartbeat_interval))
        logged = False
        while True:
            staying = [n for n in range(watcher.registered()) if not watcher.has_left(n)]
            live = set(staying) - watcher.liveness.dead(staying)
            if not live:
                return
            if not logged:
                self.log.warning("keeping the membership store up for node(s) %s, which are still in the run",
                                 sorted(live))
                logged = True
            time.sleep(0.1)


class Heartbeat:
    """An agent's lease: renewed every `interval` seconds by a daemon thread."""

    def __init__(self, store: MembershipStore, node: int, interval: float) -> None:
        self.liveness, self.node, self.interval = Liveness(store), node, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"oobleck-heartbeat-{node}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval):
            try:
                self.liveness.renew_lease(self.node)
                failures = 0
            except Exception as exc:  # a store hiccup must not end the lease: try again next beat
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("[%s] lease renewal failed (%d in a row): %s",
                                   agent_prefix(self.liveness.store.run_id, self.node), failures,
                                   str(exc).splitlines()[0][:160])

    def stop(self) -> None:
        self._stop.set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def open_store(params: RendezvousParameters, timeout: float, lost_after: float | None = None) -> MembershipStore:
    """The store `--rdzv-conf store=...` names at `--rdzv-endpoint`: `embedded` (default; an
    agent on the endpoint's machine hosts a TCPStore there) or `etcd` (a v2 etcd server)."""
    kind = store_kind(params.config)
    default_port = 2379 if kind == "etcd" else 29400
    host, _, given_port = (params.endpoint or f"127.0.0.1:{default_port}").rpartition(":")
    host, port = host or "127.0.0.1", int(given_port or default_port)
    if kind == "etcd":
        from oobleck_elastic.elastic.stores.etcd_v2 import EtcdAccess, EtcdStore

        if params.run_id in ("", "none"):
            raise ConfigError("--rdzv-id is required with --rdzv-conf store=etcd: a run's records stay "
                             "in etcd, so each job needs an id of its own")
        return EtcdStore(host, port, params.run_id, timeout=timeout, access=EtcdAccess.from_config(params.config))
    # Only the endpoint's machine hosts the store (or the one `is_host` names, where names are
    # ambiguous); on it, the first agent to bind the port wins and the others are clients.
    is_host = params.get_as_bool("is_host")
    if is_host if is_host is not None else _matches_machine_hostname(host):
        try:
            return EmbeddedStore(host, port, params.run_id, is_master=True, timeout=timeout)
        except StoreAddressInUse:  # another agent of this machine hosts it: be its client
            pass
    return EmbeddedStore(host, port, params.run_id, timeout=timeout, lost_after=lost_after)


def create_handler(params: RendezvousParameters) -> OobleckRendezvousHandler:
    timeout = float(params.get("join_timeout", 600))
    # --rdzv-conf heartbeat_interval: our launcher passes the job's elastic.heartbeat_interval_s
    heartbeat = float(params.get("heartbeat_interval", 0.2))
    if heartbeat <= 0:
        raise ConfigError(f"--rdzv-conf heartbeat_interval must be > 0 seconds, got {heartbeat}")
    # --rdzv-conf lease_timeout: our launcher passes elastic.lease_timeout_s (Note: [a store host that vanishes])
    lease_timeout = float(params.get("lease_timeout", 15.0))
    if lease_timeout <= 0:
        raise ConfigError(f"--rdzv-conf lease_timeout must be > 0 seconds, got {lease_timeout}")
    lost_after = lease_timeout / 2
    return OobleckRendezvousHandler(open_store(params, timeout, lost_after), min_nodes=params.min_nodes,
                                    max_nodes=params.max_nodes, timeout=timeout, heartbeat_interval=heartbeat)


def handler_entry_point():
    """The `torchrun.handlers` entry point: returns the handler creator."""
    return create_handler
