"""Which samples each step and each pipeline consume, and loading them ahead of the step.

Note: [sample order]
    Step k consumes global sample positions [k*B, (k+1)*B). With shuffling, position j is
    sample perm_e[j mod N] of dataset epoch e = j div N, where perm_e is a permutation seeded
    from (seed, e); without, it is sample j mod N. Pipeline i takes the contiguous slice
    `Instantiation.sample_slices()[i]` of the step's B samples, and within it microbatch t is
    the t-th run of b samples. The order does not depend on the layout, so a replayed or
    reconfigured step sees the same samples.

Note: [loss count]
    A mean loss is turned into the mean over the whole global batch (runtime.model Note:
    [loss]) by dividing each microbatch's sum by the step's counted elements (tokens that are
    not -100, say). Last stages need that count before the step's first backward, so the
    loader computes it with the step's batch: from the dataset's `target_count(indices)` when
    it has one (a token file: every target counts), else by loading the step's targets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Batch", "BatchLoader", "Dataset", "SampleOrder"]


class Dataset(Protocol):
    """A map-style dataset: `batch(indices)` -> (inputs, targets) stacked over the indices.
    Optional methods make loading cheaper: `inputs(indices)`, `targets(indices)` (the first
    stage reads only inputs, the last only targets) and `target_count(indices)` (Note: [loss
    count])."""

    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]: ...


class SampleOrder:
    def __init__(self, dataset_size: int, seed: int, shuffle: bool = True) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle

    @functools.lru_cache(maxsize=4)  # noqa: B019 (one order per process, a few epochs live)
    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_size, generator=g)

    def indices(self, step: int, global_batch: int, start: int = 0, end: int | None = None) -> list[int]:
        """Dataset indices of positions [start, end) of step `step`'s global batch."""
        end = global_batch if end is None else end
        positions = range(step * global_batch + start, step * global_batch + end)
        if not self.shuffle:
            return [j % self.dataset_size for j in positions]
        out = []
        for j in positions:
            epoch, pos = divmod(j, self.dataset_size)
            out.append(int(self._permutation(epoch)[pos]))
        return out


@dataclass(frozen=True)
class Batch:
    """What one worker feeds its stage for one step."""

    step: int
    indices: tuple[int, ...]
    inputs: torch.Tensor | None
    """The slice's inputs (first stages only)."""
    targets: torch.Tensor | None
    """The slice's targets (last stages only)."""
    count: int
    """Counted target elements of the whole global batch (last stages; 0 elsewhere)."""


class BatchLoader:
    """Loads a worker's slice of each step and prefetches the next step's in a thread, so
    reading and host-to-device copies are off the critical path (Note: [sample order]: the
    slice is a function of step and layout only, so a prefetched batch is used only when the
    layout is unchanged)."""

    def __init__(self, dataset: Dataset, order: SampleOrder, global_batch: int,
                 loss_count: Callable[[torch.Tensor], int], device: torch.device) -> None:
        self.dataset, self.order, self.global_batch = dataset, order, global_batch
        self.loss_count, self.device = loss_count, device
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: tuple[tuple, Future] | None = None

    def get(self, step: int, lo: int, hi: int, *, first: bool, last: bool) -> Batch:
        key = (step, lo, hi, first, last)
        ahead, self._ahead = self._ahead, None
        batch = ahead[1].result() if ahead is not None and ahead[0] == key else self._load(*key)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="oobleck-prefetch")
        nxt = (step + 1, lo, hi, first, last)
        self._ahead = (nxt, self._executor.submit(self._load, *nxt))
        return batch

    def microbatch_input(self, microbatch_size: int) -> torch.Tensor:
        """A microbatch's inputs shaped as the dataset gives them (sample 0, repeated): what
        stage shapes are computed from."""
        ds = self.dataset
        one = ds.inputs([0]) if hasattr(ds, "inputs") else ds.batch([0])[0]
        return one.expand(microbatch_size, *one.shape[1:]).contiguous()

    def _load(self, step: int, lo: int, hi: int, first: bool, last: bool) -> Batch:
        indices = self.order.indices(step, self.global_batch, lo, hi)
        ds = self.dataset
        if hasattr(ds, "inputs") and hasattr(ds, "targets"):
            inputs = ds.inputs(indices) if first else None
            targets = ds.targets(indices) if last else None
        else:
            x, y = ds.batch(indices)
            inputs, targets = (x if first else None), (y if last else None)
        count = self._count(step) if last else 0
        to = functools.partial(torch.Tensor.to, device=self.device, non_blocking=True)
        return Batch(step=step, indices=tuple(indices), inputs=None if inputs is None else to(inputs),
                     targets=None if targets is None else to(targets), count=count)

    def _count(self, step: int) -> int:
        everything = self.order.indices(step, self.global_batch)
        if hasattr(self.dataset, "target_count"):
            return int(self.dataset.target_count(everything))
        targets = self.dataset.targets(everything) if hasattr(self.dataset, "targets") \
            else self.dataset.batch(everything)[1]
        return int(self.loss_count(targets))

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
