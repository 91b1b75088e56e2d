"""A plain torch model with a tied parameter and a dataset with uneven padding, for the
exactness tests of the sequential adapter, tied parameters and the mean-loss contract."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oobleck_elastic.models.sequential import sequential_model

VOCAB, WIDTH, SEQ = 29, 12, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.full((WIDTH,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x))) * self.scale


def build() -> nn.Sequential:
    """The model as a user writes it: the head's weight *is* the embedding's (one Parameter)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), Block(), Block(), nn.Linear(WIDTH, VOCAB, bias=False))
    model[3].weight = model[0].weight
    return model.double()


def mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class PaddedTokens:
    """Sample i: random tokens; every even sample is all padding (targets -100), sample i odd
    has its first (5 i mod (SEQ + 1)) targets set to -100: microbatches count different
    numbers of tokens, some none at all."""

    def __len__(self) -> int:
        return 96

    def batch(self, indices):
        xs, ys = [], []
        for i in indices:
            g = torch.Generator().manual_seed(1000 + i)
            tokens = torch.randint(VOCAB, (SEQ + 1,), generator=g)
            y = tokens[1:].clone()
            y[: SEQ if i % 2 == 0 else (5 * i) % (SEQ + 1)] = -100
            xs.append(tokens[:-1])
            ys.append(y)
        return torch.stack(xs), torch.stack(ys)


def tied_padded():
    data = PaddedTokens()
    spec = sequential_model(build(), loss=mean_loss, sample_batch=lambda b: data.batch(range(b)),
                            name="tied", vocab_size=VOCAB)
    return spec, data


def factory(cfg):
    """`model.factory: tied_model:factory`: the model and its dataset from the job config."""
    return tied_padded()
