"""`python -m oobleck_elastic.train --config job.yaml [--set key=value ...]`: trains the job's
model on its data, so no script needs writing.

    python -m oobleck_elastic.launch --oobleck-local-nodes 4 --nproc-per-node 1 \\
        -m oobleck_elastic.train --config job.yaml        # a 4-node job on this machine
    torchrun --rdzv-backend=oobleck ... -m oobleck_elastic.train --config job.yaml
    python -m oobleck_elastic.train --config job.yaml     # alone: the one-process reference

The model comes from `model.hf` (a save_pretrained directory) or `model.factory`; the data from
`data.tokens` (a token file) or the factory. Nothing is downloaded (the hub is offline).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from oobleck_elastic.config import JobConfig, load_config
from oobleck_elastic.errors import ConfigError, exit_status
from oobleck_elastic.runtime.model import ModelSpec

__all__ = ["prepare", "check_resume", "main"]


def prepare(cfg: JobConfig) -> tuple[ModelSpec, Any, Any]:
    """The job's model, dataset and eval dataset (or None), checked against each other (the
    launcher calls this before any node starts, so a mistake is one line here rather than one
    per node log)."""
    from oobleck_elastic.data import TokenFile
    from oobleck_elastic.models import load_model
    from oobleck_elastic.runtime.data import SampleOrder

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model comes from a local directory, never the hub
    spec, data = load_model(cfg)
    if cfg.data.tokens is not None:
        if spec.max_positions is not None and cfg.data.seq_len > spec.max_positions:
            raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) is longer than the model's "
                              f"{spec.max_positions} positions; set data.seq_len <= {spec.max_positions}")
        data = TokenFile.from_config(cfg.data, vocab_size=spec.vocab_size)
        first = SampleOrder(len(data), cfg.train.seed, cfg.data.shuffle).indices(0, cfg.train.global_batch_size)
        data.batch(first)  # the first step's samples: token ids beyond the vocabulary fail here
    if data is None:
        raise ConfigError("the job names no data: set data.tokens to a token file (python -m "
                          "oobleck_elastic.data.prepare writes one), or return a dataset from model.factory")
    held_out = None
    if cfg.data.eval_tokens is not None:
        held_out = TokenFile(cfg.data.eval_tokens, seq_len=cfg.data.seq_len, dtype=cfg.data.token_dtype,
                             vocab_size=spec.vocab_size, key="data.eval_tokens")
        held_out.batch(range(min(len(held_out), cfg.train.global_batch_size)))  # ids beyond the vocabulary
    if cfg.eval.interval and held_out is None:
        raise ConfigError("eval.interval is set but the job has no eval data: set data.eval_tokens to a token file "
                          "(python -m oobleck_elastic.data.prepare writes one)")
    return spec, data, held_out


def check_resume(cfg: JobConfig, spec: ModelSpec, data: Any, held_out: Any = None) -> int | None:
    """The step the job will resume from (checkpoint.resume), or None; a checkpoint that cannot
    be resumed, or a checkpoint.dir holding another job's checkpoints, is one OobleckError
    here, before any node starts, and is left untouched."""
    from oobleck_elastic.runtime.checkpoint import check_dir, checkpoint_id, find_resume

    ident = checkpoint_id("launcher", spec, cfg, len(data))
    found = None
    if cfg.checkpoint.resume != "never":
        found = find_resume(cfg.checkpoint.dir, ident, load_step=cfg.checkpoint.load_step, max_step=cfg.train.steps)
    check_dir(cfg.checkpoint.dir, ident)
    return None if found is None else found[0]


def check_plan(cfg: JobConfig, spec: ModelSpec, nodes: int, workers_per_node: int) -> None:
    """Plans the job for `nodes` nodes as its workers will (the profile is measured here and
    cached where they read it): a model no template fits in memory, or more fault tolerance
    than the nodes allow, is one PlanningError before any node starts."""
    from oobleck_elastic.elastic.job import measure, templates

    templates(measure(spec, cfg), cfg, nodes, workers_per_node)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oobleck_elastic.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="job YAML (every key documented in oobleck_elastic/config/schema.py)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("OOBLECK_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from oobleck_elastic.elastic.worker import run_worker
    from oobleck_elastic.runtime.supported import check_supported


    def train() -> None:
        cfg = load_config(args.config, args.set)
        check_supported(cfg)  # the optimizer and the plan kind, before the model is built
        spec, data, held_out = prepare(cfg)
        run_worker(spec, data, cfg, eval_dataset=held_out)

    return exit_status(train)


if __name__ == "__main__":
    from oobleck_elastic.launcher.process_exit import exit_now

    exit_now(main())
