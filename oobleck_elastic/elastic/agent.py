"""The oobleck elastic agent: torch's LocalElasticAgent, telling workers where the run lives
and keeping the node's heartbeat lease."""

from __future__ import annotations

import os

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from oobleck_elastic.elastic.membership import Heartbeat
from oobleck_elastic.elastic.rendezvous import OobleckRendezvousHandler

__all__ = ["OobleckAgent"]


class OobleckAgent(LocalElasticAgent):
    """Adds the membership store and node id to the workers' environment and beats the
    node's lease while it runs."""

    heartbeat: Heartbeat | None = None

    def _start_workers(self, worker_group):
        handler = worker_group.spec.rdzv_handler
        assert isinstance(handler, OobleckRendezvousHandler), "the oobleck agent needs the oobleck rendezvous"
        os.environ["OOBLECK_STORE"] = handler.store.endpoint
        os.environ["OOBLECK_RUN_ID"] = handler.store.run_id
        os.environ["OOBLECK_NODE_ID"] = str(handler.node)
        if self.heartbeat is None:
            interval = float(os.environ.get("OOBLECK_HEARTBEAT_S", "0.5"))
            self.heartbeat = Heartbeat(handler.store, handler.node, interval)
        return super()._start_workers(worker_group)

    def _exit_barrier(self):
        # torch waits here for every agent of the rendezvous (300 s by default), which a node
        # that died mid-run never reaches. Completion is agreed in the membership store
        # instead (the `done` record), so survivors leave as soon as their workers finish.
        if self.heartbeat is not None:
            self.heartbeat.stop()
