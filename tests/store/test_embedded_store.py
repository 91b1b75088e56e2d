"""The embedded store listens on the address it is given, and hosting it where that address
is not this machine's is a clear error, not a silent fall back to being a client; run ids, jobs
sharing an endpoint, and the host outliving its join timeout while others train (a worker whose
agent died: tests/jobs/test_embedded_store_jobs.py)."""

from __future__ import annotations

import os
import socket

import psutil
import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from oobleck_elastic.elastic.stores import StoreAddressInUse, host_store
from oobleck_elastic.errors import OobleckError


def listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_a_store_hosted_at_loopback_listens_on_loopback_only():
    store = host_store("127.0.0.1", 0, "bind")
    assert listening(store.port) == {"127.0.0.1"}, "not on every interface"
    store.set_json("k", 1)
    assert store.try_get_json("k") == 1


def test_a_second_host_on_the_same_port_is_told_the_address_is_taken():
    store = host_store("127.0.0.1", 0, "taken")
    with pytest.raises(StoreAddressInUse, match=f"127.0.0.1:{store.port} is already in use"):
        host_store("127.0.0.1", store.port, "taken")


def test_hosting_the_store_at_an_address_of_another_machine_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = RendezvousParameters(backend="oobleck", endpoint=f"192.0.2.1:{port}", run_id="elsewhere",
                                  min_nodes=1, max_nodes=1, join_timeout="5", is_host="1")
    with pytest.raises(OobleckError, match=r"cannot host the membership store at 192.0.2.1:\d+ \(Cannot assign "
                                           r"requested address\): give an address of this machine"):
        get_rendezvous_handler(params)


@pytest.fixture(autouse=True)
def own_environment():
    """A handler's rendezvous sets OOBLECK_* in this process's environment for its workers:
    undone after each test, or every job a later test starts would think it is a worker."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def handler(port: int, run_id: str, nnodes: tuple[int, int] = (1, 1), **conf):
    return get_rendezvous_handler(RendezvousParameters(
        backend="oobleck", endpoint=f"127.0.0.1:{port}", run_id=run_id, min_nodes=nnodes[0], max_nodes=nnodes[1],
        join_timeout="5", **conf))


@pytest.mark.parametrize("run_id", ["a/gen4", "", "-x", "a b", "x" * 129])
def test_a_run_id_that_could_share_keys_with_another_run_is_refused(run_id):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match="is not a valid run id: use 1 to 128 letters, digits"):
        handler(port, run_id)


def test_two_jobs_with_the_default_id_on_one_endpoint_do_not_merge():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = handler(port, "none", (1, 1))
    first.next_rendezvous()
    try:
        other = handler(port, "none", (2, 4), is_host="0")
        with pytest.raises(RendezvousError, match=r"started with --nnodes=2:4, but run 'none' at 127.0.0.1:\d+ has "
                                                  r"--nnodes=1:1: it is another job. Give each job its own --rdzv-id"):
            other.next_rendezvous()
        assert first.store.add("nodes/next", 0) == 1, "the other job's node never registered"
    finally:
        first.shutdown()


def test_the_store_host_stays_up_while_other_nodes_train_beyond_its_join_timeout():
    """The agent hosting the embedded store leaves early (its workers were
    fenced, say); it must keep the store up as long as another node's lease moves, not only
    for its join timeout, and stop once that node has left."""
    import threading

    from oobleck_elastic.elastic.rendezvous import Heartbeat

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    host = handler(port, "hostleaves", (1, 2), heartbeat_interval="0.1")  # join_timeout 5 s
    host.timeout = 1.0
    host.next_rendezvous()
    other = host.protocol.register({"host": "elsewhere"})
    beating = Heartbeat(host.store, other, 0.1)
    done = threading.Event()
    leaving = threading.Thread(target=lambda: (host.shutdown(), done.set()), daemon=True)
    leaving.start()
    try:
        assert not done.wait(3.0), "the host stopped the store while node 1 still trained"
        host.store.set_json(f"nodes/{other}/left", True)
        assert done.wait(10.0), "the host never stopped once the others had left"
    finally:
        beating.stop()
