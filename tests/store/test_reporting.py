"""The run report: a committed step's record survives a store that fails to take the progress
mirror (a store glitch after the commit used to fail rank 0's step); the
launcher's mirror of progress, recoveries and the end; a new reporter's history (the metrics
log alone: tests/unit/test_reporting_unit.py)."""

from __future__ import annotations

import io
import json

import torch.distributed as dist
from matplotlib.image import imread
from runtime_harness import templates_for
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oobleck_elastic.config import load_config
from oobleck_elastic.elastic.protocol import LauncherSide, WorkerSide
from oobleck_elastic.elastic.stores import host_store
from oobleck_elastic.monitoring.metrics import read_records
from oobleck_elastic.monitoring.run_report import RunReport
from oobleck_elastic.planning import build_instantiation
from oobleck_elastic.runtime.plan import GenerationPlan
from oobleck_elastic.runtime.trainer import StepStats


class GlitchingMirror(WorkerSide):
    def publish_progress(self, record):
        raise dist.DistStoreError("Socket Timeout")


def test_a_store_error_on_the_progress_mirror_does_not_fail_the_step(tmp_path):
    cfg = load_config(None, [f"monitoring.metrics_path={tmp_path / 'm.jsonl'}",
                             f"monitoring.tensorboard_dir={tmp_path / 'tb'}"])
    ts = templates_for(4, 2)
    plan = GenerationPlan(generation=0, start_step=0, workers_per_node=1, templates=ts,
                          instantiation=build_instantiation([ts.get(1), ts.get(1)], [(0,), (1,)], 32, 4))
    report = RunReport(cfg, GlitchingMirror(host_store("127.0.0.1", 0, "glitch")), 4)
    report.step(StepStats(step=0, loss=1.5, samples=32, grad_norm=0.1, seconds=0.2, tokens=64, lr=1e-3), plan)
    report.close()
    (line,) = (tmp_path / "m.jsonl").read_text().splitlines()
    assert json.loads(line)["step"] == 0 and json.loads(line)["tokens_per_s"] == 320.0


def test_the_report_mirrors_progress_recoveries_and_the_end_for_the_launcher(tmp_path):
    cfg = load_config(None, [f"monitoring.metrics_path={tmp_path / 'm.jsonl'}",
                             f"monitoring.tensorboard_dir={tmp_path / 'tb'}", "train.steps=2"])
    ts = templates_for(4, 2)
    plan = GenerationPlan(generation=1, start_step=1, workers_per_node=1, templates=ts,
                          instantiation=build_instantiation([ts.get(1), ts.get(1)], [(0,), (1,)], 32, 4))
    mirror = WorkerSide(host_store("127.0.0.1", 0, "mirror"))
    launcher = LauncherSide(mirror.store)  # what the launcher reads
    report = RunReport(cfg, mirror, 4)
    report.recovery(plan=plan, record={"cause": "lost"}, first_generation=0, before={0, 1, 2}, transfers=[],
                    phases={"build": 0.1}, total_s=0.3, failed_at=None, first_failure=None)
    stats = StepStats(step=1, loss=1.0, samples=32, grad_norm=0.1, seconds=0.5, tokens=64, lr=1e-3)
    report.catch_up(stats, plan)  # nothing published yet: the new reporter writes the step
    report.catch_up(stats, plan)  # published: not twice
    report.final(2, [0.0], [1.0])
    report.close()
    assert launcher.progress()["step"] == 1 and launcher.progress()["samples_per_s"] == 64.0
    assert launcher.recovery(1)["lost"] == [2] and launcher.recovery(1)["phases_s"]["replay"] == 0.5
    assert launcher.done() == {"steps": 2}
    events = [json.loads(line).get("event", "step") for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert events == ["recovery", "step", "final"]


def test_a_new_reporter_keeps_the_runs_earlier_steps_for_its_throughput_figure(tmp_path):
    """Rank 0 dies at step 3 and another worker reports on: its throughput figure covers steps
    0-3 of this run and the recovery, not just the steps since the hand-over, and leaves out
    another run's records in the same log."""
    cfg = load_config(None, [f"monitoring.metrics_path={tmp_path / 'm.jsonl'}",
                             f"monitoring.tensorboard_dir={tmp_path / 'tb'}", "train.steps=5"])
    ts = templates_for(4, 2)

    def plan(generation, start):
        return GenerationPlan(generation=generation, start_step=start, workers_per_node=1, templates=ts,
                              instantiation=build_instantiation([ts.get(1), ts.get(1)], [(0,), (1,)], 32, 4))

    def stats(step, seconds):
        return StepStats(step=step, loss=1.0, samples=32, grad_norm=0.1, seconds=seconds, tokens=64, lr=None)

    mirror = WorkerSide(host_store("127.0.0.1", 0, "handover"))
    earlier = RunReport(cfg, mirror, 4, "old")  # an earlier job that logged to the same path
    earlier.generation(plan(0, 0), ts)
    earlier.step(stats(0, 4.0), plan(0, 0))
    earlier.close()
    first = RunReport(cfg, mirror, 4, "run")
    first.generation(plan(0, 0), ts)
    for step in range(3):
        first.step(stats(step, 0.5), plan(0, 0))
    first.recovery(plan=plan(1, 2), record={"cause": "lost"}, first_generation=0, before={0, 1, 2}, transfers=[],
                   phases={}, total_s=0.3, failed_at=None, first_failure=None)
    first.step(stats(2, 0.25), plan(1, 2))  # the replayed step
    first.close()  # rank 0 dies

    stranger = RunReport(cfg, mirror, 4, "another")
    stranger.adopt_history()
    assert stranger.throughput == {} and stranger.changes == []
    stranger.close()
    second = RunReport(cfg, mirror, 4, "run")
    second.adopt_history()
    second.generation(plan(2, 3), ts)
    second.step(stats(3, 0.5), plan(2, 3))
    second.final(4, [0.0], [1.0])
    second.draw_throughput(4)
    second.close()
    assert second.throughput == {0: 64.0, 1: 64.0, 2: 128.0, 3: 64.0}
    assert second.changes == [(2, "lost [2]")]
    assert (tmp_path / "tb/throughput.png").read_bytes().startswith(b"\x89PNG")
    # each figure drawn once: the PNG next to the logs and TensorBoard's image are the same picture
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    for tag, png in (("throughput", "throughput.png"), ("layout/generation_2", "layout_generation_2.png")):
        logged = events.Images(tag)[-1]
        saved = imread(str(tmp_path / "tb" / png))
        assert saved.shape == (logged.height, logged.width, 4), (tag, saved.shape)
        assert (imread(io.BytesIO(logged.encoded_image_string))[..., :3] == saved[..., :3]).all(), tag
    generations = [r for r in read_records(str(tmp_path / "m.jsonl")) if r.get("event") == "generation"]
    assert [r["run"] for r in generations] == ["old", "run", "run"]
