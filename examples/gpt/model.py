"""GPT-style model as a layer list: embedding, N transformer blocks, head (with the loss).

Sizes come from the job config's `model` section (GPTConfig), parsed with the package's config
rules so a typo there gets the same clear message as anywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oobleck_elastic.config import parse_section
from oobleck_elastic.errors import ConfigError
from oobleck_elastic.models.sequential import sequential_model
from oobleck_elastic.runtime.model import ModelSpec

__all__ = ["GPTConfig", "gpt_model", "job", "parse_gpt_config"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The example model's sizes (the job file's `model` section)."""

    vocab_size: int = 128
    """Tokens in the vocabulary."""
    seq_len: int = 32
    """Tokens per sample."""
    d_model: int = 64
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    n_layers: int = 6
    """Transformer blocks (the layer list has n_layers + 2 entries)."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of d_model."""
    dropout: float = 0.0
    """Dropout probability (0 keeps training deterministic)."""
    dataset_size: int = 65536
    """Samples in the synthetic dataset."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio", "dataset_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model ({self.d_model}) must be a multiple of model.n_heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")


def parse_gpt_config(section: Mapping[str, Any]) -> GPTConfig:
    return parse_section(GPTConfig, section, "model")


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.dropout(self.tokens(idx) + self.positions(pos))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (runtime.model Note: [loss]); bf16 logits are upcast."""
    flat = logits.flatten(0, 1)
    return F.cross_entropy(flat if flat.dtype in (torch.float32, torch.float64) else flat.float(), targets.flatten())


def gpt_model(cfg: GPTConfig) -> ModelSpec:
    """The GPT example as a ModelSpec (n_layers + 2 layers: embed, block0.., head)."""
    from examples.gpt.data import SyntheticTokens

    factories = [lambda: Embedding(cfg)] + [lambda: Block(cfg)] * cfg.n_layers + [lambda: Head(cfg)]
    names = ["embed", *(f"block{i}" for i in range(cfg.n_layers)), "head"]
    data = SyntheticTokens(cfg, seed=0)

    def sample_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return data.batch(range(size))

    sizes = {k: v for k, v in asdict(cfg).items() if k != "dataset_size"}
    return sequential_model(factories, names=names, loss=token_loss, sample_batch=sample_batch,
                            name="examples.gpt", description={"gpt": sizes}, vocab_size=cfg.vocab_size,
                            max_positions=cfg.seq_len)


def job(cfg):
    """`model.factory: examples.gpt.model:job`: the example and its synthetic data, for
    `python -m oobleck_elastic.train` (the other keys of the model section are GPTConfig's)."""
    from examples.gpt.data import SyntheticTokens

    gpt = parse_gpt_config({k: v for k, v in cfg.model.items() if k != "factory"})
    return gpt_model(gpt), SyntheticTokens(gpt, seed=cfg.train.seed)
