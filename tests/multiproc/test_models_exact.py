"""A plain torch model (nn.Sequential) with a tied parameter and a mean loss over unevenly
padded targets trains across heterogeneous, rebuilt pipelines exactly like one plain PyTorch
process on the whole global batch (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tied_model
from runtime_harness import Phase, job_config, run_job
from oobleck_elastic.models.sequential import sequential_model
from oobleck_elastic.runtime.data import SampleOrder
from oobleck_elastic.runtime.model import materialize_layer

OVERRIDES = ["train.grad_clip_norm=0.3", "train.optimizer.weight_decay=0.1",
             'train.no_weight_decay=["*.bias", "*norm*"]']


def plain_reference(steps: int) -> dict[str, torch.Tensor]:
    """What a user writes: one model, one AdamW over its parameters (the tied one once), the
    mean loss of the whole global batch, clipping with torch's own function."""
    cfg = job_config(OVERRIDES)
    model = tied_model.build()
    data = tied_model.PaddedTokens()
    order = SampleOrder(len(data), cfg.train.seed)
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or "norm" in n)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or "norm" in n]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.01,
                            weight_decay=0.1)
    for step in range(steps):
        x, y = data.batch(order.indices(step, cfg.train.global_batch_size))
        tied_model.mean_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.slow
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


def test_sequential_adapter_names_ties_and_groups():
    spec, _ = tied_model.tied_padded()
    assert [layer.name for layer in spec.layers] == ["0", "1", "2", "3"]
    assert [g.members for g in spec.shared] == [((0, "0.weight"), (3, "3.weight"))]  # found by identity
    head = materialize_layer(spec, 3, seed=0, dtype=torch.float64)
    embed = materialize_layer(spec, 0, seed=0, dtype=torch.float64)
    assert list(head.state_dict()) == ["3.weight"] and torch.equal(head.state_dict()["3.weight"], embed.state_dict()["0.weight"])
    block = materialize_layer(spec, 1, seed=0, dtype=torch.float64)
    assert set(block.state_dict()) == {"1.norm.weight", "1.norm.bias", "1.fc.weight", "1.fc.bias", "1.scale"}
    with pytest.raises(ValueError, match="no layer is named 'x'"):
        sequential_model([nn.Linear(2, 2)], loss=tied_model.mean_loss, sample_batch=None, shared=[("x.w", "0.weight")])
    with pytest.raises(ValueError, match="one distinct name per layer"):
        sequential_model([nn.Linear(2, 2)] * 2, names=["a", "a"], loss=tied_model.mean_loss, sample_batch=None)


def test_fingerprint_follows_the_architecture():
    from oobleck_elastic.runtime.model import model_fingerprint

    spec, _ = tied_model.tied_padded()
    same, _ = tied_model.tied_padded()
    assert model_fingerprint(spec, torch.float64) == model_fingerprint(same, torch.float64)
    assert model_fingerprint(spec, torch.float64) != model_fingerprint(spec, torch.float32)
    wider = sequential_model([nn.Linear(3, 4), nn.Linear(4, 2)], loss=tied_model.mean_loss, sample_batch=None)
    narrower = sequential_model([nn.Linear(3, 4), nn.Linear(4, 1)], loss=tied_model.mean_loss, sample_batch=None)
    assert model_fingerprint(wider, torch.float32) != model_fingerprint(narrower, torch.float32)


@pytest.mark.slow
def test_factory_model_on_four_nodes_through_a_kill_exports_its_own_state_dict(tmp_path):
    """The tied nn.Sequential with its padded data, named by model.factory, trained by
    `python -m oobleck_elastic.train` on 4 local nodes (2-node pipelines: the tied copies on
    different nodes) with a node SIGKILLed mid-step, then exported: one safetensors file under
    the nn.Sequential's own names, equal to plain PyTorch."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    sets = ["model.factory=tied_model:factory", "train.dtype=float64", "train.global_batch_size=24",
            "train.microbatch_size=2", "train.optimizer.lr=0.01", "train.steps=4", *OVERRIDES,
            "planner.memory_per_worker=35KB", f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"planner.profile_dir={tmp_path / 'profiles'}", f"monitoring.metrics_path={tmp_path / 'm.jsonl'}",
            f"monitoring.tensorboard_dir={tmp_path / 'tb'}"]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(tied_model.__file__), "OOBLECK_FAULT": "node=1,step=2,phase=backward"}
    train = [sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=4", "--nproc-per-node=1",
             f"--oobleck-log-dir={tmp_path / 'logs'}", "-m", "oobleck_elastic.train",
             *(x for s in sets for x in ("--set", s))]
    export = [sys.executable, "-m", "oobleck_elastic.export", str(tmp_path / "ckpt"), str(tmp_path / "out")]
    for argv in (train, export):
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    log = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    first = [r for r in log if r.get("event") == "generation"][0]
    assert [len(p["nodes"]) for p in first["pipelines"]] == [2, 2]
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[1]]
    got, want = load_file(tmp_path / "out/model.safetensors"), plain_reference(4)
    assert set(got) == set(want)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-10, atol=0), name
