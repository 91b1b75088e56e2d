"""Log lines that say who speaks (torchft's style): a worker's `[run | gen g | node n | rank r]`,
an agent's `[run | node n]`, so one node's log reads alone. Entry points configure logging;
modules log through these adapters."""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping

__all__ = ["Prefixed", "agent_prefix", "worker_prefix"]


class Prefixed(logging.LoggerAdapter):
    """`logger` with `[prefix()]` before every message (the prefix is read when a line is
    written: a worker's generation changes)."""

    def __init__(self, logger: logging.Logger, prefix: Callable[[], str]) -> None:
        super().__init__(logger, {})
        self.prefix = prefix

    def process(self, msg: object, kwargs: MutableMapping) -> tuple[str, MutableMapping]:
        return f"[{self.prefix()}] {msg}", kwargs


def worker_prefix(run_id: str, generation: int | None, node: int, local_rank: int) -> str:
    return f"{run_id} | gen {'-' if generation is None else generation} | node {node} | rank {local_rank}"


def agent_prefix(run_id: str, node: int | None) -> str:
    return f"{run_id} | node {'-' if node is None else node}"
