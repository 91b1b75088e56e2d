"""The membership store: where nodes register and generations are recorded.

`MembershipStore` is the small interface the rest of the elastic layer uses; `EmbeddedStore`
(a TCPStore, nothing to install) and `EtcdStore` (elastic/etcd_store.py: membership that
outlives any training node) implement it, and `connect_store` opens either from the URL the
agent hands its workers. Keys live under `oobleck/<run_id>/`; values are JSON (never pickle:
the store is reachable over the network).

Which keys a run uses, and what they hold, is elastic/protocol.py's alone.
"""

from __future__ import annotations

import abc
import errno
import json
import os
import re
import socket
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from oobleck_elastic.errors import ConfigError, OobleckError

__all__ = ["MembershipStore", "EmbeddedStore", "check_run_id", "host_store", "connect_store", "StoreAddressInUse",
           "StoreTimeout", "StoreUnreachable"]

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


def _listen(host: str, port: int) -> int:
    """A socket listening on `host`:`port` exactly (port 0: any free one), as a file descriptor
    for TCPStore to take over. Left to itself, a TCPStore server listens on every interface,
    whatever host it is given (docs/recovery.md, "Trust model")."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise OobleckError(f"cannot host the membership store at {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StoreAddressInUse(f"{host}:{port} is already in use") from exc
        raise OobleckError(f"cannot host the membership store at {host}:{port} ({exc.strerror}): give an "
                           "address of this machine, or let the machine that has it host the store") from exc
    return sock.detach()


class MembershipStore(abc.ABC):
    """Run-scoped JSON key-value store with counters and blocking waits."""

    run_id: str
    host: str
    port: int
    """The server's address (the port it listens on, once it is hosted)."""
    poll_s: float = 0.002
    """Pause between two reads of a key someone else will write: what a request costs the server
    (a local TCPStore answers in microseconds; etcd writes each request through Raft)."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the store is, as `connect_store` takes it: `host:port` or `etcd://host:port`."""

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


class EmbeddedStore(MembershipStore):
    """A TCPStore hosted by the launcher (or the first agent) at the rendezvous endpoint; the
    server listens on that address only."""

    def __init__(self, host: str, port: int, run_id: str, *, is_master: bool = False,
                 timeout: float = 60.0) -> None:
        self.host, self.port, self.run_id, self.is_master = host, port, check_run_id(run_id), is_master
        fd = _listen(host, port) if is_master else None
        try:
            self._tcp = dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                                      timeout=timedelta(seconds=timeout), use_libuv=True, master_listen_fd=fd)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        self.port = self._tcp.port  # the chosen one when the server was asked for port 0
        self._store = dist.PrefixStore(f"oobleck/{run_id}", self._tcp)

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    def set_timeout(self, seconds: float) -> None:
        """Bounds every later request (a vanished host without a TCP reset would block each
        one for the whole store timeout)."""
        self._tcp.set_timeout(timedelta(seconds=seconds))

    def set_json(self, key: str, value: Any) -> None:
        self._store.set(key, json.dumps(value))

    def try_get_json(self, key: str) -> Any | None:
        if not self._store.check([key]):
            return None
        return json.loads(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def create_json(self, key: str, value: Any) -> bool:
        text = json.dumps(value)
        return self._store.compare_set(key, "", text).decode() == text

    def delete(self, key: str) -> None:
        self._store.delete_key(key)

    def torch_store(self) -> dist.Store:
        return self._store

    def keys(self) -> list[str]:
        prefix = f"oobleck/{self.run_id}/"
        return [k[len(prefix):] for k in self._tcp.list_keys() if k.startswith(prefix)]

    def delete_keys(self, keys: Iterable[str]) -> int:
        return sum(bool(self._store.delete_key(k)) for k in keys)


def host_store(host: str, port: int, run_id: str, timeout: float = 60.0) -> EmbeddedStore:
    """Starts the store server (port 0: any free port) and returns a handle to it."""
    return EmbeddedStore(host, port, run_id, is_master=True, timeout=timeout)


def connect_store(url: str, run_id: str, timeout: float = 60.0, outage_timeout: float = 10.0) -> MembershipStore:
    """A client of the store at `url` (`MembershipStore.url`): `etcd://host:port` is etcd's v2
    API (ridden through outages up to `outage_timeout` seconds), `host:port` an embedded store
    someone hosts."""
    if url.startswith("etcd://"):
        from oobleck_elastic.elastic.etcd_store import EtcdAccess, EtcdStore

        address, _, query = url.removeprefix("etcd://").partition("?")
        host, _, port = address.rpartition(":")
        return EtcdStore(host, int(port), run_id, timeout=timeout, outage_timeout=outage_timeout,
                         access=EtcdAccess.from_query(query))
    host, _, port = url.rpartition(":")
    return EmbeddedStore(host, int(port), run_id, timeout=timeout)
