"""Processes started by fork from a process that has imported what they need (torch and this
package: ~2.5 s of CPU per interpreter), so N of them cost one import, not N. Two starters:

- the local job's node starter (`Zygote.spawn`): a process of its own that the launcher execs
  once (or that a warm starter forks, launcher/warm_starter.py); it imports the node agent's and
  the workers' modules and forks each node of `--oobleck-local-nodes` from itself, in a session
  of its own (killed as a unit, as before);
- a node's worker starter (`Zygote.fork`, `--start-method fork`, the launcher's default): forked
  from the node process itself before the node starts any thread; it forks the node's workers
  for the agent (launcher/forked_workers.py). Each worker is in a session of its own, as torch
  starts them, and dies with its starter, which dies with its agent (PR_SET_PDEATHSIG).

What a child runs is a Python command line (`[-u] SCRIPT ARGS`, `[-u] -m MODULE ARGS`, or a
module's `main(argv)`), run in the child as `python` would run it: `sys.argv`, `sys.path[0]`,
`__main__`, its exit status. Its environment is the one asked for; note that /proc/PID/environ
shows the starter's (it is fixed at exec), so a forked worker names itself in /proc/PID/comm
(elastic/process.py `worker_name`) for the tools that look for it.

The two ends talk over a socket, one JSON object per line:

    owner -> starter   {"python": [...], "env": {...}, "stdout": PATH or null, "stderr": PATH or null,
                        "name": COMM or null, "die_with_starter": BOOL}
    starter -> owner   {"started": PID}                   in the order asked
                       {"exited": PID, "returncode": RC}  RC < 0: killed by signal -RC

A starter forks nothing before it has imported everything and starts no thread, so a child
inherits no lock held by another thread (Note: [forking after torch]). It exits when its owner
closes the socket (at the end of the job or the node, or when the owner dies).

Note: [frozen heap before fork]
    A starter collects its garbage and freezes what is left (gc.freeze) before it forks: its
    children inherit a heap the collector no longer scans. A worker's first full collection
    (Note: [frozen heap] in elastic/joining.py) then scans only what the worker made itself,
    not the million objects of torch's import (0.4-0.6 s per worker, four workers on two
    cores: most of a second of every job's start here), and the collector does not touch, and
    so copy, the pages the children share with the starter.

Note: [forking after torch]
    `import torch` starts no Python thread and touches no device; the OpenMP pool and CUDA start
    on first use, which happens in the workers, never in a starter. Python's `random` state is
    reseeded in each child so no two processes draw the same numbers.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import logging
import os
import random
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings

from oobleck_elastic.launcher.process_exit import exit_now

__all__ = ["ForkedProcess", "NODE_STARTER_MODULES", "WORKER_MODULES", "Zygote", "main"]

START_TIMEOUT_S = 120.0  # the first child waits for the starter's imports
# what a training worker imports besides the user's script: imported by a starter once
WORKER_MODULES = ("torch.distributed.pipelining", "oobleck_elastic.elastic.worker", "oobleck_elastic.models",
                  "oobleck_elastic.data",
                  # the reporting worker draws each generation's layout before its first step and writes TensorBoard
                  "matplotlib.figure", "matplotlib.backends.backend_agg", "torch.utils.tensorboard")
# what a local job's node starter imports: a node's modules and its workers'
NODE_STARTER_MODULES = ("oobleck_elastic.launch", "oobleck_elastic.launcher.node", *WORKER_MODULES)
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15  # linux/prctl.h


class ForkedProcess:
    """A process a starter forked: what its owner uses of a Popen (pid, poll, wait, returncode)."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid, self._zygote = pid, zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self._zygote.pump()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
            self._zygote.pump(wait=0.05)
        assert self.returncode is not None
        return self.returncode


_ENTRY = "import sys; from oobleck_elastic.launcher.zygote import main; sys.exit(main())"


