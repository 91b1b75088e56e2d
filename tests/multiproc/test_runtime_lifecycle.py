"""A generation is torn down completely: 20 rebuilds grow no threads, fds or memory."""

from __future__ import annotations

from runtime_harness import Phase, reference, run_job
from test_runtime_exact import assert_same_weights


def test_twenty_rebuilds_leak_nothing_and_train_exactly(tmp_path):
    # Alternate 3 workers (2 + 1) and 2 workers (1 + 1, node 2 out of the generation).
    layouts = [((0, 1), (2,)), ((0,), (1,))]
    phases = [Phase(pipelines=layouts[g % 2], steps=1) for g in range(21)]
    results = run_job(phases, tmp_path, timeout=600)
    for node in (0, 1):
        usage = results[node]["usage"]  # after each of the 20 closes
        assert len(usage) == 20
        warm, last = usage[3], usage[-1]
        assert last["threads"] <= warm["threads"], usage
        assert last["fds"] <= warm["fds"], usage
        assert last["rss"] - warm["rss"] < 16 * 2**20, [u["rss"] for u in usage]
    final = {i: s for node in (0, 1) for i, s in results[node]["state"].items()}
    assert_same_weights({0: {"state": final}}, reference(21))
