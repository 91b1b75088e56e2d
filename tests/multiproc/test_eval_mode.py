"""An evaluation runs the layers in eval mode (dropout off, BatchNorm on its running
statistics), as `model.eval()` would, and leaves them in training mode after."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from runtime_harness import Phase, free_port, plans_for
from torch import nn

from oobleck_elastic.config import load_config
from oobleck_elastic.models.sequential import sequential_model
from oobleck_elastic.planning import WorkerRef
from oobleck_elastic.runtime.trainer import Trainer

BATCH, MICROBATCH = 8, 2


class Samples:
    def __len__(self) -> int:
        return 16

    def batch(self, indices):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(len(self), 4, generator=g, dtype=torch.float64)
        return x[list(indices)], torch.zeros(len(indices), 4, dtype=torch.float64)


def test_an_evaluation_runs_the_layers_in_eval_mode():
    torch.set_num_threads(1)
    spec = sequential_model([lambda: nn.Dropout(0.5), lambda: nn.Linear(4, 4)], loss=nn.functional.mse_loss,
                            sample_batch=lambda b: (torch.zeros(b, 4), torch.zeros(b, 4)))
    cfg = load_config(None, ["train.device=cpu", "train.dtype=float64", f"train.global_batch_size={BATCH}",
                             f"train.microbatch_size={MICROBATCH}", "data.shuffle=false", "eval.interval=1"])
    _, (plan,) = plans_for([Phase(pipelines=((0,),), steps=1)], spec.num_layers, BATCH, MICROBATCH)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    data = Samples()
    trainer = Trainer(model=spec, dataset=data, cfg=cfg, me=WorkerRef(0, 0), store=store, eval_dataset=data)
    try:
        trainer.build(plan)
        losses = [trainer.evaluate(0)[0] for _ in range(2)]
        modes = [m.training for i in trainer.generation.held_layers() for m in trainer.layers[i].compute.modules()]
        linear = trainer.layers[1].module.get_submodule("1")
        x, y = data.batch(range(BATCH))
        with torch.no_grad():
            expected = float(nn.functional.mse_loss(linear(x), y))  # dropout is the identity in eval mode
    finally:
        trainer.shutdown()
    assert losses[0] == losses[1], "dropout drew masks in an evaluation"
    assert abs(losses[0] - expected) <= 1e-12 * abs(expected), (losses, expected)
    assert all(modes), "the layers are back in training mode after the evaluation"