class Zygote:
    """The owner's end of a starter: forks processes through it."""

    def __init__(self, channel: socket.socket, pid: int, proc: subprocess.Popen | None = None,
                 reaped_elsewhere: bool = False) -> None:
        """`proc`: the starter, spawned by this process; else forked by this process, or, with
        `reaped_elsewhere`, by another (a warm starter, launcher/warm_starter.py)."""
        self.channel, self.pid, self.proc, self.reaped_elsewhere = channel, pid, proc, reaped_elsewhere
        self.children: dict[int, ForkedProcess] = {}
        self._buffer, self._gone = b"", False
        self._started: list[int] = []
        self._selector = selectors.DefaultSelector()
        self._selector.register(channel, selectors.EVENT_READ)

    @classmethod
    def spawn(cls, env: dict[str, str], run_id: str, modules: list[str]) -> Zygote:
        """A starter in a process of its own (its command line names the job, as the nodes' did),
        importing `modules` before it forks anything."""
        ours, theirs = socket.socketpair()
        # -c, not -m: the package (imported first by -m) already imports this module, and runpy
        # would warn on every job that it runs a second copy of it as __main__
        proc = subprocess.Popen([sys.executable, "-c", _ENTRY, f"--rdzv-id={run_id}", ",".join(modules),
                                 str(theirs.fileno())], env=env, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        return cls(ours, proc.pid, proc)

    @classmethod
    def fork(cls, modules: list[str]) -> Zygote:
        """A starter forked from this process, which must have no other thread; it imports
        `modules` (nothing, where this process has them already) and dies with this process."""
        if threading.active_count() > 1:
            raise RuntimeError(f"a worker starter must be forked before any thread starts; running: "
                               f"{[t.name for t in threading.enumerate()]}")
        ours, theirs = socket.socketpair()
        owner = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the starter
            code = 1
            try:
                ours.close()
                _die_with(owner)
                _set_name("oobleck-starter")
                code = serve(theirs, modules)
            except BaseException:  # noqa: BLE001 - its last word goes to the node's log
                traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        return cls(ours, pid)

    def start(self, python: list[str], env: dict[str, str], stdout: str | None = None, stderr: str | None = None,
              name: str | None = None, die_with_starter: bool = False) -> ForkedProcess:
        """Forks one process running `python PYTHON` with `env`, its output to `stdout` and
        `stderr` (None: the starter's own)."""
        request = {"python": python, "env": env, "stdout": stdout, "stderr": stderr, "name": name,
                   "die_with_starter": die_with_starter}
        self.channel.sendall((json.dumps(request) + "\n").encode())
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._started:
            if self._gone or time.monotonic() > deadline:
                raise RuntimeError(f"the process starter (pid {self.pid}) did not start a process within "
                                   f"{START_TIMEOUT_S:.0f} s (alive: {_alive(self.pid)})")
            self.pump(wait=0.05)
        child = ForkedProcess(self._started.pop(0), self)
        self.children[child.pid] = child
        return child

    def pump(self, wait: float = 0.0) -> None:
        """Reads what the starter said: started processes, exited processes."""
        while not self._gone and self._selector.select(timeout=wait):
            wait = 0.0
            data = self.channel.recv(65536)
            if not data:  # the starter died: its children were reparented, their status is lost
                self._gone = True
                break
            self._buffer += data
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                message = json.loads(line)
                if "started" in message:
                    self._started.append(message["started"])
                elif message.get("exited") in self.children:
                    self.children[message["exited"]].returncode = message["returncode"]
        if self._gone:  # a child no longer alive counts as failed
            for child in self.children.values():
                if child.returncode is None and not _alive(child.pid):
                    child.returncode = 1

    def kill(self) -> None:
        """Ends a starter that has started nothing, without waiting for its imports."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.close()

    def close(self) -> None:
        """Ends the starter (children that do not die with it live on)."""
        self._selector.close()
        self.channel.close()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.reaped_elsewhere:
                if not _alive(self.pid):  # its parent reaps it (a zombie is still alive here)
                    return
            else:
                try:
                    if os.waitpid(self.pid, os.WNOHANG)[0]:
                        return
                except ChildProcessError:
                    return
            time.sleep(0.01)
        try:
            os.kill(self.pid, signal.SIGKILL)
            if not self.reaped_elsewhere:
                os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _die_with(parent: int) -> None:
    """The kernel kills this process when `parent` (the thread that forked it) ends."""
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it ended before the request took effect
        os._exit(1)


def _set_name(name: str) -> None:
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _redirect(stdout: str | None, stderr: str | None) -> None:
    opened: dict[str, int] = {}
    for fd, path in ((1, stdout), (2, stderr)):
        if path:
            if path not in opened:
                opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened[path], fd)
    for fd in opened.values():
        os.close(fd)


def _run_python(args: list[str]) -> None:
    """Runs a `python` command line's program in this process: [-u] (-m MODULE | SCRIPT) ARGS."""
    if args and args[0] == "-u":
        args = args[1:]
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    if len(args) >= 2 and args[0] == "--main":  # a module's main(argv), its return value the status
        sys.argv = [args[1], *args[2:]]
        raise SystemExit(importlib.import_module(args[1]).main(args[2:]))
    if len(args) >= 2 and args[0] == "-m":
        sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
        # the starter may have imported the package of MODULE: that is what it is for
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                category=RuntimeWarning)
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    if not args or args[0].startswith("-"):
        raise SystemExit(f"a forked process runs `[-u] SCRIPT ARGS` or `[-u] -m MODULE ARGS`, not {args}")
    sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.abspath(args[0]))
    runpy.run_path(args[0], run_name="__main__")


