"""The embedded membership store: a TCPStore hosted by the launcher (or the first agent), nothing
to install, gone with the node that hosts it."""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from oobleck_elastic.elastic.stores.base import MembershipStore, StoreAddressInUse, check_run_id
from oobleck_elastic.errors import OobleckError

__all__ = ["EmbeddedStore", "host_store"]


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


