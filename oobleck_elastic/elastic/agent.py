"""The oobleck elastic agent: torch's LocalElasticAgent, telling workers where the run lives."""

from __future__ import annotations

import os

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from oobleck_elastic.elastic.rendezvous import OobleckRendezvousHandler

__all__ = ["OobleckAgent"]


class OobleckAgent(LocalElasticAgent):
    """Adds the membership store and node id to the workers' environment."""

    def _start_workers(self, worker_group):
        handler = worker_group.spec.rdzv_handler
        assert isinstance(handler, OobleckRendezvousHandler), "the oobleck agent needs the oobleck rendezvous"
        os.environ["OOBLECK_STORE"] = handler.store.endpoint
        os.environ["OOBLECK_RUN_ID"] = handler.store.run_id
        os.environ["OOBLECK_NODE_ID"] = str(handler.node)
        return super()._start_workers(worker_group)
