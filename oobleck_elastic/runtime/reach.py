"""Whether this worker can reach its peers on the data network: a responder each worker keeps
on the address its process groups use, and a probe that tries a TCP handshake with each
peer's responder (Note: [gray failures] in elastic/reachability.py says what decides on it).

The handshake is completed by the peer's kernel, so a loaded peer answers as fast as an idle
one; what fails it is the network: no route, no answer to ARP, a link down on either side.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TypeVar

import psutil

__all__ = ["PROBE_TIMEOUT_S", "Responder", "data_address", "unreachable"]

logger = logging.getLogger(__name__)

K = TypeVar("K")

PROBE_TIMEOUT_S = 2.0
"""How long a handshake may take before its peer counts as unreachable: a live data network
answers in milliseconds, and a peer found unreachable may be left out of the run."""


def data_address() -> str:
    """The IPv4 address this host's gloo groups use: that of the first interface named in
    GLOO_SOCKET_IFNAME, else the host name's address where it can be bound, else loopback (the
    order torch's gloo backend picks its device in)."""
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        for addr in psutil.net_if_addrs().get(names[0], ()):
            if addr.family == socket.AF_INET:
                return str(addr.address)
    try:
        host = socket.gethostbyname(socket.gethostname())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
        return host
    except OSError:
        return "127.0.0.1"


class Responder:
    """A listening socket on `host` that completes handshakes and closes them: a peer's probe
    of this worker. One thread; `close()` ends it."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.endpoint: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="oobleck-reach-responder", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(1.0)
        self._sock.close()


def unreachable(endpoints: Mapping[K, Iterable[tuple[str, int]]], timeout: float = PROBE_TIMEOUT_S) -> set[K]:
    """The keys of `endpoints` none of whose endpoints completed a handshake within `timeout`
    seconds (all tried at once); a key without endpoints counts as unreachable."""
    pending: dict[socket.socket, K] = {}
    reached: set[K] = set()
    try:
        for who, where in endpoints.items():
            for host, port in where:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                code = sock.connect_ex((host, port))
                if code == 0:
                    reached.add(who)
                    sock.close()
                elif code in (errno.EINPROGRESS, errno.EAGAIN):
                    pending[sock] = who
                else:  # refused, no route: decided at once
                    sock.close()
        deadline = time.monotonic() + timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            _, writable, _ = select.select([], list(pending), [], left)
            for sock in writable:
                who = pending.pop(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    reached.add(who)
                sock.close()
    finally:
        for sock in pending:
            sock.close()
    out = set(endpoints) - reached
    if out:
        logger.debug("unreachable on the data network: %s", sorted(map(str, out)))
    return out
