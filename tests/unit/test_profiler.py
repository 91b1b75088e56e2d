"""The model interface, the profiler and its cache, and the GPT example."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from examples.gpt.data import SyntheticTokens
from examples.gpt.model import GPTConfig, gpt_model, parse_gpt_config
from oobleck_elastic.config import OptimizerConfig
from oobleck_elastic.errors import ConfigError
from oobleck_elastic.runtime.model import LayerSpec, ModelSpec, materialize_layer
from oobleck_elastic.runtime.profiler import _time_in_context, _windows, load_or_profile, profile_model

TINY = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, dataset_size=512)


def test_layers_are_identical_across_replicas_without_broadcast():
    spec = gpt_model(TINY)
    a = materialize_layer(spec, 2, seed=5, dtype=torch.float64)
    torch.manual_seed(999)  # global RNG state must not matter
    materialize_layer(spec, 1, seed=5, dtype=torch.float64)
    b = materialize_layer(spec, 2, seed=5, dtype=torch.float64)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = materialize_layer(spec, 2, seed=6, dtype=torch.float64)
    assert not torch.equal(a.block1.qkv.weight, c.block1.qkv.weight)
    assert a.block1.qkv.weight.dtype == torch.float64
    assert "block1.qkv.weight" in a.state_dict()  # the model's own names (Note: [parameter names])


def test_profile_measures_sizes_exactly():
    spec = gpt_model(TINY)
    p = profile_model(spec, microbatch_size=4, dtype="float32", iterations=2)
    assert [x.name for x in p.layers] == ["embed", "block0", "block1", "head"]
    for i, x in enumerate(p.layers):
        module = materialize_layer(spec, i, seed=0, dtype=torch.float32)
        params = sum(q.numel() * 4 for q in module.parameters())
        assert x.param_bytes == params and x.grad_bytes == params
        # AdamW moments + step
        assert 2 * params <= x.optimizer_bytes <= 2 * params + 64 * len(list(module.parameters()))
        assert x.forward_ms > 0 and x.backward_ms > 0
    assert p.layers[1].output_bytes == 4 * 8 * 16 * 4  # microbatch x seq x d_model x float32
    assert p.layers[1].activation_bytes > p.layers[1].output_bytes
    assert p.layers[-1].output_bytes == 4  # the loss
    sgd = profile_model(spec, microbatch_size=4, dtype="float32", iterations=1,
                        optimizer=OptimizerConfig(name="SGD", kwargs={"lr": 0.1}))
    assert all(x.optimizer_bytes == 0 for x in sgd.layers)


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.02)
        return grad * 2


class _SlowLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return _SlowBackward.apply(x * self.w)


def test_backward_is_measured_not_derived():
    spec = ModelSpec(name="slow", layers=(LayerSpec("slow", _SlowLayer), LayerSpec("sum", _SlowLayer)),
                     loss=lambda out, target: out.sum(),
                     sample_batch=lambda n: (torch.ones(n, 4), torch.zeros(n)))
    p = profile_model(spec, microbatch_size=2, dtype="float32", iterations=2)
    assert p.layers[0].backward_ms >= 18
    assert p.layers[0].forward_ms < 10


def test_a_model_larger_than_the_window_budget_is_timed_window_by_window():
    """Layers are timed in windows of consecutive layers that fit the budget (Note: [layers
    timed in context]); each window starts from the previous one's output, so a model larger
    than one device is still timed, every layer with a forward, a backward and an optimizer step
    (each layer here has parameters)."""
    spec = gpt_model(TINY)
    p = profile_model(spec, microbatch_size=2, dtype="float32", iterations=1)
    sizes = [2 * x.param_bytes + x.optimizer_bytes + x.activation_bytes + x.output_bytes for x in p.layers]
    assert _windows(list(p.layers), sum(sizes)) == [range(0, 4)]
    assert _windows(list(p.layers), 0) == [range(i, i + 1) for i in range(4)]  # one layer at least
    two = _windows(list(p.layers), sizes[0] + sizes[1])
    assert two[0] == range(0, 2) and [i for w in two for i in w] == [0, 1, 2, 3]
    from oobleck_elastic.config import TrainConfig
    x, target = spec.sample_batch(2)
    for windows in ([range(0, 4)], [range(i, i + 1) for i in range(4)], two):
        times = _time_in_context(spec, windows, x, target, seed=0, train=TrainConfig(precision="fp32"),
                                 device=torch.device("cpu"), iterations=2)
        assert len(times) == 4 and all(f > 0 and b > 0 and o > 0 for f, b, o in times)


def test_cache_hit_and_stale_cache_is_never_used(tmp_path):
    spec = gpt_model(TINY)
    args = dict(directory=str(tmp_path), microbatch_size=2, dtype="float32", iterations=1)
    first, cached = load_or_profile(spec, **args)
    assert not cached
    again, cached = load_or_profile(spec, **args)
    assert cached and again == first
    other, cached = load_or_profile(spec, **{**args, "dtype": "float64"})
    assert not cached and other.dtype == "float64"
    (path,) = [p for p in tmp_path.iterdir() if json.loads(p.read_text())["dtype"] == "float32"]
    data = json.loads(path.read_text())
    data["torch_version"] = "1.0"
    path.write_text(json.dumps(data))
    fresh, cached = load_or_profile(spec, **args)
    assert not cached and fresh.torch_version == torch.__version__
    path.write_text("{not json")
    _, cached = load_or_profile(spec, **args)
    assert not cached
    bigger = gpt_model(GPTConfig(**{**TINY.__dict__, "d_model": 32}))
    _, cached = load_or_profile(bigger, **args)
    assert not cached


def test_gpt_config_errors():
    with pytest.raises(ConfigError, match="model.d_model \\(30\\) must be a multiple of model.n_heads"):
        parse_gpt_config({"d_model": 30, "n_heads": 4})
    with pytest.raises(ConfigError, match="did you mean 'n_layers'"):
        parse_gpt_config({"n_layer": 3})


def test_synthetic_data_is_deterministic_and_learnable():
    data = SyntheticTokens(TINY, seed=0)
    assert torch.equal(data.sample(7), SyntheticTokens(TINY, seed=0).sample(7))
    assert not torch.equal(data.sample(7), data.sample(8))
    spec = gpt_model(TINY)
    model = nn.Sequential(*(materialize_layer(spec, i, seed=0, dtype=torch.float32) for i in range(spec.num_layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(60):
        x, y = data.batch(range(step * 16 % 512, step * 16 % 512 + 16))
        loss = spec.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
