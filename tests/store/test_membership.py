"""The roll call on a real (embedded) store: a member whose lease stands still is dead after
the window, a member whose agent keeps beating is waited for even when its workers check in
after the window, and nobody waits for a whole lease timeout."""

from __future__ import annotations

import threading
import time

from oobleck_elastic.elastic.protocol import AgentSide, WorkerSide
from oobleck_elastic.elastic.records import Outcome, StepDecision
from oobleck_elastic.elastic.rendezvous import Heartbeat
from oobleck_elastic.elastic.stores import host_store


def test_roll_call_drops_silent_nodes_after_the_window_and_waits_for_beating_ones():
    store = host_store("127.0.0.1", 0, "rollcall")
    protocol = WorkerSide(store, lease_timeout=30.0)  # the lease timeout itself never fires here
    beating = Heartbeat(store, 3, interval=0.1)
    try:
        store.set_json("rollcall/0/1/0", True)  # node 1's worker is already in

        def late_check_in() -> None:  # node 3's worker notices the failure late
            time.sleep(1.2)
            store.set_json("rollcall/0/3/0", True)

        threading.Thread(target=late_check_in, daemon=True).start()
        start = time.monotonic()
        alive, dead = protocol.roll_call(0, (0, 0), [0, 1, 2, 3], 1, timeout=60.0, suspect_after=0.5)
        took = time.monotonic() - start
    finally:
        beating.stop()
    assert (alive, dead) == ([0, 1, 3], [2])
    assert 1.2 <= took < 30.0, "waited for node 3's check-in, not for the agreement timeout"
    assert store.try_get_json("nodes/2/dead")["why"] == "missed the roll call of generation 0"
    assert store.try_get_json("nodes/3/dead") is None


def test_joiners_are_admitted_oldest_first_up_to_max_nodes():
    store = host_store("127.0.0.1", 0, "joiners")
    for _ in range(6):
        AgentSide(store).register({"host": "h"})
    for node in (3, 4, 5):
        WorkerSide(store).report_ready(node, 1)
    store.set_json("nodes/4/dead", {"why": "test"})
    assert WorkerSide(store).ready_joiners([0, 1, 2]) == [3, 5], "no limit: every ready, live node"
    assert WorkerSide(store).ready_joiners([0, 1, 2], max_nodes=4) == [3], "room for one more"
    assert WorkerSide(store).ready_joiners([0, 1, 2, 3], max_nodes=4) == [], "full: node 5 waits, ready"
    assert WorkerSide(store).ready_joiners([0, 3], max_nodes=4) == [5], "a member lost makes room"


def test_a_joining_node_is_ready_when_all_its_workers_are():
    """The first worker of a 2-worker node used to mark the node ready while
    its sibling was still planning."""
    store = host_store("127.0.0.1", 0, "readyall")
    for _ in range(2):
        AgentSide(store).register({"host": "h"})
    WorkerSide(store).report_ready(1, 2)
    assert WorkerSide(store).ready_joiners([0]) == []
    WorkerSide(store).report_ready(1, 2)
    assert WorkerSide(store).ready_joiners([0]) == [1]


def test_a_ready_joiner_whose_lease_stands_still_is_not_admitted():
    """A node that got ready and died (no launcher marks it dead under stock torchrun) is never
    admitted: its lease stands still."""
    store = host_store("127.0.0.1", 0, "deadjoiner")
    for node in range(3):
        AgentSide(store).register({"host": "h"})
        WorkerSide(store).report_ready(node, 1)
    beating = Heartbeat(store, 2, interval=0.05)
    watcher = WorkerSide(store, lease_timeout=0.5)
    try:
        assert watcher.ready_joiners([0]) == [1, 2], "first sight: not yet dead"
        deadline = time.monotonic() + 10
        while watcher.ready_joiners([0]) != [2]:
            assert time.monotonic() < deadline, "node 1's lease never counted as stopped"
            time.sleep(0.05)
    finally:
        beating.stop()


