"""Heterogeneous pipelines train exactly like one process on the whole batch (float64)."""

from __future__ import annotations

import pytest
import torch

from runtime_harness import Phase, reference, run_job

pytestmark = pytest.mark.slow


def assert_same_weights(results, expected, rtol=1e-10):
    seen = set()
    for result in results.values():
        for layer, state in result["state"].items():
            seen.add(layer)
            for name, value in state.items():
                want = expected[layer][name]
                err = (value - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                assert err <= rtol, f"layer {layer} {name}: relative error {err:.3e}"
    assert seen == set(expected), "every layer is held somewhere"


def test_two_heterogeneous_pipelines_match_reference(tmp_path):
    results = run_job([Phase(pipelines=((0, 1), (2, 3, 4)), steps=4)], tmp_path)
    assert_same_weights(results, reference(4))
    records = [r for res in results.values() for r in res["records"]]
    for step in range(4):
        consumed = [i for r in records if r["step"] == step for i in r["consumed"]]
        assert len(consumed) == 24 and len(set(consumed)) == 24, "each sample exactly once"
