"""Random model profiles and small clusters for the planner's tests."""

from __future__ import annotations

import random

from oobleck_elastic.planning import Cluster, LayerProfile, ModelProfile


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
