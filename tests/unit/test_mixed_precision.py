"""bf16-mixed (runtime.layers Note: [mixed precision]): bf16 compute on a copy of each layer,
float32 master parameters, gradients and optimizer state; what transfers, checkpoints, the
profiler and the planner's memory model see (a 4-node run with a kill:
tests/jobs/test_mixed_precision_jobs.py)."""

from __future__ import annotations

import pytest
import torch

from examples.gpt.model import GPTConfig, gpt_model
from oobleck_elastic.config import load_config
from oobleck_elastic.runtime.checkpoint import job_key
from oobleck_elastic.runtime.layers import LayerStore
from oobleck_elastic.runtime.profiler import profile_model

TINY = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, dropout=0.0, dataset_size=64)


def mixed_store(*sets: str) -> LayerStore:
    return LayerStore(gpt_model(TINY), load_config(None, ["train.precision=bf16-mixed", *sets]).train,
                      torch.device("cpu"))


def test_master_gradients_accumulate_in_fp32_and_the_copy_follows_the_master():
    layers = mixed_store()
    state = layers.materialize(1)  # a transformer block
    assert state.compute is not state.module
    assert {p.dtype for p in state.module.parameters()} == {torch.float32}
    assert {p.dtype for p in state.compute.parameters()} == {torch.bfloat16}
    x = torch.randn(2, TINY.seq_len, TINY.d_model, generator=torch.Generator().manual_seed(0))
    # what two microbatches should add up to: each bf16 gradient, summed in float32
    expected = [torch.zeros_like(p) for p in state.params]
    reference = gpt_model(TINY).layers[1].factory().to(torch.bfloat16)
    reference.load_state_dict(state.compute.state_dict())
    for mb in (x[:1], x[1:]):
        grads = torch.autograd.grad(reference(mb.bfloat16()).float().sum(), list(reference.parameters()))
        for total, g in zip(expected, grads):
            total.add_(g.float())
        state.compute(mb.bfloat16()).float().sum().backward()
    for master, low, want in zip(state.params, state.compute.parameters(), expected):
        assert master.grad.dtype == torch.float32 and low.grad is None
        assert torch.equal(master.grad, want)
    before = [p.detach().clone() for p in state.compute.parameters()]
    state.optimizer.step()
    assert all(v.dtype == torch.float32 for s in state.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.is_floating_point())
    # what a transfer or a checkpoint carries: the float32 master and its optimizer state
    assert {t.dtype for t in state.state_tensors() if t.is_floating_point()} == {torch.float32}
    assert all(torch.equal(p, b) for p, b in zip(state.compute.parameters(), before)), "the copy waits"
    layers.refresh_compute([1])
    for low, master in zip(state.compute.state_dict().values(), state.module.state_dict().values()):
        assert torch.equal(low, master.to(low.dtype))
    # an update below bf16's resolution: kept by the master, lost in the copy (why the master)
    norm = state.module.get_parameter("block0.ln1.weight")
    assert not torch.equal(norm, torch.ones_like(norm))
    assert torch.equal(state.compute.get_parameter("block0.ln1.weight").float(), torch.ones_like(norm))


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                              ("fp64", torch.float64)])
def test_single_dtype_precisions_compute_on_the_master(precision, dtype):
    layers = LayerStore(gpt_model(TINY), load_config(None, [f"train.precision={precision}"]).train,
                        torch.device("cpu"))
    state = layers.materialize(1)
    assert state.compute is state.module and {p.dtype for p in state.params} == {dtype}
    assert layers.compute_dtype == layers.dtype == dtype


def test_profiler_counts_both_copies_and_times_the_optimizer():
    spec = gpt_model(TINY)
    fp32 = profile_model(spec, microbatch_size=2, precision="fp32", iterations=1)
    mixed = profile_model(spec, microbatch_size=2, precision="bf16-mixed", iterations=1)
    assert (fp32.dtype, mixed.dtype) == ("float32", "bf16-mixed")
    assert fp32.key() != mixed.key()  # never one for the other from the cache
    for a, b in zip(fp32.layers, mixed.layers):
        assert b.param_bytes == a.param_bytes and b.optimizer_bytes == a.optimizer_bytes  # fp32 master
        assert a.compute_copy_bytes == 0 and b.compute_copy_bytes == a.param_bytes // 2  # the bf16 copy
        assert b.static_bytes == a.static_bytes + b.compute_copy_bytes
        assert b.output_bytes * 2 == a.output_bytes or b.output_bytes == a.output_bytes == 4  # bf16 activations
        assert a.optimizer_ms > 0 and b.optimizer_ms > 0
    # the former keyword still works and names the same profile
    assert profile_model(spec, microbatch_size=2, dtype="float32", iterations=1).key() == fp32.key()


def test_checkpoints_of_single_dtype_jobs_keep_their_key():
    """A checkpoint written before train.precision existed (key "train.dtype": "float32") still
    matches its job; bf16-mixed is another job (a float32 run may not resume it silently)."""
    fp32 = job_key("m", load_config(None, []), 10)
    assert fp32["train.dtype"] == "float32" and "train.precision" not in fp32
    assert job_key("m", load_config(None, ["train.dtype=float64"]), 10)["train.dtype"] == "float64"
    mixed = job_key("m", load_config(None, ["train.precision=bf16-mixed"]), 10)
    assert mixed == {**fp32, "train.precision": "bf16-mixed"}
