"""Shared fixtures and helpers for the test suite. The tests live in one folder per tier; the
helpers they import by name (`from jobs import ...`) in tests/helpers/, put on the path here."""

from __future__ import annotations

import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "helpers"))

from jobs import failure_free, failure_free_40  # noqa: E402,F401 (fixtures: the single-process reference runs)
from oobleck_elastic.planning import Cluster, LayerProfile, ModelProfile  # noqa: E402


def random_profile(rng: random.Random, num_layers: int, *, act_scale: float = 1.0) -> ModelProfile:
    """A small profile with random times and sizes (bytes in units that keep numbers readable)."""
    layers = []
    for i in range(num_layers):
        fwd = rng.uniform(0.5, 3.0)
        params = rng.randint(1, 50) * 1000
        layers.append(LayerProfile(
            name=f"layer{i}", forward_ms=fwd, backward_ms=fwd * rng.uniform(1.5, 2.5),
            param_bytes=params, grad_bytes=params, optimizer_bytes=2 * params,
            activation_bytes=int(rng.randint(1, 30) * 1000 * act_scale),
            output_bytes=rng.randint(1, 5) * 10**6))
    return ModelProfile(signature=f"random-{num_layers}", microbatch_size=1, dtype="float32",
                        device="test", torch_version="n/a", device_memory_bytes=None,
                        layers=tuple(layers))


def small_cluster(workers_per_node: int = 1, memory: int = 10**9, **kw) -> Cluster:
    return Cluster(workers_per_node=workers_per_node, memory_per_worker=memory, **kw)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """The CPU tiers run on the CPU even on a machine with GPUs: train.device defaults to auto
    (CUDA when available), so every test not marked `gpu` hides the GPUs from the processes
    it starts (they inherit the environment). Tests marked `gpu` see them."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
