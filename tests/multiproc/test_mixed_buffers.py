"""bf16-mixed keeps the buffers a forward changes (runtime.layers Note: [mixed precision]): a
BatchNorm's running statistics, updated in the bfloat16 copy the stage runs, reach the float32
master that checkpoints, transfers and exports carry; buffers the forward leaves alone stay
the master's float32 values."""

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

BATCH, MICROBATCH = 24, 2
THIRD = 1 / 3  # not a bfloat16 value: rounding it in the master would show


class Normalise(nn.Module):
    """A BatchNorm that takes its input in its own dtype (bf16 under bf16-mixed), beside a
    persistent buffer that no forward changes."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.tensor(THIRD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.to(self.bn.weight.dtype)) * self.scale


class Shifted:
    """Samples far from BatchNorm's initial statistics (mean 0, variance 1)."""

    def __len__(self) -> int:
        return 48

    def batch(self, indices):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(len(self), 4, generator=g) * 2.0 + 3.0
        return x[list(indices)], torch.zeros(len(indices), 4)


def test_a_bf16_mixed_step_brings_batchnorm_statistics_into_the_master():
    torch.set_num_threads(1)
    spec = sequential_model([Normalise, lambda: nn.Linear(4, 4)], loss=nn.functional.mse_loss,
                            sample_batch=lambda b: (torch.zeros(b, 4), torch.zeros(b, 4)))
    cfg = load_config(None, ["train.device=cpu", "train.precision=bf16-mixed", f"train.global_batch_size={BATCH}",
                             f"train.microbatch_size={MICROBATCH}", "data.shuffle=false"])
    _, (plan,) = plans_for([Phase(pipelines=((0,),), steps=1)], spec.num_layers, BATCH, MICROBATCH)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    data = Shifted()
    trainer = Trainer(model=spec, dataset=data, cfg=cfg, me=WorkerRef(0, 0), store=store)
    try:
        trainer.build(plan)
        consumed = trainer.step().consumed
        master = trainer.layers[0].module.get_submodule("0")
    finally:
        trainer.shutdown()
    # the float32 module on the same microbatches, in the schedule's order
    reference = nn.BatchNorm1d(4)
    for mb in data.batch(consumed)[0].split(MICROBATCH):
        reference(mb)
    assert len(consumed) == BATCH
    assert not torch.equal(master.bn.running_mean, torch.zeros(4)), \
        "running_mean is still its initial value: the statistics stayed in the bf16 copy"
    assert master.bn.running_mean.dtype == master.bn.running_var.dtype == torch.float32
    # bf16 keeps 8 significant bits: each of the 12 updates rounds the statistics again
    torch.testing.assert_close(master.bn.running_mean, reference.running_mean, rtol=0.02, atol=0.02)
    torch.testing.assert_close(master.bn.running_var, reference.running_var, rtol=0.05, atol=0.02)
    assert int(master.bn.num_batches_tracked) == BATCH // MICROBATCH  # copied as it is, not rounded
    assert master.scale.item() == torch.tensor(THIRD).item(), "a buffer no forward changes keeps float32"