def _child(request: dict, channel: socket.socket, starter: int) -> None:
    """Becomes the process of `request` and never returns."""
    code: int = 1
    try:
        channel.close()
        os.setsid()
        if request.get("die_with_starter"):
            _die_with(starter)
        if request.get("name"):
            _set_name(request["name"])
        _redirect(request.get("stdout"), request.get("stderr"))
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_logging()
        if request.get("die_with_starter"):  # the parent a worker watches (elastic/process.py)
            os.environ["OOBLECK_PARENT_PID"] = str(starter)
        random.seed()
        _run_python(request["python"])
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # as python does: the message to stderr, status 1
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the process's last word goes to its log
        traceback.print_exc()
    finally:
        exit_now(code)  # what python does on its way out, less the teardown


def _fresh_logging() -> None:
    """Logging as a new interpreter has it: the process that forked the starter (a node, whose
    entry point configured logging for itself) must not decide how its workers log, or a
    worker's own `logging.basicConfig` does nothing."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


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
    except OSError:  # the owner is gone: nobody to tell
        pass


def freeze_heap() -> None:
    """Note: [frozen heap before fork]"""
    gc.collect()
    gc.freeze()


def serve(channel: socket.socket, modules: list[str]) -> int:
    """The starter's loop: imports `modules`, then forks a child per request until the owner
    closes the socket."""
    for module in modules:
        importlib.import_module(module)
    freeze_heap()
    children: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    buffer = b""
    me = os.getpid()
    while True:
        if selector.select(timeout=0.05):
            data = channel.recv(65536)
            if not data:  # the owner is done or gone; children that do not die with us live on
                return 0
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, channel, me)
                children.add(pid)
                _send(channel, {"started": pid})
        _reap(channel, children)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # argv: --rdzv-id=RUN (names the job in `ps`), the modules to import (comma-separated), the socket's fd
    code = serve(socket.socket(fileno=int(argv[-1])), [m for m in argv[-2].split(",") if m])
    # Out without the interpreter's teardown: with torch imported it takes a second or two, and
    # the owner waits for this process (nothing here has anything left to write or run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
