"""Nothing a peer sends is unpickled (runtime.generation Note: [static stage shapes]): a job on
real gloo processes whose every object exchange fails trains through two layouts (the shapes
themselves: tests/unit/test_stage_shapes.py)."""

from __future__ import annotations

import torch
from runtime_harness import Phase, reference, run_job


def test_no_worker_unpickles_what_a_peer_sends(tmp_path):
    # the harness makes every object exchange fail (runtime_harness.forbid_pickled_exchanges):
    # two layouts, so the stages are built twice with new neighbours
    phases = [Phase(pipelines=((0, 1), (2, 3, 4)), steps=2), Phase(pipelines=((0, 2, 1), (3, 4)), steps=1)]
    results = run_job(phases, tmp_path)
    expected = reference(3)
    for result in results.values():
        for layer, state in result["state"].items():
            for name, value in state.items():
                assert torch.allclose(value, expected[layer][name], rtol=1e-10, atol=0), (layer, name)
