"""The peer watch on a real (embedded) store: it cuts the generation it was armed for once a
member's lease stands still for the window, never while the leases beat, never after it was
disarmed, never while its own node's lease stands still too (a stalled store stops every
lease), and a cut that finds no generation built yet is tried again."""

from __future__ import annotations

import threading
import time

from oobleck_elastic.elastic.peer_watch import PeerWatch
from oobleck_elastic.elastic.protocol import Liveness
from oobleck_elastic.elastic.rendezvous import Heartbeat
from oobleck_elastic.elastic.stores import host_store

WINDOW, POLL, CALM = 0.3, 0.02, 1.5


class Cuts:
    """Records the cuts asked for; refuses the first `refuse` of them (a generation still being
    built is not there to cut)."""

    def __init__(self, refuse: int = 0) -> None:
        self.asked: list[int] = []
        self.refuse = refuse
        self.done = threading.Event()

    def __call__(self, generation: int) -> bool:
        self.asked.append(generation)
        if len(self.asked) <= self.refuse:
            return False
        self.done.set()
        return True


def beating(store, *nodes):
    return [Heartbeat(store, n, interval=0.05) for n in nodes]


def test_a_member_whose_lease_stands_still_gets_the_generation_cut_once():
    store = host_store("127.0.0.1", 0, "watch-silent")
    beats = beating(store, 0, 1, 2)
    watch = PeerWatch(store, node=0, window=WINDOW, poll=POLL, calm=CALM)
    try:
        cuts = Cuts()
        watch.arm(4, [0, 1, 2], cuts)
        time.sleep(3 * WINDOW)  # every lease beats: nothing to cut
        assert cuts.asked == [] and watch.found(4) is None
        beats[2].stop()  # node 2 goes silent
        assert cuts.done.wait(30), "the silent member was never found"
        time.sleep(3 * POLL)
        silence = watch.found(4)
        assert cuts.asked == [4], "cut once, the armed generation"
        assert silence is not None and silence.nodes == (2,) and silence.still_s >= WINDOW * 2 / 3
        assert "node(s) [2] went silent" in str(silence)
    finally:
        watch.close()
        for beat in beats:
            beat.stop()


def test_a_disarmed_watch_cuts_nothing_and_a_refused_cut_is_tried_again():
    store = host_store("127.0.0.1", 0, "watch-disarmed")
    own = Heartbeat(store, 0, interval=0.05)
    watch = PeerWatch(store, node=0, window=WINDOW, poll=POLL, calm=CALM)
    try:
        Liveness(store).renew_lease(1)  # one beat, then silence
        cuts = Cuts()
        watch.arm(1, [0, 1], cuts)
        watch.disarm()
        time.sleep(4 * WINDOW)
        assert cuts.asked == []
        retried = Cuts(refuse=2)  # generation 2 is still being built at the first two polls
        watch.arm(2, [0, 1], retried)
        assert retried.done.wait(30)
        assert retried.asked == [2, 2, 2] and watch.found(2).nodes == (1,)
    finally:
        watch.close()
        own.stop()


def test_a_node_marked_dead_is_cut_at_once():
    store = host_store("127.0.0.1", 0, "watch-marked")
    beats = beating(store, 0, 1)
    watch = PeerWatch(store, node=0, window=60.0, poll=POLL, calm=60.0)  # no lease stands still that long here
    try:
        cuts = Cuts()
        watch.arm(0, [0, 1], cuts)
        time.sleep(10 * POLL)
        assert cuts.asked == []
        Liveness(store).mark_dead(1, "its launcher saw it exit")
        assert cuts.done.wait(30)
        assert watch.found(0).nodes == (1,) and "marked dead" in str(watch.found(0))
    finally:
        watch.close()
        for beat in beats:
            beat.stop()


def test_while_its_own_lease_stands_still_the_watch_judges_nobody():
    """Every lease stops at once (a stalled store, as an etcd restart makes), then the renewals
    resume, the peer's two windows later than this node's: nobody is taken for silent, since
    after its own lease stood still the watch judges by the calm timeout for a while; once
    that has passed, a peer that goes silent is found as before."""
    store = host_store("127.0.0.1", 0, "watch-stall")
    beats = beating(store, 0, 1)
    watch = PeerWatch(store, node=0, window=WINDOW, poll=POLL, calm=CALM)
    try:
        cuts = Cuts()
        watch.arm(0, [0, 1], cuts)
        time.sleep(3 * POLL)
        for beat in beats:  # the stall: no lease moves
            beat.stop()
        time.sleep(4 * WINDOW)
        own = Heartbeat(store, 0, interval=0.05)
        time.sleep(2 * WINDOW)  # the peer's agent comes back later, within the calm timeout
        peer = Heartbeat(store, 1, interval=0.05)
        time.sleep(CALM)
        assert cuts.asked == [], watch.found(0)
        peer.stop()  # now the peer alone goes silent: that is a failure
        assert cuts.done.wait(30)
        assert watch.found(0).nodes == (1,)
        own.stop()
    finally:
        watch.close()
