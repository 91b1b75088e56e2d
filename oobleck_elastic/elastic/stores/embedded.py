"""The embedded membership store: a TCPStore hosted by the launcher (or the first agent), nothing
to install, gone with the node that hosts it."""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from oobleck_elastic.elastic.stores.base import MembershipStore, StoreAddressInUse, StoreUnreachable, check_run_id
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.connections import SocketSet, open_sockets

__all__ = ["EmbeddedStore", "host_store"]

T = TypeVar("T")
_BROKEN = ("Connection timed out", "Broken pipe", "Connection reset by peer")
"""What torch's error says when the network broke a store connection: it stays broken."""


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
                 timeout: float = 60.0, lost_after: float | None = None) -> None:
        self.host, self.port, self.run_id, self.is_master = host, port, check_run_id(run_id), is_master
        fd = _listen(host, port) if is_master else None
        before = open_sockets()
        try:
            self._tcp = dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                                      timeout=timedelta(seconds=timeout), use_libuv=True, master_listen_fd=fd)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        self.port = self._tcp.port  # the chosen one when the server was asked for port 0
        if lost_after is not None and not is_master:
            _give_up_after(SocketSet.opened_since(before).to(host, self.port), lost_after)
        self._store = dist.PrefixStore(f"oobleck/{run_id}", self._tcp)
        self._lost: str | None = None  # why the connection broke for good

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    def set_timeout(self, seconds: float) -> None:
        """Bounds every later request (a vanished host without a TCP reset would block each
        one for the whole store timeout)."""
        self._tcp.set_timeout(timedelta(seconds=seconds))

    def _call(self, op: Callable[..., T], *args: Any) -> T:
        """`op(*args)` on the connection, which a TCPStore client never opens again once the
        network has broken it (Note: [a store host that vanishes]): from then on every request
        fails at once, saying why, instead of trying the dead connection again (each try had
        torch print a C++ stack)."""
        if self._lost is not None:
            raise StoreUnreachable(f"the membership store at {self.url} is unreachable ({self._lost})")
        try:
            return op(*args)
        except (RuntimeError, OSError) as exc:  # torch's DistStoreError and DistNetworkError are RuntimeErrors
            lost = next((why for why in _BROKEN if why in str(exc)), None)
            if lost is None:
                raise
            self._lost = lost
            raise StoreUnreachable(f"the membership store at {self.url} is unreachable ({lost})") from exc

    def set_json(self, key: str, value: Any) -> None:
        self._call(self._store.set, key, json.dumps(value))

    def try_get_json(self, key: str) -> Any | None:
        if not self._call(self._store.check, [key]):
            return None
        return json.loads(self._call(self._store.get, key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self._store.add, key, amount))

    def create_json(self, key: str, value: Any) -> bool:
        text = json.dumps(value)
        return self._call(self._store.compare_set, key, "", text).decode() == text

    def delete(self, key: str) -> None:
        self._call(self._store.delete_key, key)

    def torch_store(self) -> dist.Store:
        return self._store

    def keys(self) -> list[str]:
        prefix = f"oobleck/{self.run_id}/"
        return [k[len(prefix):] for k in self._tcp.list_keys() if k.startswith(prefix)]

    def delete_keys(self, keys: Iterable[str]) -> int:
        return sum(bool(self._store.delete_key(k)) for k in keys)


def _give_up_after(sockets: SocketSet, seconds: float) -> None:
    """Note: [a store host that vanishes]
        A client's requests to a store whose host lost power, or was cut off, get no reset:
        the kernel retransmits them for about 16 minutes before it gives the connection up,
        and a TCPStore request waits on it that long (every node of the job stood still, not
        a line said). So each client connection gives up once data it sent has gone
        unacknowledged for `seconds` (TCP_USER_TIMEOUT), and an idle one is probed every
        second once idle for a second (TCP keepalive), which TCP_USER_TIMEOUT also bounds: the
        next request then fails at once and the process says the store is unreachable. Workers
        and agents give up after half of elastic.lease_timeout_s, so a worker blocked in a
        collective with the store's host (its connection idle meanwhile) finds the store gone
        when its step fails and says so within the lease timeout (measured: 11 s after the host
        lost power, the collective timeout being 10 s). A live store host acknowledges within
        milliseconds however loaded it is (the kernel does), so only a host that is gone trips
        it. Linux only; elsewhere the bound stays the kernel's."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", max(1, int(seconds))),
                        ("TCP_USER_TIMEOUT", int(seconds * 1000))):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    sockets.setsockopts(options)


def host_store(host: str, port: int, run_id: str, timeout: float = 60.0) -> EmbeddedStore:
    """Starts the store server (port 0: any free port) and returns a handle to it."""
    return EmbeddedStore(host, port, run_id, is_master=True, timeout=timeout)


