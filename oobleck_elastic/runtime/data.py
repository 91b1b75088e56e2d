"""Which samples each step and each pipeline consume.

Note: [sample order]
    Step k consumes global sample positions [k*B, (k+1)*B). Position j is sample
    perm_e[j mod N] of dataset epoch e = j div N, where perm_e is a permutation seeded from
    (seed, e). Pipeline i takes the contiguous slice `Instantiation.sample_slices()[i]` of the
    step's B samples, and within it microbatch t is the t-th run of b samples. The order does
    not depend on the layout, so a replayed or reconfigured step sees the same samples.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["SampleOrder"]


class SampleOrder:
    def __init__(self, dataset_size: int, seed: int) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
        self.dataset_size = dataset_size
        self.seed = seed

    @functools.lru_cache(maxsize=4)  # noqa: B019 (one order per process, a few epochs live)
    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_size, generator=g)

    def indices(self, step: int, global_batch: int, start: int = 0, end: int | None = None) -> list[int]:
        """Dataset indices of positions [start, end) of step `step`'s global batch."""
        end = global_batch if end is None else end
        out = []
        for j in range(step * global_batch + start, step * global_batch + end):
            epoch, pos = divmod(j, self.dataset_size)
            out.append(int(self._permutation(epoch)[pos]))
        return out
