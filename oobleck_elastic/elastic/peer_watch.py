"""A worker's watch over the other member nodes of its generation: a thread that ends the
generation's pending operations as soon as a member is known dead, however it failed.

Note: [silent members]
    A member that fails without a reset (its machine loses power, it is stopped, its network
    is cut) sends no error anyone could raise: a survivor blocked on it in a collective or a
    pipeline receive would wait out the group's timeout (elastic.collective_timeout_s), and
    leases are otherwise read only in the store waits between steps. So while a generation
    lives, each worker reads the leases of its generation's other member nodes every half
    heartbeat, over a store connection of its own. Once a lease has stood still for
    elastic.rollcall_window_s (at least three heartbeats: a live agent's lease keeps moving),
    or a node is marked dead, the member is known dead and the watch cuts the generation
    (runtime/connections.py, Note: [cutting a generation's connections]): the worker's step
    fails at once, as it does when a peer is SIGKILLed, the cut spreads to the peers, and the
    roll call (Note: [roll call]) finds the silent node dead without waiting, since its lease
    has already stood still for the roll call's window. The collective timeout is then a last
    resort, not the detector. Suspicion costs little: a live node whose beats stalled answers
    the roll call and the same nodes replay the step (exact either way). The watch only ever
    cuts the generation it was armed for; between generations it sleeps.

Note: [a still lease is evidence only beside a moving one]
    A store that is down or stalled (an etcd restart, a leader election) stops every lease at
    once, and when it is back the agents' renewals resume at their own pace: an etcd that was
    restarted serves reads before it has elected a leader to take writes, and renewals that
    failed meanwhile were seen to lag by 2.5 s. A peer's lease that has not moved since before
    the outage is no sign that the peer died. So the watch reads this node's own lease too
    (renewed by its agent on this host). While that one stands still, or the store cannot be
    read, it forgets when it last saw each peer's lease move, and for elastic.lease_timeout_s
    after the last such moment it judges by that timeout instead of the window: a peer is
    silent only once its lease has stood still for a while that began after this node's own
    lease moved again. A silent failure right after a store outage is then found at the lease
    timeout, and no live node is taken for dead because of the outage.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from oobleck_elastic.config import ElasticConfig
from oobleck_elastic.elastic.protocol.keys import key
from oobleck_elastic.elastic.protocol.liveness import Liveness
from oobleck_elastic.elastic.protocol.waits import Clocks
from oobleck_elastic.elastic.stores import MembershipStore, connect_store
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.reach import Responder, data_address

__all__ = ["PeerWatch", "Silence"]

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0  # close() waits this long for the thread (a store call in flight ends by then)


@dataclass(frozen=True)
class Silence:
    """What the watch found: the generation it cut and why."""

    generation: int
    nodes: tuple[int, ...]
    """The members known dead."""
    still_s: float
    """For how long their leases had stood still here (the longest), 0 where every one of them
    was marked dead (by its launcher or its agent) instead."""
    at: float
    """Wall time of the cut."""

    def __str__(self) -> str:
        how = f"their lease stood still {self.still_s:.2f} s" if self.still_s else "marked dead"
        return (f"node(s) {list(self.nodes)} went silent ({how}); generation {self.generation}'s connections "
                "were cut")


@dataclass(frozen=True)
class _Target:
    generation: int
    others: tuple[int, ...]
    cut: Callable[[int], bool]


class PeerWatch:
    """The watch of Note: [silent members]. `store`: a connection of its own (the worker's main
    thread uses the other); `window`: how long a lease may stand still (elastic.
    rollcall_window_s); `poll`: seconds between two reads of the leases; `calm`: how long a
    lease may stand still for a while after the store was in trouble (elastic.lease_timeout_s:
    Note: [a still lease is evidence only beside a moving one])."""

    def __init__(self, store: MembershipStore, node: int, window: float, poll: float, calm: float,
                 clocks: Clocks | None = None) -> None:
        self.store, self.node, self.window, self.poll, self.calm = store, node, window, poll, calm
        self._calm_until = float("-inf")
        self.clocks = clocks or Clocks()
        self.liveness = Liveness(store, lease_timeout=window, clocks=self.clocks)
        self._cond = threading.Condition()
        self._target: _Target | None = None
        self._stopped = False
        self._found: dict[int, Silence] = {}
        self.responder: Responder | None = None
        self._thread = threading.Thread(target=self._loop, name="oobleck-peer-watch", daemon=True)
        self._thread.start()

    @classmethod
    def for_run(cls, store: MembershipStore, run_id: str, node: int, rank: int, ela: ElasticConfig) -> PeerWatch:
        """The watch of worker `rank` of `node`, on a connection of its own to `store`, with the
        run's timeouts (elastic.rollcall_window_s, a poll of half a heartbeat, the lease timeout),
        and the worker's responder to its peers' probes, published (Note: [gray failures] in
        elastic/reachability.py)."""
        own = connect_store(store.url, run_id, timeout=ela.lease_timeout_s, outage_timeout=ela.rollcall_window_s,
                            lost_after=ela.lease_timeout_s / 2)
        watch = cls(own, node, ela.rollcall_window_s, ela.heartbeat_interval_s / 2, ela.lease_timeout_s)
        watch.responder = Responder(data_address())
        own.set_json(key("responder", node=node, rank=rank), list(watch.responder.endpoint))
        return watch

    def arm(self, generation: int, nodes: Iterable[int], cut: Callable[[int], bool]) -> None:
        """Watches `nodes` (a generation's members; this node is left out) until disarmed;
        `cut(generation)` ends the generation's pending operations, and says whether the
        generation was there to cut (it is tried again at the next poll if not)."""
        with self._cond:
            self._target = _Target(generation, tuple(n for n in nodes if n != self.node), cut)
            self._cond.notify()

    def disarm(self) -> None:
        """Stops watching; returns once no cut is under way."""
        with self._cond:
            self._target = None

    def found(self, generation: int) -> Silence | None:
        """Why `generation` was cut, if the watch cut it."""
        with self._cond:
            return self._found.get(generation)

    def cut(self, generation: int) -> bool:
        """Whether the watch cut `generation`."""
        return self.found(generation) is not None

    def close(self) -> None:
        with self._cond:
            self._stopped, self._target = True, None
            self._cond.notify()
        self._thread.join(JOIN_TIMEOUT_S)
        if self.responder is not None:
            self.responder.close()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._target is None and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                target = self._target
            assert target is not None, "armed"
            if target.others:
                self._look(target)
            with self._cond:
                if not self._stopped:
                    self._cond.wait(self.poll)

    def _store_trouble(self, keep: tuple[int, ...] = ()) -> None:
        """Note: [a still lease is evidence only beside a moving one]."""
        self.liveness.forget(keep)
        self._calm_until = self.clocks.clock() + self.calm

    def _look(self, target: _Target) -> None:
        try:
            own_still = bool(self.liveness.dead((self.node,), timeout=self.window))
            calm = own_still or self.clocks.clock() < self._calm_until
            dead = self.liveness.dead(target.others, timeout=self.calm if calm else self.window)
        except (OobleckError, RuntimeError, OSError) as exc:  # the store unreachable: the main thread says so
            logger.debug("[node %d] peer watch could not read the leases: %s", self.node, exc)
            self._store_trouble()
            return
        if own_still:  # this node's own lease stands still too: peers are judged again once it moves
            self._store_trouble(keep=(self.node,))
            return
        if not dead:
            return
        try:
            quiet = [n for n in sorted(dead) if not self.liveness.marked_dead(n)]
        except (OobleckError, RuntimeError, OSError):
            quiet = sorted(dead)
        seen = [self.liveness.last_seen(n) for n in quiet]
        still = max((s[1] for s in seen if s is not None), default=0.0)
        silence = Silence(target.generation, tuple(sorted(dead)), still, self.clocks.wall())
        with self._cond:
            if self._target is not target:  # disarmed meanwhile: that generation is over anyway
                return
            if not target.cut(target.generation):
                return  # not built yet: the next poll tries again
            self._target = None
            self._found[target.generation] = silence
        logger.warning("[node %d] %s", self.node, silence)
