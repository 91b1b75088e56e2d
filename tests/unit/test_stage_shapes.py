"""Pipeline stages know their shapes before the first step: nothing a peer sends is unpickled
(runtime.generation Note: [static stage shapes]); a job that checks it on gloo processes:
tests/multiproc/test_stage_shapes_multiproc.py."""

from __future__ import annotations

import logging

import torch
from runtime_harness import TINY
from torch import nn

from examples.gpt.data import SyntheticTokens
from examples.gpt.model import gpt_model
from oobleck_elastic.config import load_config
from oobleck_elastic.models.sequential import sequential_model
from oobleck_elastic.planning import WorkerRef
from oobleck_elastic.runtime.model import boundary_activations, materialize_layer
from oobleck_elastic.runtime.trainer import Trainer


def test_boundaries_are_what_a_real_forward_produces():
    spec, data = gpt_model(TINY), SyntheticTokens(TINY, seed=0)
    inputs, _ = data.batch([0, 1, 2])
    metas = boundary_activations(spec, torch.float64, inputs)
    x = inputs
    assert metas[0].shape == x.shape and metas[0].dtype == x.dtype and not metas[0].requires_grad
    for i, meta in enumerate(metas[1:]):
        x = materialize_layer(spec, i, seed=0, dtype=torch.float64)(x)
        assert meta.is_meta and meta.shape == x.shape and meta.dtype == x.dtype and meta.stride() == x.stride()
        assert meta.requires_grad, "a received activation needs its gradient"


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if bool(x.sum() > 0) else x  # cannot run on the meta device


def test_a_model_that_cannot_run_on_meta_falls_back_with_a_warning(caplog):
    spec = sequential_model([nn.Linear(4, 4), DataDependent()], loss=nn.functional.mse_loss,
                            sample_batch=lambda b: (torch.randn(b, 4), torch.randn(b, 4)))

    class Data:
        def __len__(self):
            return 8

        def batch(self, indices):
            return torch.randn(len(indices), 4), torch.randn(len(indices), 4)

    cfg = load_config(None, ["train.global_batch_size=4", "train.microbatch_size=2"])
    trainer = Trainer(model=spec, dataset=Data(), cfg=cfg, me=WorkerRef(0, 0), store=None)
    with caplog.at_level(logging.WARNING):
        assert trainer.boundaries() is None
    assert "does not run on the meta device" in caplog.text and "pickles" in caplog.text
