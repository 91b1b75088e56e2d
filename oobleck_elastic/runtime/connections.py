"""The TCP connections a generation's process groups opened, and how to cut them from another
thread so that every operation pending on them ends at once.

Note: [cutting a generation's connections]
    A peer that vanishes without a reset (a machine that loses power, a node stopped, a
    partition) leaves a gloo `recv` waiting on it until the group's timeout: in torch 2.13
    neither `ProcessGroupGloo.abort()` nor `shutdown()` ends a pending operation (seen with a
    SIGSTOPped peer: the recv returned only at its timeout). `shutdown(2)` on this process's own
    sockets does: gloo's loop sees the connection end and the operation raises within
    milliseconds, and the peers at the other end of each connection see it end too, so the
    error spreads through the generation as a SIGKILLed peer's reset does. The sockets are told
    apart by when they were opened: the connections that appeared while the generation made
    its groups (gloo connects the full mesh of every group at creation), less any whose far end
    is the membership store (an etcd client may open a connection meanwhile); never a listener
    (gloo's accept loop aborts the process when its listener is shut down). Each is identified by
    its inode as well as its descriptor, and cut through a duplicate of the descriptor whose
    inode is checked first, so a descriptor closed and reused since is never touched. Cutting is
    for a generation that is over: it is torn down right after (runtime/generation.py). Linux
    only (it reads /proc/self/fd); elsewhere nothing is cut and the collective timeout stays
    the bound.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["SocketSet", "open_sockets"]

logger = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def open_sockets() -> frozenset[tuple[int, int]]:
    """(descriptor, inode) of every socket this process has open (empty where /proc is not)."""
    out = set()
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return frozenset()
    for name in fds:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out.add((int(name), int(target[len("socket:["):-1])))
    return frozenset(out)


@dataclass(frozen=True)
class SocketSet:
    """Sockets opened between two snapshots (Note: [cutting a generation's connections])."""

    sockets: frozenset[tuple[int, int]]
    """(descriptor, inode) of each."""

    @classmethod
    def opened_since(cls, before: frozenset[tuple[int, int]], spare: Iterable[tuple[str, int]] = ()) -> SocketSet:
        """The connected TCP sockets opened since `before` was taken, less those connected to an
        address in `spare` ((host, port): the membership store's). Listeners are left alone:
        gloo's accept loop ends the process when its listener is shut down."""
        spared = {(_resolve(host), port) for host, port in spare}
        kept = set()
        for fd, inode in open_sockets() - before:
            peer = _peer(fd, inode)
            if isinstance(peer, tuple) and (peer[0], peer[1]) not in spared:
                kept.add((fd, inode))
        return cls(frozenset(kept))

    def to(self, host: str, port: int) -> SocketSet:
        """Those of the set connected to `host`:`port`."""
        address = (_resolve(host), port)
        return SocketSet(frozenset(s for s in self.sockets if isinstance(p := _peer(*s), tuple)
                                   and (str(p[0]).removeprefix("::ffff:"), p[1]) == address))

    def setsockopts(self, options: Iterable[tuple[int, int, int]]) -> None:
        """Sets each (level, option, value) on each socket of the set still open."""
        options = list(options)
        for fd, inode in self.sockets:
            try:
                dup = os.dup(fd)
            except OSError:
                continue
            try:
                if os.fstat(dup).st_ino != inode:
                    continue
                with socket.socket(fileno=dup) as sock:
                    dup = -1
                    for level, option, value in options:
                        sock.setsockopt(level, option, value)
            finally:
                if dup >= 0:
                    os.close(dup)

    def cut(self) -> int:
        """Shuts down each socket of the set that is still open (both directions); how many.
        Safe from any thread; a socket already closed, or its descriptor reused, is skipped."""
        cut = 0
        for fd, inode in self.sockets:
            try:
                dup = os.dup(fd)
            except OSError:  # closed since
                continue
            try:
                if os.fstat(dup).st_ino != inode:  # the descriptor now names something else
                    continue
                with socket.socket(fileno=dup) as sock:
                    dup = -1  # the socket object owns and closes the duplicate
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                        cut += 1
                    except OSError:  # already shut by the peer
                        pass
            finally:
                if dup >= 0:
                    os.close(dup)
        return cut


_NOT_TCP = object()


def _peer(fd: int, inode: int) -> tuple | object:
    """The far end of a connected TCP socket; _NOT_TCP for a listener, any other kind of socket
    (a Unix socket) or a descriptor that changed."""
    try:
        dup = os.dup(fd)
    except OSError:
        return _NOT_TCP
    try:
        if os.fstat(dup).st_ino != inode:
            return _NOT_TCP
        with socket.socket(fileno=dup) as sock:
            dup = -1
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                return _NOT_TCP
            try:
                return sock.getpeername()
            except OSError:  # not connected: a listener
                return _NOT_TCP
    finally:
        if dup >= 0:
            os.close(dup)


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host
