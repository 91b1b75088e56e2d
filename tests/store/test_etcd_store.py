"""The etcd membership store on a real etcd server: JSON records, compare-and-set, exact
counters under contention (threads) and lost responses, bounded waits, restarts ridden out, and
a clear error when etcd is not there (across processes, process groups included:
tests/multiproc/test_etcd_store_multiproc.py). `etcd_port` is the root conftest's: one server
per module."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest
from etcd_server import etcd_server

from oobleck_elastic.elastic.protocol import AgentSide
from oobleck_elastic.elastic.stores import StoreTimeout, StoreUnreachable, connect_store


def test_records_counters_and_waits(etcd_port):
    store = connect_store(f"etcd://127.0.0.1:{etcd_port}", "basic")
    assert store.url == f"etcd://127.0.0.1:{etcd_port}"
    assert store.try_get_json("nodes/0") is None
    store.set_json("nodes/0", {"host": "a", "pid": 1})
    store.set_json("nodes/0/dead", {"why": "test"})  # a key below another key's name
    assert store.get_json("nodes/0", 1.0) == {"host": "a", "pid": 1}
    assert store.get_json("nodes/0/dead", 1.0) == {"why": "test"}
    assert store.create_json("generation/1", {"nodes": [0]}) is True
    assert store.create_json("generation/1", {"nodes": [1]}) is False
    assert store.get_json("generation/1", 1.0) == {"nodes": [0]}
    assert store.add("lease/0", 0) == 0 and store.add("lease/0", 1) == 1 and store.add("lease/0", 5) == 6
    assert AgentSide(store).register({"host": "b"}) == 0 and AgentSide(store).register({"host": "c"}) == 1
    with pytest.raises(StoreTimeout, match="waited 0 s for store key 'missing'"):
        store.get_json("missing", 0.2)
    other_run = connect_store(f"etcd://127.0.0.1:{etcd_port}", "other")
    assert other_run.try_get_json("nodes/0") is None, "runs do not see each other's keys"


def test_unreachable_etcd_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(StoreUnreachable, match=f"etcd at 127.0.0.1:{port} is unreachable.*--enable-v2"):
        connect_store(f"etcd://127.0.0.1:{port}", "nobody", timeout=1.0)


def test_etcd_without_the_v2_api_is_a_clear_error():
    with etcd_server(v2=False) as port:
        with pytest.raises(StoreUnreachable, match=r"failed a request .*404.*is its v2 API on \(etcd --enable-v2\)"):
            connect_store(f"etcd://127.0.0.1:{port}", "nov2")


def test_delete(etcd_port):
    store = connect_store(f"etcd://127.0.0.1:{etcd_port}", "delete")
    store.set_json("gen0/step1/decision", {"outcome": "commit"})
    store.delete("gen0/step1/decision")
    store.delete("gen0/step1/decision")  # gone already: nothing to do
    assert store.try_get_json("gen0/step1/decision") is None


def test_a_write_the_transport_sends_twice_counts_once(etcd_port, monkeypatch):
    """urllib3 sends a PUT again when its response is lost: the first one was applied and the
    retry's condition fails. A counter still moves once, and a create is still ours."""
    store = connect_store(f"etcd://127.0.0.1:{etcd_port}", "retried")
    real = store._client.write

    def applied_then_retried(*args, **kwargs):
        real(*args, **kwargs)  # applied, but the response never arrived...
        return real(*args, **kwargs)  # ...so the transport sent it again

    monkeypatch.setattr(store._client, "write", applied_then_retried)
    assert store.add("gen0/built", 1) == 1  # the create of the counter
    assert store.add("gen0/built", 1) == 2  # an add with prevIndex
    assert store.add("gen0/built", 3) == 5
    assert store.create_json("generation/1", {"nodes": [0]}) is True
    monkeypatch.setattr(store._client, "write", real)
    assert store.add("gen0/built", 0) == 5
    assert store.create_json("generation/1", {"nodes": [1]}) is False


def test_a_request_rides_out_an_etcd_restart_shorter_than_its_outage_timeout():
    """Note: [etcd outages]: etcd killed and started again with its data while a client writes;
    a request made while it is down waits for it, one past the outage timeout fails clearly."""
    import threading

    from etcd_server import etcd_process

    with etcd_process() as server:
        store = connect_store(f"etcd://127.0.0.1:{server.port}", "outage", outage_timeout=20.0)
        store.set_json("before", 1)
        assert store.add("count", 1) == 1
        server.stop()
        restart = threading.Timer(2.0, server.start)
        restart.start()
        try:
            assert store.add("count", 1) == 2, "the add made while etcd was down counts once"
            assert store.try_get_json("before") == 1, "its data survived the restart"
        finally:
            restart.join()
        server.stop()
        store.outage_timeout = 1.0
        with pytest.raises(StoreUnreachable, match=r"is unreachable \(for 1 s now\)"):
            store.set_json("after", 1)


