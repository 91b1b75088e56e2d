"""The rendezvous handler as stock torchrun makes it (`--rdzv-backend=oobleck`), on real stores:
torch finds it through its `torchrun.handlers` entry point, the first agent at the endpoint
hosts the embedded store, and a finished or failed run refuses new nodes (the jobs under
torchrun: tests/jobs/test_torchrun.py)."""

from __future__ import annotations

import pytest
from etcd_server import etcd_server
from runtime_harness import free_port
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousParameters, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from oobleck_elastic.elastic.rendezvous import OobleckRendezvousHandler


def test_torch_finds_the_handler_through_its_entry_point():
    params = RendezvousParameters(backend="oobleck", endpoint=f"127.0.0.1:{free_port()}", run_id="entry",
                                  min_nodes=1, max_nodes=1, join_timeout="5")
    handler = get_rendezvous_handler(params)
    assert isinstance(handler, OobleckRendezvousHandler) and handler.get_backend() == "oobleck"
    assert handler.store.is_master, "the first agent at the endpoint hosts the embedded store"
    bad = RendezvousParameters(backend="oobleck", endpoint="127.0.0.1:1", run_id="bad", min_nodes=1,
                               max_nodes=1, store="zookeeper")
    with pytest.raises(ValueError, match="store=zookeeper is not a membership store; use one of embedded, etcd"):
        get_rendezvous_handler(bad)
    no_id = RendezvousParameters(backend="oobleck", endpoint="127.0.0.1:1", run_id="none", min_nodes=1,
                                 max_nodes=1, store="etcd")
    with pytest.raises(ValueError, match="--rdzv-id is required with --rdzv-conf store=etcd"):
        get_rendezvous_handler(no_id)


def test_a_finished_run_refuses_new_nodes_and_a_client_never_hosts():
    port = free_port()
    params = RendezvousParameters(backend="oobleck", endpoint=f"127.0.0.1:{port}", run_id="over",
                                  min_nodes=1, max_nodes=1, join_timeout="5")
    first = get_rendezvous_handler(params)
    first.store.set_json("done", {"steps": 3})
    with pytest.raises(RendezvousError, match="run 'over' at 127.0.0.1:.* has already finished; give each job"):
        first.next_rendezvous()
    client = get_rendezvous_handler(RendezvousParameters(
        backend="oobleck", endpoint=f"127.0.0.1:{port}", run_id="over", min_nodes=1, max_nodes=1, is_host="0"))
    assert not client.store.is_master and client.store.try_get_json("done") == {"steps": 3}


def test_a_failed_run_on_etcd_refuses_new_nodes():
    """A failed run keeps its records in etcd; its id started again must not join it (it used
    to exit 0 on every node without training)."""
    with etcd_server() as port:
        params = RendezvousParameters(backend="oobleck", endpoint=f"127.0.0.1:{port}", run_id="crashed",
                                      min_nodes=1, max_nodes=1, join_timeout="5", store="etcd")
        handler = get_rendezvous_handler(params)
        handler.protocol.publish_failure("CUDA out of memory\nmore lines", "node 0 rank 1")
        with pytest.raises(RendezvousError, match=rf"run 'crashed' at etcd://127.0.0.1:{port} failed \(node 0 "
                           r"rank 1: CUDA out of memory\); give the new job its own --rdzv-id"):
            handler.next_rendezvous()
        with pytest.raises(RendezvousError, match=r"or delete its records \(the keys under /oobleck/crashed/\)"):
            handler.next_rendezvous()
        assert handler.protocol.registered() == 0, "refused before it registered"
        # a node in the run whose workers torch's agent restarts after the run failed
        # (--max-restarts) is refused too: they would have exited 0 as if the run were over
        params = RendezvousParameters(backend="oobleck", endpoint=f"127.0.0.1:{port}", run_id="restarting",
                                      min_nodes=1, max_nodes=1, join_timeout="5", store="etcd")
        handler = get_rendezvous_handler(params)
        handler.next_rendezvous()
        handler.protocol.publish_failure("step 3 failed 4 times with every node alive", "node 0 rank 0")
        with pytest.raises(RendezvousError, match=r"run 'restarting' at .* failed \(node 0 rank 0: step 3"):
            handler.next_rendezvous()
        assert handler.protocol.registered() == 1, "not registered again"
        handler.shutdown()


def test_too_few_nodes_within_the_join_timeout_is_a_rendezvous_timeout_naming_the_count():
    params = RendezvousParameters(backend="oobleck", endpoint=f"127.0.0.1:{free_port()}", run_id="alone",
                                  min_nodes=2, max_nodes=2, join_timeout="0.5")
    handler = get_rendezvous_handler(params)
    try:
        with pytest.raises(RendezvousTimeoutError, match="only 1 of 2 nodes joined within 0.5 s; start the other"):
            handler.next_rendezvous()
    finally:
        handler.shutdown()
