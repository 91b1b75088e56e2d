"""The oobleck elastic agent: torch's LocalElasticAgent with the `oobleck` rendezvous, which
registers the node, keeps its lease and tells the workers where the run lives."""

from __future__ import annotations

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from oobleck_elastic.elastic.rendezvous import OobleckRendezvousHandler

__all__ = ["OobleckAgent"]


class OobleckAgent(LocalElasticAgent):
    """Checks that it runs with the oobleck rendezvous; stock torchrun's agent works too."""

    def _start_workers(self, worker_group):
        handler = worker_group.spec.rdzv_handler
        assert isinstance(handler, OobleckRendezvousHandler), "the oobleck agent needs the oobleck rendezvous"
        return super()._start_workers(worker_group)