def test_a_commit_removes_the_previous_steps_keys():
    store = host_store("127.0.0.1", 0, "commits")
    protocol = WorkerSide(store, lease_timeout=30.0)
    for step in range(3):
        assert protocol.commit_step(0, step, 1, [0], timeout=10.0) == StepDecision(Outcome.COMMIT)
    assert store.try_get_json("gen0/step2/decision") == {"version": 1, "outcome": "commit", "join": [], "stop": False}
    for step in (0, 1):
        assert store.try_get_json(f"gen0/step{step}/decision") is None
        assert store.add(f"gen0/step{step}/ready", 0) == 0


def test_a_stop_request_is_carried_by_the_next_commit():
    """A stop asked for while a step is computed ends the run after that step, for everyone at
    once (the decision carries it), and no joiner is admitted at that boundary."""
    store = host_store("127.0.0.1", 0, "stops")
    protocol = WorkerSide(store, lease_timeout=30.0)
    store.add("nodes/next", 2)
    WorkerSide(store).report_ready(1, 1)  # node 1 is ready to join
    store.add("gen0/step0/ready", 1)  # the other worker of the step is ready already
    assert protocol.commit_step(0, 0, 2, [0], timeout=10.0) == StepDecision(Outcome.COMMIT, (1,))
    store.add("gen0/step1/ready", 1)
    protocol.request_stop("test")
    assert protocol.commit_step(0, 1, 2, [0], timeout=10.0) == StepDecision(Outcome.COMMIT, (), stop=True)


def test_a_node_started_with_another_job_is_refused_naming_the_keys():
    """The first node publishes the job; another seed or batch is refused."""
    import pytest
    from runtime_harness import model_and_data

    from oobleck_elastic.config import load_config
    from oobleck_elastic.elastic.job import job_description
    from oobleck_elastic.errors import OobleckError

    def job(sets, workers=1):
        return job_description(load_config(None, sets), model_and_data("gpt")[0], workers)

    store = host_store("127.0.0.1", 0, "samejob")
    check_same_job = WorkerSide(store).check_same_job
    check_same_job(job(["train.seed=3"]))
    check_same_job(job(["train.seed=3", "planner.profile_dir=/elsewhere"]))  # a local path may differ
    with pytest.raises(OobleckError, match=r"train.global_batch_size = 64 here, 32 in the run; "
                                           r"train.seed = 0 here, 3 in the run"):
        check_same_job(job(["train.global_batch_size=64"]))
    # every plan lays the same number of workers on each node
    with pytest.raises(OobleckError, match=r"nproc_per_node = 2 here, 1 in the run"):
        check_same_job(job(["train.seed=3"], workers=2))


def test_a_node_whose_model_or_tokens_hold_other_contents_is_refused(tmp_path):
    """Each node reads model.hf and data.tokens from its own copy: a copy with other weights or
    other tokens at the same path is refused, naming it, from a digest that
    reads about 1 MiB of each file, not the whole of it."""
    import pytest
    from hf_fixtures import make_causal_lm, write_tokens
    from runtime_harness import model_and_data

    from oobleck_elastic.config import load_config
    from oobleck_elastic.elastic.job import job_description
    from oobleck_elastic.errors import OobleckError

    spec = model_and_data("gpt")[0]
    model, tokens = tmp_path / "model", tmp_path / "tokens.bin"

    def job():
        cfg = load_config(None, [f"model.hf={model}", f"data.tokens={tokens}", "train.seed=3"])
        return job_description(cfg, spec, 1)

    make_causal_lm(model, "gpt2", seed=0)
    write_tokens(tokens, 600_000, 97, seed=0)  # larger than what the digest reads: it samples
    check_same_job = WorkerSide(host_store("127.0.0.1", 0, "samefiles")).check_same_job
    check_same_job(job())
    check_same_job(job())  # the same files again: the same digest
    (model / ".cache").mkdir()  # a download's bookkeeping, different on every node, is not content
    (model / ".cache" / "model.safetensors.metadata").write_text("downloaded at 12:00")
    check_same_job(job())
    write_tokens(tokens, 600_000, 97, seed=1)
    with pytest.raises(OobleckError, match=r"data.tokens contents = '[0-9a-f]+' here, '[0-9a-f]+' in the run"):
        check_same_job(job())
    write_tokens(tokens, 600_000, 97, seed=0)
    make_causal_lm(model, "gpt2", seed=1)
    with pytest.raises(OobleckError, match=r"model.hf contents = "):
        check_same_job(job())
