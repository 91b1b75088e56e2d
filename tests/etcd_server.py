"""A real etcd server for tests: started on free ports in a temporary directory with the v2 API
on, stopped (and its data removed) when the `with` block ends."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class EtcdServer:
    """One etcd member on free local ports with its data in a temporary directory; it can be
    stopped and started again with the same data (a restart under a running job)."""

    def __init__(self, v2: bool = True) -> None:
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("these tests need etcd (Debian: apt-get install etcd-server); ./launch/test installs it")
        self.v2 = v2
        self.port, self.peer = _free_ports(2)
        self.data = tempfile.mkdtemp(prefix="oobleck-etcd-")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer}"
        self.proc = subprocess.Popen(
            [self.binary, f"--enable-v2={str(self.v2).lower()}", "--name", "test", "--data-dir", self.data,
             "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"test={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{client}/version", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start (exit code {self.proc.poll()})") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """Kills the server (its data stays)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)


@contextmanager
def etcd_server(timeout: float = 30.0, v2: bool = True):
    """Yields the client port of a fresh etcd server on 127.0.0.1 (`v2=False`: without the v2
    API, the usual mistake)."""
    with etcd_process(timeout, v2) as server:
        yield server.port


@contextmanager
def etcd_process(timeout: float = 30.0, v2: bool = True):
    """Yields a started EtcdServer, removed (process and data) when the block ends."""
    server = EtcdServer(v2)
    try:
        server.start(timeout)
        yield server
    finally:
        server.remove()
