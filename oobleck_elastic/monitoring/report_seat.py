"""The reporting seat: the worker that is the run's global rank 0 now holds the run's
`RunReport`; on every other worker the seat is empty and its calls do nothing. The seat moves
with rank 0 (rank 0 died, or a joiner ranks first): the worker that leaves it writes what it
held back and closes its sinks, and the worker that takes it picks up the run's earlier steps
from the metrics log and writes the last committed step if its predecessor died before it
could (run_report.py)."""

from __future__ import annotations

from oobleck_elastic.config import JobConfig
from oobleck_elastic.monitoring.run_report import Mirror, PlanRecord, RunReport, StepRecord
from oobleck_elastic.planning import TemplateSet

__all__ = ["ReportSeat"]


class ReportSeat:
    def __init__(self, cfg: JobConfig, mirror: Mirror, num_layers: int, run_id: str) -> None:
        self.cfg, self.mirror, self.num_layers, self.run_id = cfg, mirror, num_layers, run_id
        self.report: RunReport | None = None

    @property
    def held(self) -> bool:
        return self.report is not None

    def sit(self, rank_0: bool, generation: int, last_step: tuple[StepRecord, PlanRecord] | None) -> None:
        """Generation `generation` is built: this worker is its global rank 0 or not.
        `last_step`: the last committed step's statistics and plan, if any."""
        if self.report and not rank_0:
            self.report.flush_recovery()
            self.report.close()
            self.report = None
        if rank_0 and self.report is None:
            self.report = RunReport(self.cfg, self.mirror, self.num_layers, self.run_id)
            if generation > 0:  # a hand-over: the figure keeps the steps before it
                self.report.adopt_history()
            if last_step is not None:  # rank 0 died after a commit, maybe before its line
                self.report.catch_up(*last_step)

    def generation(self, plan: PlanRecord, templates: TemplateSet) -> None:
        if self.report:
            self.report.generation(plan, templates)

    def resumed(self, first: dict, directory: str) -> None:
        if self.report:
            self.report.resumed(first, directory)

    def step(self, stats: StepRecord, plan: PlanRecord) -> None:
        if self.report:
            self.report.step(stats, plan)

    def evaluation(self, step: int, loss: float, tokens: int, *, perplexity: bool, seconds: float) -> None:
        if self.report:
            self.report.evaluation(step, loss, tokens, perplexity=perplexity, seconds=seconds)

    def recovery(self, **change) -> None:
        """RunReport.recovery's arguments."""
        if self.report:
            self.report.recovery(**change)

    def flush_recovery(self) -> None:
        if self.report:
            self.report.flush_recovery()

    def stopped(self, steps: int, directory: str) -> None:
        assert self.report is not None, "rank 0 reports the end"
        self.report.stopped(steps, directory)

    def final(self, steps: int, sums: list[float], norms: list[float]) -> None:
        assert self.report is not None, "rank 0 reports the end"
        self.report.final(steps, sums, norms)

    def draw_throughput(self, steps: int) -> None:
        if self.report:
            self.report.draw_throughput(steps)

    def close(self) -> None:
        if self.report:
            self.report.close()
            self.report = None
