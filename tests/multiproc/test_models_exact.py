"""A plain torch model (nn.Sequential) with a tied parameter and a mean loss over unevenly
padded targets trains across heterogeneous, rebuilt pipelines exactly like one plain PyTorch
process on the whole global batch (float64). The adapter itself:
tests/unit/test_models_exact_unit.py; the same model as a local job through a kill:
tests/jobs/test_models_exact_jobs.py."""

from __future__ import annotations

import tied_model
import torch
from runtime_harness import Phase, run_job
from tied_reference import OVERRIDES, plain_reference


def test_tied_sequential_model_with_uneven_padding_matches_plain_pytorch(tmp_path):
    phases = [Phase(pipelines=((0, 1), (2, 3, 4)), steps=2),
              Phase(pipelines=((0, 1, 2), (3, 4), (5,)), steps=2)]  # (5,): both tied copies on one worker
    results = run_job(phases, tmp_path, OVERRIDES, model="tied_padded")
    expected = plain_reference(4)
    held: dict[str, list[torch.Tensor]] = {}
    for res in results.values():
        for state in res["state"].values():
            for name, value in state.items():
                held.setdefault(name, []).append(value)
    assert set(held) == set(expected), "every parameter and buffer is held under the model's own name"
    for name, copies in held.items():
        want = expected[name]
        for value in copies:
            err = (value - want).abs().max().item() / want.abs().max().item()
            assert err <= 1e-10, f"{name}: relative error {err:.3e}"
        assert all(torch.equal(copies[0], c) for c in copies[1:]), f"replicas of {name} differ"
    assert torch.equal(held["0.weight"][0], held["3.weight"][0]), "the tied copies stay bit-identical"
    # the padding really is uneven: the microbatches (2 samples) run counted 0 to 12 tokens
    data, counts = tied_model.PaddedTokens(), set()
    for res in results.values():
        for record in res["records"]:
            pairs = zip(record["consumed"][::2], record["consumed"][1::2])
            counts |= {int((data.batch(list(pair))[1] != -100).sum()) for pair in pairs}
    assert 0 in counts and len(counts) > 3, counts
