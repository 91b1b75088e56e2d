"""What a run reports: generation, step, recovery and final records, written by the worker
that is global rank 0 to the metrics log and TensorBoard, and mirrored for the launcher
(progress, recoveries, a resume, the end) through the `Mirror` it is given: the run's protocol
on its membership store, which this layer does not import (elastic sits above monitoring).

A recovery record waits for the first step of the new generation (the replayed one) so that
it can carry that step's time; `flush_recovery()` writes it without when no step follows.

A worker that becomes the reporter mid-run (rank 0 died, or a joiner ranks first) takes the
run's earlier steps and changes from the metrics log where it can read the same file
(`adopt_history`), so the final throughput figure covers the whole run, not the steps since
the hand-over. Generation records carry the run id, and only records from this run's
generation 0 on are taken: the same path may hold another run's records (an earlier job, or
the run a resumed job continues, which has its own figure).

The runtime's step statistics and generation plan arrive duck-typed (`StepRecord`,
`PlanRecord`): monitoring reads a few of their fields and imports nothing above planning.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Protocol

from oobleck_elastic.config import JobConfig
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.monitoring.layout import layout_figure, render, save_png, throughput_figure
from oobleck_elastic.monitoring.metrics import JsonlSink, MultiSink, read_records
from oobleck_elastic.monitoring.tensorboard import TensorBoardSink
from oobleck_elastic.planning import Instantiation, TemplateSet, layer_holders
from oobleck_elastic.planning.report import instantiation_table

__all__ = ["RunReport", "Mirror", "StepRecord", "PlanRecord"]

logger = logging.getLogger(__name__)


class Mirror(Protocol):
    """Where the launcher reads the run's progress (the run's protocol on its membership store)."""

    def publish_progress(self, record: dict) -> None: ...
    def progress(self) -> dict | None: ...
    def publish_recovery(self, record: dict) -> None: ...
    def publish_resumed(self, record: dict) -> None: ...
    def publish_done(self, record: dict) -> None: ...


class StepRecord(Protocol):
    """The fields of a committed step that are reported (runtime.trainer.StepStats)."""

    @property
    def step(self) -> int: ...
    @property
    def loss(self) -> float: ...
    @property
    def samples(self) -> int: ...
    @property
    def grad_norm(self) -> float: ...
    @property
    def seconds(self) -> float: ...
    @property
    def tokens(self) -> int: ...
    @property
    def lr(self) -> float | None: ...


class PlanRecord(Protocol):
    """The fields of a generation's plan that are reported (runtime.plan.GenerationPlan)."""

    @property
    def generation(self) -> int: ...
    @property
    def start_step(self) -> int: ...
    @property
    def instantiation(self) -> Instantiation: ...


