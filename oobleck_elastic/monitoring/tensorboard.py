"""TensorBoard sink: scalars per step, the plan as text per generation, and figures the
reporter draws (the layout of each generation, throughput over the run)."""

from __future__ import annotations

import os
from typing import Any

from oobleck_elastic.monitoring.metrics import MetricsSink

__all__ = ["TensorBoardSink"]

_SCALARS = {"loss": "train/loss", "samples_per_s": "train/samples_per_s", "step_time_s": "train/step_time_s",
            "grad_norm": "train/grad_norm", "nodes": "cluster/nodes", "num_pipelines": "cluster/pipelines",
            "lr": "train/lr", "tokens_per_s": "train/tokens_per_s"}


class TensorBoardSink(MetricsSink):
    def __init__(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self.writer = SummaryWriter(logdir)

    def write(self, record: dict[str, Any]) -> None:
        if "step" in record and "event" not in record:
            for key, tag in _SCALARS.items():
                if record.get(key) is not None:  # lr is None when the optimizer keeps its default
                    self.writer.add_scalar(tag, record[key], record["step"])
        elif record.get("event") == "eval":
            self.writer.add_scalar("eval/loss", record["loss"], record["step"])
            if "perplexity" in record:
                self.writer.add_scalar("eval/perplexity", record["perplexity"], record["step"])
        elif record.get("event") == "recovery":
            step = record["step"]
            self.writer.add_scalar("recovery/total_s", record["total_s"], step)
            self.writer.add_scalar("recovery/bytes_moved", record["bytes_moved"], step)
            self.writer.add_scalar("recovery/nodes_lost", len(record["lost"]), step)
            self.writer.add_scalar("recovery/nodes_joined", len(record["joined"]), step)
            for phase, seconds in record["phases_s"].items():
                self.writer.add_scalar(f"recovery/{phase}_s", seconds, step)
            lines = [f"generation {record['generation']} at step {step}: lost {record['lost']}, joined "
                     f"{record['joined']}, {record['total_s']:.2f} s, {record['bytes_moved']} bytes moved",
                     f"cause: {record['cause']}", *record["actions"]]
            self.writer.add_text("recoveries", "\n\n".join(lines), step)
        elif record.get("event") == "generation":
            step = record.get("start_step", 0)
            self.writer.add_text("plan", "    " + record["table"].replace("\n", "\n    "), step)

    def image(self, tag: str, pixels, step: int) -> None:
        """A rendered figure (monitoring/layout.py `render`: height x width x RGBA) under `tag`."""
        self.writer.add_image(tag, pixels[..., :3], step, dataformats="HWC")

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
