"""The sequential adapter on a plain torch model (nn.Sequential) with a tied parameter: layer
names, the tie found by identity, parameter groups, and a fingerprint that follows the
architecture (its exact training: tests/multiproc/test_models_exact.py)."""

from __future__ import annotations

import pytest
import tied_model
import torch
from torch import nn

from oobleck_elastic.models.sequential import sequential_model
from oobleck_elastic.runtime.model import materialize_layer


def test_sequential_adapter_names_ties_and_groups():
    spec, _ = tied_model.tied_padded()
    assert [layer.name for layer in spec.layers] == ["0", "1", "2", "3"]
    assert [g.members for g in spec.shared] == [((0, "0.weight"), (3, "3.weight"))]  # found by identity
    head = materialize_layer(spec, 3, seed=0, dtype=torch.float64)
    embed = materialize_layer(spec, 0, seed=0, dtype=torch.float64)
    assert list(head.state_dict()) == ["3.weight"]
    assert torch.equal(head.state_dict()["3.weight"], embed.state_dict()["0.weight"])
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
