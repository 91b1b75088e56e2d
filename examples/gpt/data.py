"""A deterministic synthetic token dataset on which a small GPT's loss visibly falls.

Sample i is generated from its own seeded generator: a start token, then each next token is
a fixed (seeded) successor of the current one with probability 0.85, otherwise uniform. A model
that learns the successor table drops from ln(vocab) towards the noise floor; nothing is
downloaded and sample i is the same in every process.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from examples.gpt.model import GPTConfig

__all__ = ["SyntheticTokens"]

FOLLOW = 0.85


class SyntheticTokens:
    """`held_out=True`: other samples of the same language (the same successor table), for
    evaluation."""

    def __init__(self, cfg: GPTConfig, seed: int, held_out: bool = False) -> None:
        self.cfg = cfg
        self.seed = seed
        self.first = cfg.dataset_size if held_out else 0
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        self.successor = torch.randperm(cfg.vocab_size, generator=g).tolist()

    def __len__(self) -> int:
        return self.cfg.dataset_size

    def sample(self, index: int) -> torch.Tensor:
        """seq_len + 1 tokens: input is [:-1], target is [1:]."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside the dataset of {len(self)}")
        g = torch.Generator().manual_seed((self.seed << 32) + self.first + index)
        n = self.cfg.seq_len + 1
        noise = torch.randint(self.cfg.vocab_size, (n,), generator=g).tolist()
        follow = (torch.rand(n, generator=g) < FOLLOW).tolist()
        successor = self.successor
        tokens = [noise[0]]
        for t in range(1, n):  # on Python ints: element-wise tensor ops cost ~9 ms a batch of 32
            tokens.append(successor[tokens[-1]] if follow[t] else noise[t])
        return torch.tensor(tokens, dtype=torch.long)

    def target_count(self, indices: Iterable[int]) -> int:
        """Every target token counts (runtime.data Note: [loss count])."""
        return len(list(indices)) * self.cfg.seq_len

    def batch(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([self.sample(i) for i in indices])
        return rows[:, :-1], rows[:, 1:]
