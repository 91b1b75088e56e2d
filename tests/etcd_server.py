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


@contextmanager
def etcd_server(timeout: float = 30.0, v2: bool = True):
    """Yields the client port of a fresh etcd server on 127.0.0.1 (`v2=False`: without the v2
    API, the usual mistake)."""
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("these tests need etcd (Debian: apt-get install etcd-server); ./launch/test installs it")
    client, peer = _free_ports(2)
    data = tempfile.mkdtemp(prefix="oobleck-etcd-")
    proc = subprocess.Popen(
        [binary, f"--enable-v2={str(v2).lower()}", "--name", "test", "--data-dir", data,
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"test=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{client}/version", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start (exit code {proc.poll()})") from None
                time.sleep(0.1)
        yield client
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)
