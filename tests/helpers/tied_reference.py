"""What plain PyTorch makes of the tied model (tied_model.py) in one process: the reference the
multi-process run and the local job of it are compared with."""

from __future__ import annotations

import tied_model
import torch
from runtime_harness import job_config

from oobleck_elastic.runtime.data import SampleOrder

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
