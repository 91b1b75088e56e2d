"""Two gloo processes: rank 0 goes silent (alive, its sockets open, sending nothing), rank 1
waits for it in `recv` with a group timeout of minutes. Cutting the connections rank 1's
group opened (runtime/connections.py) from another thread ends that `recv` with gloo's
"connection closed" error, not its timeout: what the peer watch does to a generation once a
member is known dead (torch 2.13's own `abort()` of a gloo group does not end a pending
`recv`: docs/recovery.md, Silent failures)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from datetime import timedelta


def _worker(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    from oobleck_elastic.runtime.connections import SocketSet, open_sockets

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    before = open_sockets()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=300))
    made = SocketSet.opened_since(before, spare=[("127.0.0.1", port)])
    dist.barrier()
    if rank == 0:  # silent: alive, sockets open, nothing sent, until the test ends it
        out.put(("silent", len(made.sockets)))
        time.sleep(600)
        return
    timer = threading.Timer(0.5, lambda: out.put(("cut", made.cut())))
    timer.start()
    started = time.monotonic()
    try:
        dist.recv(torch.zeros(1), src=0)
        out.put(("received", None))
    except RuntimeError as exc:
        out.put(("raised", (str(exc).splitlines()[0], time.monotonic() - started)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cutting_a_groups_connections_ends_a_recv_waiting_on_a_silent_peer():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, out), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in range(3))
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    assert got["silent"] >= 1, "the group's connections were found"
    assert got["cut"] >= 1
    assert "raised" in got, got
    message, waited = got["raised"]
    assert "closed" in message.lower() and "timed out" not in message.lower(), message
    assert waited < 300, "ended by the cut, not by the group's timeout"
