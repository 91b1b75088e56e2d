"""runtime.data: the sample order (shuffled or not), and the loader that reads only what a
stage needs, counts the global batch's targets and prefetches the next step in a thread."""

from __future__ import annotations

import threading

import torch

from oobleck_elastic.runtime.data import BatchLoader, SampleOrder
from oobleck_elastic.runtime.model import counted_elements


class Recording:
    """A dataset of 10 samples that records which thread read what."""

    def __init__(self, with_count: bool) -> None:
        self.calls: list[tuple[str, tuple[int, ...], str]] = []
        if with_count:
            self.target_count = lambda idx: self._log("count", idx) or 7 * len(idx)

    def _log(self, what, idx):
        self.calls.append((what, tuple(idx), threading.current_thread().name))

    def __len__(self) -> int:
        return 10

    def inputs(self, idx):
        self._log("inputs", idx)
        return torch.tensor(idx).unsqueeze(1)

    def targets(self, idx):
        self._log("targets", idx)
        y = torch.tensor(idx).unsqueeze(1).repeat(1, 3)
        y[:, 0] = -100  # one padded target per sample
        return y

    def batch(self, idx):
        raise AssertionError("inputs()/targets() exist: batch() must not be used")


def test_unshuffled_order_walks_the_data_in_order():
    order = SampleOrder(10, seed=3, shuffle=False)
    assert order.indices(0, 4) == [0, 1, 2, 3] and order.indices(2, 4) == [8, 9, 0, 1]
    shuffled = SampleOrder(10, seed=3)
    assert sorted(shuffled.indices(0, 10)) == list(range(10)) and shuffled.indices(0, 10) != list(range(10))


def test_stages_read_only_their_half_and_the_next_step_is_prefetched():
    data = Recording(with_count=False)
    loader = BatchLoader(data, SampleOrder(10, 0, shuffle=False), 4, counted_elements, torch.device("cpu"))
    first = loader.get(0, 0, 2, first=True, last=False)
    assert first.inputs.flatten().tolist() == [0, 1] and first.targets is None and first.count == 0
    nxt = loader.get(1, 0, 2, first=True, last=False)
    assert nxt.inputs.flatten().tolist() == [4, 5]
    assert [c[:2] for c in data.calls if c[2].startswith("oobleck-prefetch")][:1] == [("inputs", (4, 5))]
    assert not any(c[0] == "targets" for c in data.calls), "a first stage never reads targets"
    loader.close()

    data = Recording(with_count=False)
    loader = BatchLoader(data, SampleOrder(10, 0, shuffle=False), 4, counted_elements, torch.device("cpu"))
    last = loader.get(0, 2, 4, first=False, last=True)
    assert last.inputs is None and last.targets[:, 1].tolist() == [2, 3]
    assert last.count == 4 * 2, "counted targets of the whole global batch, padding left out"
    assert not any(c[0] == "inputs" for c in data.calls), "a last stage never reads inputs"
    moved = loader.get(1, 0, 4, first=False, last=True)  # the layout changed: the prefetch is not used
    assert moved.indices == (4, 5, 6, 7)
    loader.close()


def test_a_dataset_that_counts_its_targets_is_not_read_for_the_count():
    data = Recording(with_count=True)
    loader = BatchLoader(data, SampleOrder(10, 0, shuffle=False), 4, counted_elements, torch.device("cpu"))
    assert loader.get(0, 0, 4, first=False, last=True).count == 28
    assert [c[:2] for c in data.calls if c[2] == threading.current_thread().name] == [
        ("targets", (0, 1, 2, 3)), ("count", (0, 1, 2, 3))]
    loader.close()
