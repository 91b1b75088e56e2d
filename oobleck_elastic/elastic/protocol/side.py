"""What every participant of a run reads on the store (workers, agents, the launcher): the
generation records, a stop request, the run's failure and end, the nodes' registrations, and
whether a node is alive (`Liveness`). Each audience's own calls are a subclass: `WorkerSide`,
`CheckpointSide`, `AgentSide`, `LauncherSide`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from oobleck_elastic.elastic.protocol.keys import key
from oobleck_elastic.elastic.protocol.liveness import Liveness
from oobleck_elastic.elastic.protocol.waits import Clocks, wait_until
from oobleck_elastic.elastic.records import GenerationRecord
from oobleck_elastic.elastic.stores import MembershipStore

__all__ = ["Side"]

T = TypeVar("T")


class Side:
    """One process's view of the run on `store`. `lease_timeout`: how long a lease may stand
    still before its node is dead."""

    def __init__(self, store: MembershipStore, lease_timeout: float = 30.0, clocks: Clocks | None = None) -> None:
        self.store, self.clocks = store, clocks or Clocks()
        self.liveness = Liveness(store, lease_timeout, self.clocks)

    def wait(self, what: str, check: Callable[[], T | None], timeout: float) -> T:
        return wait_until(what, check, timeout, self.store.poll_s, poll_max_s=self.store.poll_max_s,
                          clock=self.clocks.clock, sleep=self.clocks.sleep)

    # --- generations --------------------------------------------------------------------------

    def pointer(self, timeout: float) -> GenerationRecord:
        """The `generation` pointer: the rendezvous's bare record until the first change."""
        return GenerationRecord.from_json(self.store.get_json(key("pointer"), timeout))

    def try_pointer(self) -> GenerationRecord | None:
        data = self.store.try_get_json(key("pointer"))
        return None if data is None else GenerationRecord.from_json(data)

    def record(self, generation: int, timeout: float = 10.0) -> GenerationRecord:
        return GenerationRecord.from_json(self.store.get_json(key("generation", generation=generation), timeout))

    def try_record(self, generation: int) -> GenerationRecord | None:
        data = self.store.try_get_json(key("generation", generation=generation))
        return None if data is None else GenerationRecord.from_json(data)

    def current(self, timeout: float) -> GenerationRecord:
        """The newest generation record. The pointer is a hint that may lag (it is written after
        each compare-and-set, not with it), so the records after it are looked for."""
        record = self.pointer(timeout)
        while (newer := self.try_record(record.generation + 1)) is not None:
            record = newer
        return record

    # --- the run's course ---------------------------------------------------------------------

    def request_stop(self, by: str) -> None:
        """Asks the run to stop after the step being computed (the next commit carries it)."""
        self.store.set_json(key("stop"), {"by": by, "at": self.clocks.wall()})

    def stop_requested(self) -> bool:
        return self.store.try_get_json(key("stop")) is not None

    def publish_failure(self, error: str, by: str) -> None:
        """The run cannot go on (a worker's fatal error): joiners stop waiting, the launcher
        stops the job and says why. The first failure stands."""
        self.store.create_json(key("failed"), {"error": error, "by": by, "at": self.clocks.wall()})

    def failure(self) -> dict | None:
        return self.store.try_get_json(key("failed"))

    def done(self) -> dict | None:
        """The run's end record (steps, and whether it stopped on request), or None."""
        return self.store.try_get_json(key("done"))

    def finished(self) -> bool:
        return self.done() is not None

    # --- nodes --------------------------------------------------------------------------------

    def registered(self) -> int:
        """How many nodes registered (node ids are 0 .. registered() - 1)."""
        return self.store.add(key("next node"), 0)

    def node_info(self, node: int) -> dict | None:
        """What `node` said of itself when it registered (host, pid, heartbeat)."""
        return self.store.try_get_json(key("node", node=node))
