"""Train the GPT example.

    python -m oobleck_elastic.launch --oobleck-local-nodes 4 --nproc-per-node 1 \\
        examples/gpt/train.py --config examples/gpt/config.yaml
    python examples/gpt/train.py --set train.precision=fp64    # alone: the single-process reference
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.gpt.data import SyntheticTokens  # noqa: E402
from examples.gpt.model import gpt_model, parse_gpt_config  # noqa: E402
from oobleck_elastic.config import load_config  # noqa: E402
from oobleck_elastic.elastic.worker import run_worker  # noqa: E402
from oobleck_elastic.errors import exit_status  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train the GPT example.")
    p.add_argument("--config", default=os.path.join(HERE, "config.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("OOBLECK_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def train() -> None:
        cfg = load_config(args.config, args.set)
        gpt = parse_gpt_config(cfg.model)
        held_out = SyntheticTokens(gpt, seed=cfg.train.seed, held_out=True)  # for eval.interval
        run_worker(gpt_model(gpt), SyntheticTokens(gpt, seed=cfg.train.seed), cfg, eval_dataset=held_out)

    return exit_status(train)


if __name__ == "__main__":
    sys.exit(main())
