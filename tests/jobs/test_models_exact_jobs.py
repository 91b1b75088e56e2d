"""The tied nn.Sequential of tests/multiproc/test_models_exact.py named by model.factory and
trained by `python -m oobleck_elastic.train` as a local job through a kill, then exported:
equal to plain PyTorch under its own names."""

from __future__ import annotations

import tied_model
import torch
from tied_reference import OVERRIDES, plain_reference


def test_factory_model_on_four_nodes_through_a_kill_exports_its_own_state_dict(tmp_path):
    """The tied nn.Sequential with its padded data, named by model.factory, trained by
    `python -m oobleck_elastic.train` on 4 local nodes (2-node pipelines: the tied copies on
    different nodes) with a node SIGKILLed mid-step, then exported: one safetensors file under
    the nn.Sequential's own names, equal to plain PyTorch."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    sets = ["model.factory=tied_model:factory", "train.dtype=float64", "train.global_batch_size=24",
            "train.microbatch_size=2", "train.optimizer.lr=0.01", "train.steps=4", *OVERRIDES,
            "planner.memory_per_worker=35KB", f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"planner.profile_dir={tmp_path / 'profiles'}", f"monitoring.metrics_path={tmp_path / 'm.jsonl'}",
            f"monitoring.tensorboard_dir={tmp_path / 'tb'}"]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(tied_model.__file__),
           "OOBLECK_FAULT": "node=1,step=2,phase=backward"}
    train = [sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=4", "--nproc-per-node=1",
             f"--oobleck-log-dir={tmp_path / 'logs'}", "-m", "oobleck_elastic.train",
             *(x for s in sets for x in ("--set", s))]
    export = [sys.executable, "-m", "oobleck_elastic.export", str(tmp_path / "ckpt"), str(tmp_path / "out")]
    for argv in (train, export):
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    log = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    first = [r for r in log if r.get("event") == "generation"][0]
    assert [len(p["nodes"]) for p in first["pipelines"]] == [2, 2]
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[1]]
    got, want = load_file(tmp_path / "out/model.safetensors"), plain_reference(4)
    assert set(got) == set(want)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-10, atol=0), name
