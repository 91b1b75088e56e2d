"""Evaluation (eval.interval, eval.steps): the held-out loss forward only through the pipelines,
averaged as training averages a step, equal to plain PyTorch's mean cross-entropy over the same
samples, and recovered like a step when a node dies while it runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from jobs import SCRIPT, STEPS, assert_matches, job_args, records

EVAL = ["--set", "eval.interval=2", "--set", "eval.steps=2"]


def evals(log):
    return [(r["step"], r["loss"]) for r in log if r.get("event") == "eval"]


def plain_eval_loss(checkpoints, step: int) -> float:
    """Mean cross-entropy of the example model, loaded from the checkpoint of `step`, over the
    first 2 x 64 held-out samples, in one plain forward pass."""
    from examples.gpt.data import SyntheticTokens
    from examples.gpt.model import gpt_model, parse_gpt_config
    from oobleck_elastic.config import load_config
    from oobleck_elastic.runtime.checkpoint import load_model_state
    from oobleck_elastic.runtime.model import materialize_layer

    cfg = load_config(str(os.path.join(os.path.dirname(SCRIPT), "config.yaml")), ["train.dtype=float64"])
    gpt = parse_gpt_config(cfg.model)
    spec = gpt_model(gpt)
    state = load_model_state(str(checkpoints), step, spec.num_layers)
    x, y = SyntheticTokens(gpt, seed=0, held_out=True).batch(range(128))
    with torch.no_grad():
        for i in range(spec.num_layers):
            layer = materialize_layer(spec, i, seed=0, dtype=torch.float64)
            layer.load_state_dict({k: state[k] for k in layer.state_dict()})
            x = layer(x)
    return float(F.cross_entropy(x.flatten(0, 1), y.flatten()))


def test_eval_through_pipelines_equals_plain_pytorch_and_survives_a_kill(tmp_path):
    alone = subprocess.run([sys.executable, SCRIPT, *job_args(tmp_path, "ref"), *EVAL,
                            "--set", "planner.memory_per_worker=1GB"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode == 0, alone.stderr
    reference = records(tmp_path / "ref/metrics.jsonl")
    assert [s for s, _ in evals(reference)] == [2, 4, 6]
    assert evals(reference)[-1][1] == pytest.approx(plain_eval_loss(tmp_path / "ref/checkpoints", STEPS), rel=1e-10)

    # node 1 dies as the evaluation after step 4 begins: it is run again; node 3 dies in step 2,
    # after the evaluation of step 2, which is not run again (each start of one on node 0 is
    # logged: a slow fault of no length)
    faults = "node=1,step=4,phase=eval;node=3,step=2,phase=forward;" + \
        ";".join(f"node=0,step={k},phase=eval,action=slow,seconds=0" for k in (2, 4, 6))
    env = {**os.environ, "OOBLECK_FAULT": faults, "OOBLECK_FAULT_LOG": str(tmp_path / "faults.jsonl")}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=5",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                           *job_args(tmp_path, "job"), *EVAL], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = records(tmp_path / "job/metrics.jsonl")
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[3], [1]]
    started = [r["step"] for r in records(tmp_path / "faults.jsonl") if r["phase"] == "eval" and r["node"] == 0]
    assert started == [2, 4, 4, 6], started
    ours = evals(log)
    assert [s for s, _ in ours] == [2, 4, 6], "each evaluation logged once, the interrupted one run again"
    for (_, got), (_, want) in zip(ours, evals(reference)):
        assert got == pytest.approx(want, rel=1e-9)
    assert [r["step"] for r in log if "step" in r and "event" not in r] == list(range(STEPS))
    assert_matches([r for r in log if r.get("event") == "final"][0], reference[-1])
