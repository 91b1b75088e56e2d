"""Whether a node is alive: the leases its agent renews, the marks of death, a fault injector's
record of a kill, and the first sign of a failure.

Note: [lease age]
    A lease that stands still is judged by two clocks. The reader's own: the lease has not
    moved for the whole timeout since the reader first saw its value. And the writer's: each
    beat carries its agent's wall time, so a reader that first looks after a failure (the roll
    call) knows the lease had already stood still before it looked. The writer's time alone
    would let a reader whose clock runs ahead take a live node for dead, so it counts only
    once the reader itself has seen the lease stand still for two thirds of the timeout (two
    beats of the roll call's three). A node killed just after a beat is then dead about
    2/3 of the window after the roll call starts, not a whole window (torch's own rendezvous
    compares its nodes' wall-clock heartbeats the same way, without the guard).
"""

from __future__ import annotations

from collections.abc import Iterable

from oobleck_elastic.elastic.protocol.keys import key
from oobleck_elastic.elastic.protocol.waits import Clocks
from oobleck_elastic.elastic.records import DeadMark
from oobleck_elastic.elastic.stores import MembershipStore

__all__ = ["Liveness"]


class Liveness:
    """What this process knows of the nodes' leases. `lease_timeout`: how long a lease may stand
    still before its node is dead."""

    def __init__(self, store: MembershipStore, lease_timeout: float = 30.0, clocks: Clocks | None = None) -> None:
        self.store, self.lease_timeout, self.clocks = store, lease_timeout, clocks or Clocks()
        self._seen: dict[int, tuple[object, float]] = {}  # node -> (lease beat, when it last moved)
        self._beats: dict[int, int] = {}  # the beats this process renewed, per node

    def marked_dead(self, node: int) -> bool:
        return self.store.try_get_json(key("dead", node=node)) is not None

    def mark_dead(self, node: int, why: str) -> None:
        """A mark is final: the node is dead to everyone from now on, even if it answers."""
        self.store.set_json(key("dead", node=node), DeadMark(why, self.clocks.wall()).to_json())

    def dead(self, nodes: Iterable[int], timeout: float | None = None) -> set[int]:
        """The nodes marked dead or whose lease stood still for `timeout` (default: the lease
        timeout; shorter where a failure is already known)."""
        timeout = self.lease_timeout if timeout is None else timeout
        now, out = self.clocks.clock(), set()
        for node in nodes:
            if self.marked_dead(node):
                out.add(node)
                continue
            beat = self.store.try_get_json(key("lease", node=node))
            last = self._seen.get(node)
            if last is None or last[0] != beat:
                self._seen[node] = (beat, now)
                continue
            still = now - last[1]
            at = beat.get("at") if isinstance(beat, dict) else None
            if still > timeout or (at is not None and still >= timeout * 2 / 3 and self.clocks.wall() - at > timeout):
                out.add(node)  # Note: [lease age]
        return out

    def forget(self, keep: Iterable[int] = ()) -> None:
        """Forgets when each lease but those of `keep` was last seen to move: a reader that
        could not see the store for a while (an outage, a stall) judges each lease afresh, from
        its next read."""
        kept = set(keep)
        self._seen = {node: seen for node, seen in self._seen.items() if node in kept}

    def last_seen(self, node: int) -> tuple[object, float] | None:
        """(the lease beat last read, for how many seconds it has stood still here), if read."""
        seen = self._seen.get(node)
        return None if seen is None else (seen[0], self.clocks.clock() - seen[1])

    def failed_at(self, node: int) -> float | None:
        """Wall time of the first sign of `node`'s failure: a fault injector's record of the
        kill; else the earlier of its lease's last renewal (a node that fails silently gives no
        other sign: its lease stands still from then; the time is the writer's clock) and its
        mark of death; else its last renewal observed here."""
        kill = self.store.try_get_json(key("fault", node=node))
        if isinstance(kill, dict) and isinstance(kill.get("time"), (int, float)):
            return float(kill["time"])
        signs = []
        for name in ("lease", "dead"):
            record = self.store.try_get_json(key(name, node=node))
            if isinstance(record, dict) and isinstance(record.get("at"), (int, float)):
                signs.append(float(record["at"]))
        if signs:
            return min(signs)
        if node in self._seen:
            beat, seen = self._seen[node]
            if isinstance(beat, dict) and isinstance(beat.get("at"), (int, float)):
                return float(beat["at"])
            return self.clocks.wall() - (self.clocks.clock() - seen)
        return None

    def renew_lease(self, node: int) -> None:
        """One beat of `node`'s lease: a plain write of the beat's number and the writer's wall
        time (one etcd request, where a counter takes a read and a compare-and-set); readers look
        for it to change, and at its time once it stands still (Note: [lease age])."""
        self._beats[node] = self._beats.get(node, 0) + 1
        self.store.set_json(key("lease", node=node), {"beat": self._beats[node], "at": self.clocks.wall()})

    def record_kill(self, node: int, record: dict) -> None:
        """A fault injector's kill (the first sign of the failure, for `failed_at`)."""
        self.store.set_json(key("fault", node=node), record)
