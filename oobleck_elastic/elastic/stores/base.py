"""The membership store's interface: where nodes register and generations are recorded.

`MembershipStore` is the small interface the rest of the elastic layer uses, with the errors its
calls raise and the rule for run ids. Keys live under `oobleck/<run_id>/`; values are JSON (never
pickle: the store is reachable over the network). Which keys a run uses, and what they hold, is
elastic/protocol/keys.py's alone.
"""

from __future__ import annotations

import abc
import re
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from oobleck_elastic.errors import ConfigError, OobleckError

__all__ = ["MembershipStore", "check_run_id", "StoreAddressInUse", "StoreTimeout", "StoreUnreachable"]

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_id(run_id: str) -> str:
    """`run_id` if it can scope a run's keys: letters, digits, '.', '_' and '-'. A '/' would
    let one run's keys be another's (`a/gen4/...` is run `a`'s generation 4)."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(f"--rdzv-id {run_id!r} is not a valid run id: use 1 to 128 letters, digits, '.', '_' "
                          "or '-', starting with a letter or digit")
    return run_id


class StoreTimeout(OobleckError):
    """A store wait ran past its timeout."""


class StoreUnreachable(OobleckError):
    """The store's server does not answer."""


class StoreAddressInUse(OobleckError):
    """Another process already listens on the address the store was to be hosted at."""


class MembershipStore(abc.ABC):
    """Run-scoped JSON key-value store with counters and blocking waits."""

    run_id: str
    host: str
    port: int
    """The server's address (the port it listens on, once it is hosted)."""
    poll_s: float = 0.002
    """Pause between two reads of a key someone else will write: what a request costs the server
    (a local TCPStore answers in microseconds; etcd writes each request through Raft)."""
    poll_max_s: float = 0.01
    """The longest pause a wait grows to (protocol/waits.py wait_until): a decision that comes
    later than a few polls is seen at most this late."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the store is, as `stores.connect_store` takes it: `host:port` or `etcd://host:port`."""

    @abc.abstractmethod
    def set_json(self, key: str, value: Any) -> None: ...

    def get_json(self, key: str, timeout: float) -> Any:
        """Waits up to `timeout` seconds for `key`."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.try_get_json(key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise StoreTimeout(f"waited {timeout:.0f} s for store key '{key}' at {self.url}")
            time.sleep(0.02)

    @abc.abstractmethod
    def try_get_json(self, key: str) -> Any | None: ...

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int: ...

    @abc.abstractmethod
    def create_json(self, key: str, value: Any) -> bool:
        """Sets `key` only if it does not exist (compare-and-set); True if this call set it."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Removes `key` if it exists."""

    @abc.abstractmethod
    def torch_store(self) -> dist.Store:
        """A torch Store for process groups (each generation prefixes it)."""

    @abc.abstractmethod
    def keys(self) -> list[str]:
        """Every key of this run, ours and those torch wrote through `torch_store` (process
        group bootstrap under `gen<g>/`, an agent's bookkeeping under `agent<n>/`)."""

    @abc.abstractmethod
    def delete_keys(self, keys: Iterable[str]) -> int:
        """Removes these keys (names as `keys` gives them) where they exist; how many it did."""