def _lose_responses(store, then) -> Callable[[], None]:
    """Makes `store`'s writes lose their responses when armed: such a write is applied, `then()`
    runs (other writers' adds landing meanwhile), and the transport sends it again, as urllib3
    does. Returns `arm`: each call makes one more write, the next one, lose its response."""
    real, armed = store._client.write, []

    def applied_then_retried(*args, **kwargs):
        if not armed:
            return real(*args, **kwargs)
        armed.pop()
        real(*args, **kwargs)  # applied (a failed condition here is an answer, raised as it came)...
        then()  # ...its response lost while other writers add...
        return real(*args, **kwargs)  # ...and then the transport sends it again

    store._client.write = applied_then_retried
    return lambda: armed.append(True)


def test_a_retried_add_counts_once_when_other_adds_land_before_the_retry(etcd_port):
    """Note: [idempotent etcd writes]: when the retry comes, the stored value is no longer the
    one our write made: other workers' adds came in between. The retry still sees that ours was
    applied, for a create and for an add with prevIndex, with up to 63 adds in between."""
    url = f"etcd://127.0.0.1:{etcd_port}"
    store, other = connect_store(url, "retried-between"), connect_store(url, "retried-between")
    burst = 1  # read when a response is lost
    lose_next = _lose_responses(store, lambda: [other.add("count", 1) for _ in range(burst)])
    lose_next()
    assert store.add("count", 1) == 1, "the create was ours, the other add came after it"
    assert other.add("count", 0) == 2
    lose_next()
    assert store.add("count", 5) == 7
    assert other.add("count", 0) == 8
    burst = 63  # with ours, the 64 writes a counter keeps
    lose_next()
    assert store.add("count", 1) == 9
    assert other.add("count", 0) == 9 + burst, "none lost, none doubled"


def test_a_counter_written_before_the_upgrade_is_read_and_added_to(etcd_port):
    """A run started before counters kept their recent writes holds `{"n": .., "by": ..}`."""
    store = connect_store(f"etcd://127.0.0.1:{etcd_port}", "upgraded")
    store._client.write(store._key("nodes/next"), '{"n": 5, "by": "0123abcd"}')
    assert store.add("nodes/next", 0) == 5
    _lose_responses(store, lambda: None)()
    assert store.add("nodes/next", 1) == 6
    assert store.add("nodes/next", 0) == 6


def test_a_counter_keeps_a_bounded_number_of_writes(etcd_port):
    """The value every poll of a counter reads stays small however many adds it had."""
    store = connect_store(f"etcd://127.0.0.1:{etcd_port}", "bounded")
    for _ in range(100):
        store.add("count", 1)
    stored = store._client.read(store._key("count")).value
    assert len(stored) < 2000, f"{len(stored)} bytes: {stored[:200]}"
    assert store.add("count", 0) == 100


def test_counters_are_exact_when_concurrent_adds_lose_responses(etcd_port):
    """Four writers, each with its own connection, add 20 times; every fourth write of each
    loses its response, and its retry waits until another writer's add has landed (or 1 s
    passed: the others may be done). Every add sees a distinct value and the count is exact."""
    url, writers, adds = f"etcd://127.0.0.1:{etcd_port}", 4, 20
    seen: list[int] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            store, watcher = connect_store(url, "lossy"), connect_store(url, "lossy")

            def another_add() -> None:
                _wait_for_another_add(watcher, "count", timeout=1.0)

            lose_next = _lose_responses(store, another_add)
            for i in range(adds):
                if i % 4 == 0:
                    lose_next()
                seen.append(store.add("count", 1))
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a writer hung"
    assert not errors, errors
    count = connect_store(url, "lossy").add("count", 0)
    assert count == writers * adds and sorted(seen) == list(range(1, count + 1)), (
        f"{writers * adds} adds counted {count}, and saw {len(set(seen))} distinct values: none may double")


def _wait_for_another_add(store, key: str, timeout: float) -> None:
    """Polls `key` until its stored value changes (another writer's add), or `timeout` passes."""
    path = store._key(key)
    first = store._client.read(path).modifiedIndex
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and store._client.read(path).modifiedIndex == first:
        time.sleep(0.005)