class RunReport:
    """The metrics sinks of the reporting worker and its pending recovery record."""

    def __init__(self, cfg: JobConfig, mirror: Mirror, num_layers: int, run_id: str = "") -> None:
        self.cfg, self.mirror, self.num_layers, self.run_id = cfg, mirror, num_layers, run_id
        self.tensorboard = TensorBoardSink(cfg.monitoring.tensorboard_dir)
        self.sink = MultiSink([JsonlSink(cfg.monitoring.metrics_path), self.tensorboard])
        self.throughput: dict[int, float] = {}  # step -> samples/s for the final figure (a step done again: its last)
        self.changes: list[tuple[int, str]] = []  # (step, what changed) for the final figure
        self.pending_recovery: dict | None = None
        self.last_eval: int | None = None

    def generation(self, plan: PlanRecord, templates: TemplateSet) -> None:
        """The plan of a generation, with its layout drawn to a PNG next to the logs."""
        inst = plan.instantiation
        pipe_of = {n: i for i, p in enumerate(inst.pipelines) for n in p.nodes}
        holders = sorted(layer_holders(inst, templates).items(), key=lambda kv: (pipe_of[kv[0].node], kv[1]))
        rows = [(pipe_of[worker.node], worker.node, worker.local_rank, layers) for worker, layers in holders]
        png = os.path.join(self.cfg.monitoring.tensorboard_dir, f"layout_generation_{plan.generation}.png")
        title = f"generation {plan.generation}: {len(inst.pipelines)} pipelines, {len(inst.nodes)} nodes"
        pixels = render(layout_figure(rows, self.num_layers, title))
        save_png(pixels, png)
        self.tensorboard.image(f"layout/generation_{plan.generation}", pixels, plan.start_step)
        self.sink.write({
            "event": "generation", "generation": plan.generation, "start_step": plan.start_step, "run": self.run_id,
            "nodes": list(inst.nodes), "spares": list(inst.spares),
            "pipelines": [{"nodes": list(p.nodes), "microbatches": p.microbatches} for p in inst.pipelines],
            "table": instantiation_table(inst), "layout_png": png})

    def step(self, stats: StepRecord, plan: PlanRecord) -> None:
        self.flush_recovery(replay_s=stats.seconds)
        inst = plan.instantiation
        rec: dict[str, Any] = {
            "step": stats.step, "time": time.time(), "loss": stats.loss, "samples": stats.samples,
            "samples_per_s": stats.samples / stats.seconds if stats.seconds else 0.0,
            "step_time_s": stats.seconds, "grad_norm": stats.grad_norm, "lr": stats.lr,
            "tokens": stats.tokens, "tokens_per_s": stats.tokens / stats.seconds if stats.seconds else 0.0,
            "generation": plan.generation,
            "nodes": len(inst.nodes), "num_pipelines": len(inst.pipelines),
            "pipelines": [p.microbatches for p in inst.pipelines], "total_steps": self.cfg.train.steps}
        self.sink.write(rec)
        self.throughput[stats.step] = rec["samples_per_s"]
        try:  # the launcher's mirror only: a store hiccup here must not fail a committed step
            self.mirror.publish_progress(rec)
        except (OobleckError, RuntimeError) as exc:  # torch's store errors are RuntimeErrors
            logger.warning("could not publish the progress of step %d: %s", stats.step, str(exc).splitlines()[0][:160])

    def adopt_history(self) -> None:
        """The steps and changes the reporters before this one logged in this run (module
        docstring): nothing when the metrics log is not here, or holds no generation 0 of
        this run (another machine's file)."""
        if not self.run_id:
            return
        try:
            records = read_records(self.cfg.monitoring.metrics_path, missing_ok=True)
        except (OSError, ValueError) as exc:  # unreadable: the figure starts at the hand-over, as it did
            logger.warning("the metrics log could not be read for the run's earlier steps: %s", exc)
            return
        starts = [i for i, r in enumerate(records) if r.get("event") == "generation"
                  and r.get("generation") == 0 and r.get("run") == self.run_id]
        if not starts:
            return
        for rec in records[starts[-1]:]:
            if rec.get("event") == "recovery":
                self.changes.append((rec["step"], _change_text(rec)))
            elif "event" not in rec and "step" in rec:
                self.throughput[rec["step"]] = rec["samples_per_s"]

    def catch_up(self, stats: StepRecord, plan: PlanRecord) -> None:
        """A new reporting worker (the last one died) writes the line of the last committed step
        if its predecessor died before it could: every worker holds the step's statistics."""
        published = self.mirror.progress()
        if published is None or published["step"] < stats.step:
            self.step(stats, plan)

    def recovery(self, *, plan: PlanRecord, record: dict, first_generation: int, before: set[int],
                 transfers: list, phases: dict[str, float], total_s: float, failed_at: float | None,
                 first_failure: float | None) -> None:
        """Holds the record of a change from `first_generation` (members `before`) to `plan`.
        `first_failure` is the wall time of the first sign of the lost nodes' failure."""
        after = set(plan.instantiation.nodes)
        if failed_at is not None and first_failure is not None:
            # detection: from the first sign of the failure to this worker's step failing; the
            # total counts from that first sign too
            detect = max(0.0, failed_at - first_failure)
            phases, total_s = {"detect": detect, **phases}, total_s + detect
        self.pending_recovery = {
            "event": "recovery", "generation": plan.generation, "from_generation": first_generation,
            "restored_from": record.get("restored_from"),
            "cause": record["cause"], "lost": sorted(before - after), "joined": sorted(after - before),
            "step": plan.start_step, "actions": record.get("actions", []),
            "bytes_moved": sum(t.bytes for t in transfers), "transfers": len(transfers),
            "copies": [[t.layer, t.src.node, t.dst.node] for t in transfers],
            "phases_s": phases, "total_s": total_s, "failed_at": failed_at}

    def flush_recovery(self, replay_s: float | None = None) -> None:
        rec, self.pending_recovery = self.pending_recovery, None
        if rec is None:
            return
        if replay_s is not None:
            rec["phases_s"]["replay"] = replay_s
        self.sink.write(rec)
        self.changes.append((rec["step"], _change_text(rec)))
        self.mirror.publish_recovery(rec)

    def evaluation(self, step: int, loss: float, tokens: int, *, perplexity: bool, seconds: float) -> None:
        """The eval loss after `step` steps (once, though a failure may make it run again)."""
        if step == self.last_eval:
            return
        self.last_eval = step
        rec = {"event": "eval", "step": step, "loss": loss, "tokens": tokens, "seconds": seconds, "time": time.time()}
        if perplexity:
            rec["perplexity"] = math.exp(min(loss, 700.0))
        self.sink.write(rec)

    def resumed(self, first: dict, directory: str) -> None:
        """Generation 0 continues a stopped job from its checkpoint (the launcher says so)."""
        rec = {"event": "resumed", "step": first["start_step"], "from_run": first["resumed"]["run_id"],
               "checkpoint_dir": directory, "time": time.time()}
        self.sink.write(rec)
        self.mirror.publish_resumed(rec)

    def draw_throughput(self, steps: int) -> None:
        """samples/s over the run with its membership changes, as throughput.png next to the
        logs and in TensorBoard."""
        if not self.throughput:
            return
        steps_done = sorted(self.throughput)
        pixels = render(throughput_figure(steps_done, [self.throughput[s] for s in steps_done], self.changes,
                                          f"throughput over {len(self.throughput)} steps"))
        save_png(pixels, os.path.join(self.cfg.monitoring.tensorboard_dir, "throughput.png"))
        self.tensorboard.image("throughput", pixels, steps)

    def stopped(self, steps: int, directory: str) -> None:
        """The run stopped on request after `steps` steps, with their checkpoint published (the
        throughput figure is drawn after, as for final())."""
        self.flush_recovery()
        self.sink.write({"event": "stopped", "steps": steps, "checkpoint_dir": directory, "time": time.time()})
        self.mirror.publish_done({"steps": steps, "stopped": True, "checkpoint_dir": directory})

    def final(self, steps: int, sums: list[float], norms: list[float]) -> None:
        """The run's end: its final record, then `done` for the launcher (the throughput figure,
        slower, is drawn once every worker knows the end is recorded: draw_throughput)."""
        self.flush_recovery()
        self.sink.write({"event": "final", "steps": steps, "param_sums": sums, "param_norms": norms})
        self.mirror.publish_done({"steps": steps})

    def close(self) -> None:
        self.sink.close()


def _change_text(rec: dict) -> str:
    """How a recovery record is marked on the throughput figure."""
    what = [f"{word} {rec[key]}" for word, key in (("lost", "lost"), ("joined", "joined")) if rec[key]]
    return ", ".join(what) or "replayed"
