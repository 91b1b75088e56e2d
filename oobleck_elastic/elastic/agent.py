"""The oobleck elastic agent: torch's LocalElasticAgent with the `oobleck` rendezvous, which
registers the node, keeps its lease and tells the workers where the run lives.

Note: [stop on request]
    A scheduler stops a job by sending SIGTERM to its processes (before preemption, at the end
    of an allocation). torch's agent would kill its workers at once; this one asks the run to
    stop instead (`Side.request_stop`): the next step's commit carries the request to
    every worker, they finish that step, write the final checkpoint and exit 0, and a relaunch
    of the same job resumes from exactly there. A second SIGTERM kills the workers. Under stock
    torchrun the agent is torch's: it forwards the SIGTERM to its workers and gives them 30 s
    before SIGKILL; a worker that gets it while all its node's workers live asks for the stop
    itself (elastic/process.py `stop_or_die`), one whose sibling died (torch stopping the node
    after a failure) dies as before.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import PContext

from oobleck_elastic.elastic.protocol import AgentSide
from oobleck_elastic.elastic.rendezvous import OobleckRendezvousHandler

__all__ = ["OobleckAgent"]

logger = logging.getLogger(__name__)


class OobleckAgent(LocalElasticAgent):
    """torch's agent, but a SIGTERM stops the run after its current step (Note: [stop on
    request]) instead of killing this node's workers."""

    _stop_requested = False

    def __init__(self, *args, start_processes: Callable[..., PContext] | None = None, **kwargs) -> None:
        """`start_processes`: what starts the workers in place of torch's function of that name
        (the same arguments, a PContext back): the launcher forks them (launcher/forked_workers.py)."""
        super().__init__(*args, **kwargs)
        self._start_processes = start_processes

    def _start_workers(self, worker_group):
        handler = worker_group.spec.rdzv_handler
        assert isinstance(handler, OobleckRendezvousHandler), "the oobleck agent needs the oobleck rendezvous"
        if self._start_processes is None:
            assigned = super()._start_workers(worker_group)
        else:  # torch's method calls its module's start_processes: ours stands in for that call
            torchs = local_elastic_agent.start_processes
            local_elastic_agent.start_processes = self._start_processes
            try:
                assigned = super()._start_workers(worker_group)
            finally:
                local_elastic_agent.start_processes = torchs
        # torch registers its own handler when it starts the workers (PContext.start): ours replaces it
        signal.signal(signal.SIGTERM, lambda signum, frame: self._on_sigterm(handler))
        return assigned

    def _on_sigterm(self, handler: OobleckRendezvousHandler) -> None:
        if self._stop_requested:  # torch's shutdown sends the workers this signal: SIGKILL, not SIGTERM
            raise SignalException("a second SIGTERM: killing the workers", sigval=signal.SIGKILL)
        self._stop_requested = True
        handler.log.warning("SIGTERM: the run stops after its current step and writes a checkpoint "
                            "(a second SIGTERM kills the workers)")
        AgentSide(handler.store).request_stop(f"node {handler.node}'s agent (SIGTERM)")
