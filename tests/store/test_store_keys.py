"""What a run keeps in the membership store and what it clears (Note: [store keys] in
elastic/protocol/keys.py), and two runs on one store (embedded and etcd, real servers) never seeing
each other's keys."""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist
from generation_records import record

from oobleck_elastic.elastic.protocol import RECORDS, AgentSide, CheckpointSide, WorkerSide
from oobleck_elastic.elastic.stores import connect_store, host_store


@contextlib.contextmanager
def two_runs(kind, etcd_port):
    """Stores of runs `a` and `b` on one server."""
    if kind == "etcd":
        yield (connect_store(f"etcd://127.0.0.1:{etcd_port}", f"a-{kind}"),
               connect_store(f"etcd://127.0.0.1:{etcd_port}", f"b-{kind}"))
        return
    host = host_store("127.0.0.1", 0, "a-embedded")
    yield host, connect_store(host.url, "b-embedded")


def write_a_generation(store, g: int) -> None:
    """What generation g leaves: its records, step keys, roll call, and torch's bootstrap keys."""
    WorkerSide(store).propose(record(g), 5.0)
    store.add(f"gen{g}/built", 2)
    store.add(f"gen{g}/step{g + 3}/ready", 2)
    store.set_json(f"rollcall/{g}/0/0", True)
    dist.PrefixStore(f"gen{g}", store.torch_store()).set("rank_0", "addr")  # what init_process_group writes
    store.set_json(f"recovery/{g}", {"generation": g})


@pytest.mark.parametrize("kind", ["embedded", "etcd"])
def test_two_runs_on_one_store_never_see_each_others_keys(kind, etcd_port):
    with two_runs(kind, etcd_port) as (a, b):
        for store, beats in ((a, 3), (b, 1)):
            agent = AgentSide(store)
            agent.begin(2, 2)
            for _ in range(beats):
                agent.liveness.renew_lease(0)
        write_a_generation(a, 1)
        assert WorkerSide(b).try_record(1) is None and b.try_get_json("gen1/built") is None
        assert b.try_get_json("lease/0")["beat"] == 1, "b's lease moved with a's"
        assert not any(k.startswith(("gen1/", "rollcall/", "recovery/")) for k in b.keys())
        write_a_generation(b, 1)
        assert a.add("gen1/built", 0) == 2 and b.add("gen1/built", 0) == 2
        before = sorted(b.keys())
        AgentSide(a).forget_working_state()
        assert sorted(b.keys()) == before, "clearing run a's keys touched run b's"
        assert all(RECORDS.fullmatch(k) for k in a.keys())


@pytest.mark.parametrize("kind", ["embedded", "etcd"])
def test_old_generations_working_keys_go_and_the_records_stay(kind, etcd_port):
    with two_runs(kind, etcd_port) as (store, _):
        agent, worker = AgentSide(store), WorkerSide(store)
        agent.begin(2, 2)
        agent.liveness.renew_lease(0)
        dist.PrefixStore("agent0", store.torch_store()).set("torchelastic/x", "1")  # torch's agent
        for g in (1, 2, 10):
            write_a_generation(store, g)
        CheckpointSide(store).checkpoint_written(2, 5, 3)  # a write of generation 2 that may still be adding to it
        assert {"gen1/rank_0", "gen2/built", "gen10/rank_0", "rollcall/2/0/0"} <= set(store.keys())

        deleted = worker.forget_generations_before(10)

        keys = set(store.keys())
        assert deleted == 8  # 4 keys each of generations 1 and 2
        assert not any(k.startswith(("gen1/", "gen2/", "rollcall/1/", "rollcall/2/")) for k in keys
                       if k != "gen2/checkpoint5"), keys
        assert {"gen10/built", "gen10/step13/ready", "gen10/rank_0", "rollcall/10/0/0"} <= keys
        assert {"generation/1", "generation/2", "generation/10", "recovery/1", "lease/0", "agent0/torchelastic/x",
                "gen2/checkpoint5"} <= keys
        assert worker.current(5.0).generation == 10

        worker.publish_done({"steps": 3})
        agent.leave(0)
        agent.forget_working_state()
        left = set(store.keys())
        assert all(RECORDS.fullmatch(k) for k in left), left
        assert {"generation", "generation/10", "recovery/2", "done", "limits", "nodes/0/left"} <= left
