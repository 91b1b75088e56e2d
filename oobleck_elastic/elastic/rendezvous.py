"""The `oobleck` rendezvous: nodes register in the membership store and get node ids.

The handler admits nodes into the live membership itself and reports no waiting nodes, so
torch's agent never restarts healthy workers because of a membership change (DESIGN.md,
torchrun). torchrun finds it through the `torchrun.handlers` entry point (`create_handler`).
"""

from __future__ import annotations

import logging
import os
import socket
import time

import torch.distributed
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from oobleck_elastic.elastic.store import EmbeddedStore

__all__ = ["OobleckRendezvousHandler", "create_handler", "handler_entry_point"]

logger = logging.getLogger(__name__)


class OobleckRendezvousHandler(RendezvousHandler):
    def __init__(self, store: EmbeddedStore, *, min_nodes: int, max_nodes: int, timeout: float) -> None:
        self.store = store
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.timeout = timeout
        self.node: int | None = None

    def get_backend(self) -> str:
        return "oobleck"

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        if self.node is None:
            self.node = self.store.register_node({"host": socket.gethostname(), "pid": os.getpid()})
            logger.info("[node %d] registered at %s", self.node, self.store.endpoint)
        deadline = time.monotonic() + self.timeout
        while self.store.add("nodes/next", 0) < self.min_nodes:
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"only {self.store.add('nodes/next', 0)} of {self.min_nodes} nodes joined within "
                    f"{self.timeout:.0f} s; start the other nodes with the same --rdzv-endpoint")
            time.sleep(0.05)
        record = {"generation": 0, "nodes": list(range(self.min_nodes)), "start_step": 0}
        self.store.create_json("generation", record)
        nodes = self.store.get_json("generation", self.timeout)["nodes"]
        info = RendezvousStoreInfo(self.store.host, self.store.port)
        if self.node not in nodes:
            # A node joining a running job: its workers start at once, get ready (profile,
            # templates) and are admitted at a step boundary (membership.ready_joiners). torch's
            # own bookkeeping for this agent goes to a private prefix of one.
            logger.info("[node %d] joining the running job", self.node)
            return RendezvousInfo(torch.distributed.PrefixStore(f"join{self.node}", self.store.torch_store()),
                                  0, 1, info)
        return RendezvousInfo(self.store.torch_store(), nodes.index(self.node), len(nodes), info)

    def is_closed(self) -> bool:
        return self.store.try_get_json("closed") is not None

    def set_closed(self) -> None:
        self.store.set_json("closed", True)

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.store.run_id

    def shutdown(self) -> bool:
        # Leave, do not close the job for everyone: torch calls this in launch_agent's finally.
        if self.node is not None:
            self.store.set_json(f"nodes/{self.node}/left", True)
        return True


def create_handler(params: RendezvousParameters) -> OobleckRendezvousHandler:
    host, _, port = (params.endpoint or "127.0.0.1:29400").rpartition(":")
    timeout = float(params.get("join_timeout", 600))
    try:
        store = EmbeddedStore(host or "127.0.0.1", int(port or 29400), params.run_id, is_master=True, timeout=timeout)
    except Exception:  # someone already hosts it at the endpoint: join as a client
        store = EmbeddedStore(host or "127.0.0.1", int(port or 29400), params.run_id, timeout=timeout)
    return OobleckRendezvousHandler(store, min_nodes=params.min_nodes, max_nodes=params.max_nodes, timeout=timeout)


def handler_entry_point():
    """The `torchrun.handlers` entry point: returns the handler creator."""
    return create_handler
