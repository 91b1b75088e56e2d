"""bf16-mixed on a whole local job (runtime.layers Note: [mixed precision]): a 4-node run with a
node killed mid-step follows the single-process float32 run, and its checkpoints hold float32
masters (the layer-level checks: tests/unit/test_mixed_precision.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from jobs import ROOT, SCRIPT, records

from oobleck_elastic.runtime.checkpoint import load_model_state, read_manifest

STEPS = 30


def _job(tmp_path, name, *sets):
    return ["--config", str(ROOT / "examples/gpt/config.yaml"), "--set", f"train.steps={STEPS}",
            "--set", "checkpoint.interval=0", "--set", f"planner.profile_dir={tmp_path / 'profiles'}",
            "--set", f"monitoring.metrics_path={tmp_path / name / 'metrics.jsonl'}",
            "--set", f"monitoring.tensorboard_dir={tmp_path / name / 'tb'}",
            "--set", f"checkpoint.dir={tmp_path / name / 'checkpoints'}", *sets]


def test_four_nodes_bf16_mixed_with_a_kill_follow_the_fp32_reference(tmp_path):
    ref = subprocess.Popen([sys.executable, SCRIPT, *_job(tmp_path, "ref", "--set", "planner.memory_per_worker=1GB")],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    env = {**os.environ, "OOBLECK_FAULT": "node=1,step=12,phase=backward"}
    mixed = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=4",
                            "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", SCRIPT,
                            *_job(tmp_path, "job", "--set", "train.precision=bf16-mixed",
                                  "--set", "planner.memory_per_worker=8MB")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    out, _ = ref.communicate(timeout=400)
    assert ref.returncode == 0, out
    assert mixed.returncode == 0, mixed.stdout + mixed.stderr
    log = records(tmp_path / "job/metrics.jsonl")
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[1]]
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS)), "each step logged once, the killed one replayed"
    assert all(r["samples"] == 64 for r in steps)
    reference = {r["step"]: r["loss"] for r in records(tmp_path / "ref/metrics.jsonl")
                 if "step" in r and "event" not in r}
    for r in steps:
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=0.02), f"step {r['step']}"
    assert reference[STEPS - 1] < 0.8 * reference[0], "the run learns (the comparison is not of two flat lines)"
    root = str(tmp_path / "job/checkpoints")
    manifest = read_manifest(root, STEPS)
    assert manifest["job"]["train.precision"] == "bf16-mixed"
    assert {kind.split("[")[0] for kind in manifest["params"].values()} == {"float32"}
    state = load_model_state(root, STEPS, len(manifest["sha256"]))
    assert state and {t.dtype for t in state.values() if t.is_floating_point()} == {torch.float32}
