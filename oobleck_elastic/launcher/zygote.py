"""The local job's node starter: one process that imports the node agent's modules once (torch
among them, ~2 s of CPU) and forks each node of `--oobleck-local-nodes` from itself, so N local
nodes cost one import, not N. Each node is still a process of its own, in a session of its own
(killed as a unit, as before), with its own environment and log; its workers are started by its
agent as on any machine (exec, not fork).

The launcher talks to it over a socket (one JSON object per line):

    launcher -> zygote   {"module": M, "argv": [...], "env": {...}, "log": PATH or null}
    zygote -> launcher   {"started": PID}                   in the order asked
                         {"exited": PID, "returncode": RC}  RC < 0: killed by signal -RC

It forks nothing before it has imported everything and starts no thread, so a child inherits
no lock held by another thread (Note: [forking after torch]). It exits when the launcher closes
the socket (at the end of the job, once every node has exited, or when the launcher dies).

Note: [forking after torch]
    `import torch` starts no thread and touches no device; the OpenMP pool and CUDA start on
    first use, which happens in the workers (exec'd by the agent), never here. Python's
    `random` state is reseeded in each child so no two nodes draw the same numbers.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback

__all__ = ["ForkedNode", "Zygote", "main"]

START_TIMEOUT_S = 120.0  # the first node waits for the zygote's imports


class ForkedNode:
    """A node the zygote forked: what the launcher uses of a Popen (pid, poll, wait, returncode)."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid, self.returncode, self._zygote = pid, None, zygote

    def poll(self) -> int | None:
        self._zygote.pump()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"node {self.pid}", timeout)
            self._zygote.pump(wait=0.05)
        return self.returncode


_ENTRY = "import sys; from oobleck_elastic.launcher.zygote import main; sys.exit(main())"


class Zygote:
    """The launcher's end: starts the zygote process (its command line names the job, as the
    nodes' did) and forks nodes through it."""

    def __init__(self, env: dict[str, str], run_id: str, module: str) -> None:
        ours, theirs = socket.socketpair()
        self.module = module
        # -c, not -m: the package (imported first by -m) already imports this module, and runpy
        # would warn on every job that it runs a second copy of it as __main__
        self.proc = subprocess.Popen([sys.executable, "-c", _ENTRY, f"--rdzv-id={run_id}", module, str(theirs.fileno())],
                                     env=env, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.channel, self.nodes, self._buffer, self._started = ours, {}, b"", []
        self._selector = selectors.DefaultSelector()
        self._selector.register(ours, selectors.EVENT_READ)
        self._gone = False

    def start(self, argv: list[str], env: dict[str, str], log: str | None) -> ForkedNode:
        """Forks one node running `python -m MODULE ARGV` (MODULE.main(ARGV)) with `env`, its
        output to `log` (None: the launcher's own stdout and stderr)."""
        request = {"module": self.module, "argv": argv, "env": env, "log": log}
        self.channel.sendall((json.dumps(request) + "\n").encode())
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._started:
            if self._gone or time.monotonic() > deadline:
                raise RuntimeError(f"the node starter (pid {self.proc.pid}) did not start a node within "
                                   f"{START_TIMEOUT_S:.0f} s (exit status {self.proc.poll()})")
            self.pump(wait=0.05)
        node = ForkedNode(self._started.pop(0), self)
        self.nodes[node.pid] = node
        return node

    def pump(self, wait: float = 0.0) -> None:
        """Reads what the zygote said: started nodes, exited nodes."""
        while not self._gone and self._selector.select(timeout=wait):
            wait = 0.0
            data = self.channel.recv(65536)
            if not data:  # the zygote died: its nodes were reparented, their status is lost
                self._gone = True
                break
            self._buffer += data
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                message = json.loads(line)
                if "started" in message:
                    self._started.append(message["started"])
                elif message.get("exited") in self.nodes:
                    self.nodes[message["exited"]].returncode = message["returncode"]
        if self._gone:  # a node no longer alive counts as failed
            for node in self.nodes.values():
                if node.returncode is None and not _alive(node.pid):
                    node.returncode = 1

    def close(self) -> None:
        """Ends the zygote (its nodes are not touched)."""
        self._selector.close()
        self.channel.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _child(request: dict, channel: socket.socket) -> None:
    """Becomes the node of `request` and never returns."""
    code = 1
    try:
        channel.close()
        os.setsid()
        if request.get("log"):
            fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()
        sys.argv = [sys.argv[0], *request["argv"]]
        code = importlib.import_module(request["module"]).main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the node's last word goes to its log
        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _reap(channel: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(channel, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _send(channel: socket.socket, message: dict) -> None:
    try:
        channel.sendall((json.dumps(message) + "\n").encode())
    except OSError:  # the launcher is gone: nobody to tell
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # argv: --rdzv-id=RUN (names the job in `ps`), MODULE (the nodes' program), the socket's fd
    channel = socket.socket(fileno=int(argv[-1]))
    importlib.import_module(argv[-2])  # what every node needs, imported once here

    children: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    buffer = b""
    while True:
        if selector.select(timeout=0.05):
            data = channel.recv(65536)
            if not data:  # the launcher is done or gone: its nodes live on without us (init reaps them)
                return 0
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, channel)
                children.add(pid)
                _send(channel, {"started": pid})
        _reap(channel, children)

if __name__ == "__main__":
    sys.exit(main())
