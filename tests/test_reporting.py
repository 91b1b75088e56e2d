"""The run report: a committed step's record survives a store that fails to take the progress
mirror (issue 10, item 5: a store glitch after the commit used to fail rank 0's step)."""

from __future__ import annotations

import json

import torch.distributed as dist

from oobleck_elastic.config import load_config
from oobleck_elastic.elastic.reporting import RunReport
from oobleck_elastic.elastic.store import host_store
from oobleck_elastic.planning import build_instantiation
from oobleck_elastic.runtime.plan import GenerationPlan
from oobleck_elastic.runtime.trainer import StepStats
from runtime_harness import templates_for


class GlitchingStore:
    def __init__(self, inner):
        self.inner = inner

    def set_json(self, key, value):
        if key == "progress":
            raise dist.DistStoreError("Socket Timeout")
        self.inner.set_json(key, value)


def test_a_store_error_on_the_progress_mirror_does_not_fail_the_step(tmp_path):
    cfg = load_config(None, [f"monitoring.metrics_path={tmp_path / 'm.jsonl'}",
                             f"monitoring.tensorboard_dir={tmp_path / 'tb'}"])
    ts = templates_for(4, 2)
    plan = GenerationPlan(generation=0, start_step=0, workers_per_node=1, templates=ts,
                          instantiation=build_instantiation([ts.get(1), ts.get(1)], [(0,), (1,)], 32, 4))
    report = RunReport(cfg, GlitchingStore(host_store("127.0.0.1", 0, "glitch")), 4)
    report.step(StepStats(step=0, loss=1.5, samples=32, grad_norm=0.1, seconds=0.2, tokens=64, lr=1e-3), plan)
    report.close()
    (line,) = (tmp_path / "m.jsonl").read_text().splitlines()
    assert json.loads(line)["step"] == 0 and json.loads(line)["tokens_per_s"] == 320.0
