"""The CUDA path (runtime.devices Note: [devices]): a node killed on NCCL, bf16-mixed on a GPU
against the CPU float32 run, and layer state moved device to device.

Every test here is marked `gpu` and skipped, saying why, where torch sees no (or too few)
GPUs. None of them has run yet: this project's machines had no GPU, so the CUDA path is
unverified (docs/gpus.md)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from jobs import ROOT, SCRIPT, STEPS, assert_matches, job_args, records

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason=f"torch {torch.__version__} sees no CUDA device: the CUDA path is unverified here"),
]


def need_gpus(count: int) -> None:
    have = torch.cuda.device_count()
    if have < count:
        pytest.skip(f"needs {count} GPUs (one per simulated node: NCCL refuses two ranks on one GPU), "
                    f"this machine has {have}")


def test_kill_a_node_on_nccl(tmp_path, failure_free):
    """3 local nodes on 3 GPUs (launcher: one GPU each), float64 on NCCL; node 1 dies in a
    backward; the survivors abort the old communicators, rebuild, copy layers device to device
    and end with the CPU single-process run's weights (to GPU rounding)."""
    need_gpus(3)
    env = {**os.environ, "OOBLECK_FAULT": "node=1,step=2,phase=backward"}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=3",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                           *job_args(tmp_path, "job"), "--set", "train.device=cuda",
                           "--set", "elastic.collective_timeout_s=10"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = records(tmp_path / "job/metrics.jsonl")
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[1]]
    assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(STEPS))
    assert_matches([r for r in log if r.get("event") == "final"][0], failure_free, rel=1e-6)


def _alone(tmp_path, name: str, sets: list[str], steps: int = 8) -> list[dict]:
    """One worker trains the GPT example alone with `sets`; its metrics log."""
    args = ["--config", str(ROOT / "examples/gpt/config.yaml"), "--set", f"train.steps={steps}",
            "--set", "planner.memory_per_worker=1GB", "--set", f"planner.profile_dir={tmp_path / 'profiles' / name}",
            "--set", f"monitoring.metrics_path={tmp_path / name / 'm.jsonl'}",
            "--set", f"monitoring.tensorboard_dir={tmp_path / name / 'tb'}",
            "--set", f"checkpoint.dir={tmp_path / name / 'ck'}"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records(tmp_path / name / "m.jsonl")


def _losses(log: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in log if "step" in r and "event" not in r}


def test_bf16_mixed_on_cuda_follows_the_cpu_fp32_run(tmp_path):
    need_gpus(1)
    runs = {name: _losses(_alone(tmp_path, name, sets, steps=30))
            for name, sets in (("cpu", ["train.device=cpu"]),
                               ("cuda", ["train.device=cuda", "train.precision=bf16-mixed"]))}
    assert sorted(runs["cuda"]) == list(range(30))
    for step, loss in runs["cuda"].items():
        assert loss == pytest.approx(runs["cpu"][step], rel=0.02), f"step {step}"


def _transfer_worker(rank: int, port: int, out: str) -> None:
    from examples.gpt.model import GPTConfig, gpt_model
    from oobleck_elastic.config import load_config
    from oobleck_elastic.planning import Transfer, WorkerRef
    from oobleck_elastic.runtime.devices import backend_for, resolve_device
    from oobleck_elastic.runtime.layers import LayerStore
    from oobleck_elastic.runtime.transfer import run_transfers

    class Plan:  # run_transfers needs rank_of only
        @staticmethod
        def rank_of(worker):
            return worker.node

    device = resolve_device("cuda", rank)
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                                       timeout=datetime.timedelta(seconds=60))
    torch.distributed.init_process_group(backend_for(device), store=store, rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=60))
    spec = gpt_model(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, dataset_size=64))
    train = load_config(None, ["train.precision=bf16-mixed", f"train.seed={rank}"]).train  # differing seeds
    layers = LayerStore(spec, train, device)
    if rank == 0:
        state = layers.materialize(1)
        for q in state.params:  # a real step: optimizer state with defined values (no NaN to compare)
            q.grad = torch.randn_like(q)
        state.optimizer.step()
    moved = run_transfers([Transfer(layer=1, src=WorkerRef(0, 0), dst=WorkerRef(1, 0))], Plan, WorkerRef(rank, 0),
                          layers, stepped=True, timeout=datetime.timedelta(seconds=60))
    assert moved > 0
    torch.save({k: v.cpu() for k, v in enumerate(layers[1].state_tensors())}, f"{out}/{rank}.pt")
    torch.distributed.destroy_process_group()


def test_layer_state_moves_device_to_device(tmp_path):
    """A bf16-mixed layer (fp32 master on cuda:0, optimizer state, CPU step counters) arrives on
    cuda:1 bit-identical."""
    need_gpus(2)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_transfer_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    sent, received = torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")
    assert sent.keys() == received.keys() and len(sent) > 2
    for key in sent:
        assert sent[key].dtype == received[key].dtype and torch.equal(sent[key], received[key])


@pytest.mark.parametrize("dtype, rel", [("float64", 1e-9), ("float32", 1e-4)])
def test_one_worker_on_cuda_follows_the_cpu_run(tmp_path, dtype, rel):
    """The same job, one worker, on the GPU and on the CPU: the losses of every step agree to
    the dtype's rounding (GPU kernels sum in another order, so not bit for bit)."""
    need_gpus(1)
    runs = {device: _alone(tmp_path, device, [f"train.device={device}", f"train.dtype={dtype}"])
            for device in ("cpu", "cuda")}
    losses = {d: _losses(log) for d, log in runs.items()}
    assert sorted(losses["cuda"]) == list(range(8))
    for step, loss in losses["cuda"].items():
        assert loss == pytest.approx(losses["cpu"][step], rel=rel), f"step {step}"


def test_a_cuda_run_resumes_from_its_checkpoint_exactly(tmp_path):
    """Stopped after 4 steps with a checkpoint and resumed to 8 on the GPU: the same final
    weights as 8 steps in one go on the GPU (float64; the same kernels run in the same order)."""
    need_gpus(1)
    cuda = ["train.device=cuda", "train.dtype=float64"]
    whole = _alone(tmp_path, "whole", cuda)
    _alone(tmp_path, "parts", [*cuda, "checkpoint.interval=4"], steps=4)
    resumed = _alone(tmp_path, "parts", [*cuda, "checkpoint.resume=auto"], steps=8)
    assert [r["step"] for r in resumed if "step" in r and "event" not in r][-1] == 7
    assert_matches([r for r in resumed if r.get("event") == "final"][-1],
                   [r for r in whole if r.get("event") == "final"][-1], rel=1e-12)
