"""A real etcd server for tests: started on free ports in a temporary directory with the v2 API
on, stopped (and its data removed) when the `with` block ends."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import ssl
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


def make_tls(directory: str) -> dict[str, str]:
    """A throwaway CA, and a server and a client certificate it signed for 127.0.0.1 (openssl)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=oobleck-test-ca")
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        with open(os.path.join(directory, f"{name}.ext"), "w") as f:
            f.write(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    return {k: os.path.join(directory, f) for k, f in (("ca", "ca.crt"), ("server_cert", "server.crt"),
            ("server_key", "server.key"), ("client_cert", "client.crt"), ("client_key", "client.key"))}


class EtcdServer:
    """One etcd member on free local ports with its data in a temporary directory; it can be
    stopped and started again with the same data (a restart under a running job). With `tls`
    (make_tls's files) it serves https only and asks clients for certificates."""

    def __init__(self, v2: bool = True, tls: dict[str, str] | None = None) -> None:
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("these tests need etcd (Debian: apt-get install etcd-server); ./launch/test installs it")
        self.v2, self.tls = v2, tls
        self.port, self.peer = _free_ports(2)
        self.data = tempfile.mkdtemp(prefix="oobleck-etcd-")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        scheme = "https" if self.tls else "http"
        client, peer = f"{scheme}://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer}"
        tls = [] if not self.tls else ["--cert-file", self.tls["server_cert"], "--key-file", self.tls["server_key"],
                                       "--trusted-ca-file", self.tls["ca"], "--client-cert-auth"]
        self.proc = subprocess.Popen(
            [self.binary, f"--enable-v2={str(self.v2).lower()}", "--name", "test", "--data-dir", self.data,
             "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"test={peer}", *tls],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=self.tls["ca"])
            context.load_cert_chain(self.tls["client_cert"], self.tls["client_key"])
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{client}/version", timeout=1, context=context):
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


def enable_auth(port: int, password: str) -> None:
    """Turns on etcd's v2 auth with a `root` user and takes every right from the guest role, so
    a request without the right user and password is refused."""
    def request(method: str, path: str, body: dict | None = None, auth: bool = False) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/auth/{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
        if auth:
            req.add_header("Authorization", "Basic " + base64.b64encode(f"root:{password}".encode()).decode())
        with urllib.request.urlopen(req, timeout=10):
            pass

    request("PUT", "users/root", {"user": "root", "password": password})
    request("PUT", "enable")
    request("PUT", "roles/guest", {"role": "guest", "revoke": {"kv": {"read": ["/*"], "write": ["/*"]}}}, auth=True)


@contextmanager
def etcd_server(timeout: float = 30.0, v2: bool = True):
    """Yields the client port of a fresh etcd server on 127.0.0.1 (`v2=False`: without the v2
    API, the usual mistake)."""
    with etcd_process(timeout, v2) as server:
        yield server.port


@contextmanager
def etcd_process(timeout: float = 30.0, v2: bool = True, tls: dict[str, str] | None = None):
    """Yields a started EtcdServer, removed (process and data) when the block ends."""
    server = EtcdServer(v2, tls)
    try:
        server.start(timeout)
        yield server
    finally:
        server.remove()
