"""Hosts of their own on one machine, for the failures real networks have: each host a Linux
network namespace with its own addresses, joined by two switches, and the faults a machine room
sees (a host losing power, a host stopped, a partition, a host cut off from the store or from
its peers) made from outside the hosts. Needs root (network namespaces); `Bed.check()` says
what is missing.

Note: [test bed]
    A namespace `<name>-sw` holds two bridges: the data network, 198.18.0.0/24, where the
    process groups talk, and the store network, 198.18.1.0/24, where the membership store is
    reached (198.18.0.0/15 is the range set aside for benchmarks: nothing real is ever there).
    Host k is the namespace `<name>-h<k>` with interface `data` at 198.18.0.<10+k> and `store`
    at 198.18.1.<10+k>, each one end of a veth pair whose other end is a port of its switch;
    the store host `<name>-st` has only `store`, at 198.18.1.2. Nothing else is routed, so no
    packet leaves the machine. A fault takes the switch's port of a host down: everything to
    and from the host is dropped, silently, as a dead NIC, cable or switch port does, and no
    reset ever reaches anyone. Power loss is both ports down, then every process of the host
    SIGKILLed (its sockets could send nothing by then). A process runs on a host through
    `ip netns exec`; gloo must be told its interface (GLOO_SOCKET_IFNAME=data, `Bed.env`),
    since every namespace shares the machine's hostname. close() kills what runs on the hosts
    and deletes the namespaces, which deletes their links.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Bed", "BedUnavailable", "Host", "NETWORKS"]

NETWORKS = ("data", "store")
_SUBNET = {"data": "198.18.0", "store": "198.18.1"}
STORE_ADDRESS = "198.18.1.2"
COMMAND_TIMEOUT_S = 30.0


class BedUnavailable(RuntimeError):
    """This machine cannot make the bed (not root, no `ip`, no network namespaces)."""


@dataclass(frozen=True)
class Host:
    name: str
    """Its network namespace."""
    index: int
    """k of host k; -1 for the store host."""
    ports: dict[str, str]
    """Network -> the switch's port (the interface in the switch namespace) of this host."""

    def address(self, network: str) -> str:
        return STORE_ADDRESS if self.index < 0 else f"{_SUBNET[network]}.{10 + self.index}"


class Bed:
    """`hosts` training hosts and one store host (Note: [test bed])."""

    def __init__(self, hosts: int, name: str | None = None) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"a bed has 1 to 200 hosts, got {hosts}")
        self.name = name or f"ob{os.getpid() % 100000}"
        self.switch = f"{self.name}-sw"
        self.hosts = [Host(f"{self.name}-h{k}", k, {n: f"{self.name[:6]}{n[0]}{k}" for n in NETWORKS})
                      for k in range(hosts)]
        self.store = Host(f"{self.name}-st", -1, {"store": f"{self.name[:6]}st"})
        self._made: list[str] = []

    @staticmethod
    def check() -> None:
        """Raises BedUnavailable saying what this machine lacks."""
        if os.geteuid() != 0:
            raise BedUnavailable("the network test bed needs root (network namespaces and veth pairs)")
        if shutil.which("ip") is None:
            raise BedUnavailable("the network test bed needs iproute2's `ip` (Debian: apt-get install iproute2)")

    # --- making and unmaking ----------------------------------------------------------------

    def up(self) -> Bed:
        """Makes the namespaces, switches and links; on an error, unmakes what it made."""
        self.check()
        try:
            self._namespace(self.switch)
            for network in NETWORKS:
                self._ip(self.switch, "link", "add", f"br-{network}", "type", "bridge")
                self._ip(self.switch, "link", "set", f"br-{network}", "up")
            for host in [*self.hosts, self.store]:
                self._namespace(host.name)
                for network, port in host.ports.items():
                    self._link(host, network, port)
        except BaseException:
            self.close()
            raise
        return self

    def _namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        self._ip(name, "link", "set", "lo", "up")

    def _link(self, host: Host, network: str, port: str) -> None:
        inside = f"{port}x"  # its name until it is moved into the host and renamed
        _run("ip", "link", "add", port, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", port, "netns", self.switch)
        _run("ip", "link", "set", inside, "netns", host.name)
        self._ip(self.switch, "link", "set", port, "master", f"br-{network}")
        self._ip(self.switch, "link", "set", port, "up")
        self._ip(host.name, "link", "set", inside, "name", network)
        self._ip(host.name, "addr", "add", f"{host.address(network)}/24", "dev", network)
        self._ip(host.name, "link", "set", network, "up")

    def close(self) -> None:
        """Kills every process on the hosts and deletes the namespaces (and with them the links)."""
        for name in reversed(self._made):
            for pid in _pids(name):
                _signal(pid, signal.SIGKILL)
            _run("ip", "netns", "del", name, check=False)
        self._made = []

    def __enter__(self) -> Bed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- running ----------------------------------------------------------------------------

    @staticmethod
    def env(base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for a process on a host: gloo talks over the data network."""
        return {**(os.environ if base is None else base), "GLOO_SOCKET_IFNAME": "data"}

    def popen(self, host: Host, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts `argv` on `host` (in its own session, so a signal to the test's group misses it)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(["ip", "netns", "exec", host.name, *argv], **kwargs)

    def pids(self, host: Host) -> list[int]:
        return _pids(host.name)

    # --- faults, made from outside the host -------------------------------------------------

    def link(self, host: Host, up: bool, networks: Sequence[str] = NETWORKS) -> None:
        """Takes the switch's ports of `host` on `networks` down (or up again)."""
        for network in networks:
            if network in host.ports:
                self._ip(self.switch, "link", "set", host.ports[network], "up" if up else "down")

    def poweroff(self, host: Host) -> None:
        """The host loses power: its links go down, then every process on it is SIGKILLed."""
        self.link(host, up=False)
        for pid in self.pids(host):
            _signal(pid, signal.SIGKILL)

    def stop(self, host: Host) -> list[int]:
        """Every process on the host stopped (SIGSTOP); the pids, for `cont`."""
        pids = self.pids(host)
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        return pids

    @staticmethod
    def cont(pids: Sequence[int]) -> None:
        for pid in pids:
            _signal(pid, signal.SIGCONT)

    def _ip(self, namespace: str, *args: str) -> None:
        _run("ip", "-n", namespace, *args)


def _run(*argv: str, check: bool = True) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError as exc:
        raise BedUnavailable(f"{argv[0]} is not installed") from exc
    if check and proc.returncode != 0:
        raise BedUnavailable(f"`{' '.join(argv)}` failed: {proc.stderr.strip()[:300]}")
    return proc.stdout


def _pids(namespace: str) -> list[int]:
    out = _run("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
