"""A warm node starter: one long-lived process that has imported what a local job's node starter
imports (torch, torch.distributed.pipelining, this package: some 5 s of CPU) and forks a node
starter for each local job that asks. Whoever starts many local jobs in a row on one machine (a
test suite, a notebook) starts it once and names its socket in OOBLECK_NODE_STARTER:

    python -m oobleck_elastic.launcher.warm_starter /tmp/oobleck-starter.sock &
    export OOBLECK_NODE_STARTER=/tmp/oobleck-starter.sock

Each `python -m oobleck_elastic.launch --oobleck-local-nodes N` run with that environment then
gets its node starter from it (launcher/node_starter.py `spawn_node_starter`), and its nodes
start as soon as the launcher is ready for them instead of once a new interpreter has imported
torch. A warm starter that does not answer is no error: the job spawns a node starter of its own,
as it does without one, and says so in one line.

What a job gets is what `Zygote.spawn` would give it, forked instead of exec'd: a process in a
session of its own, in the launcher's working directory, with the job's environment and the
launcher's standard streams (passed over the socket), that forks the job's nodes and exits when
the launcher closes its end. Two things differ. Its parent is the warm starter, which reaps it.
And its /proc/PID/environ and cmdline are the warm starter's, fixed at exec: so the warm starter
is exec'd with a placeholder `--rdzv-id=` argument, and each node starter it forks writes its
job's run id over it, in the memory the kernel shows as /proc/PID/cmdline (Note: [naming the
run]), so the tools that find a run's processes (elastic/process.py `run_id_of`) find these and
everything they fork.

The protocol, one JSON line each way on a Unix socket; the launcher's stdin, stdout and stderr
ride with the request (SCM_RIGHTS):

    launcher -> warm starter   {"run_id": ID, "env": {...}, "cwd": PATH}
    node starter -> launcher   {"starter": PID}      (once it is ready), or from the warm starter
                               {"error": WHY}

after which the connection is the node starter's channel (launcher/zygote.py's protocol).

Note: [naming the run]
    /proc/PID/cmdline is read from the process's own memory, between the arg_start and arg_end
    addresses of /proc/PID/stat, so a process can rewrite what it shows there (setproctitle
    does it for `ps`); the region's length is fixed at exec. The placeholder is long enough for
    any run id the launcher accepts here (RUN_ID_MAX characters); the rest of it is filled with
    NUL bytes, so the run id is an argument of its own and the region still ends in NUL (where it
    does not, the kernel reads on into the environment).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import random
import selectors
import signal
import socket
import sys
import traceback

from oobleck_elastic.launcher.process_exit import exit_now
from oobleck_elastic.launcher.zygote import NODE_STARTER_MODULES, Zygote, freeze_heap, serve

__all__ = ["ENV_VAR", "RUN_ID_MAX", "main", "request_starter"]

ENV_VAR = "OOBLECK_NODE_STARTER"
RUN_ID_MAX = 120
REQUEST_TIMEOUT_S = 10.0  # a warm starter that has not answered by then is not used
_PLACEHOLDER = "--rdzv-id=" + "?" * RUN_ID_MAX
_ENTRY = "import sys; from oobleck_elastic.launcher.warm_starter import main; sys.exit(main())"
_PR_SET_PDEATHSIG = 1


def request_starter(path: str, run_id: str, env: dict[str, str], timeout: float = REQUEST_TIMEOUT_S,
                    cwd: str | None = None) -> Zygote:
    """A node starter for run `run_id`, forked by the warm starter listening on `path`, with
    `env`, this process's standard streams and working directory (or `cwd`). Raises OSError
    (or ValueError for a run id it cannot name) when it cannot have one."""
    if len(run_id) > RUN_ID_MAX:
        raise ValueError(f"a warm starter names runs of up to {RUN_ID_MAX} characters, not {len(run_id)}")
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        channel.settimeout(timeout)
        channel.connect(path)
        payload = (json.dumps({"run_id": run_id, "env": env, "cwd": cwd or os.getcwd()}) + "\n").encode()
        sys.stdout.flush()
        sys.stderr.flush()
        sent = socket.send_fds(channel, [payload], [0, 1, 2])
        if sent < len(payload):  # (an empty send to a peer that has answered and closed fails)
            channel.sendall(payload[sent:])
        answer = _read_line(channel)
        if "starter" not in answer:
            raise OSError(f"the warm starter refused: {answer.get('error', answer)}")
        channel.settimeout(None)
        return Zygote(channel, int(answer["starter"]), reaped_elsewhere=True)
    except BaseException:
        channel.close()
        raise


def _read_line(channel: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = channel.recv(4096)
        if not chunk:
            raise OSError("the warm starter closed the connection without an answer")
        data += chunk
    return json.loads(data)


# --- the warm starter ------------------------------------------------------------------------


def serve_forever(path: str, modules: list[str]) -> None:
    """Imports `modules`, then forks a node starter for each request on the Unix socket `path`
    until killed. It starts no thread: a forked child inherits no lock another thread held."""
    for module in modules:
        importlib.import_module(module)
    freeze_heap()  # Note: [frozen heap before fork] in launcher/zygote.py
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = f"{path}.{os.getpid()}"
    umask = os.umask(0o177)  # the socket is this user's from the start: whoever connects runs code as them
    try:
        listener.bind(bound)
    finally:
        os.umask(umask)
    listener.listen(16)
    os.replace(bound, path)  # the path appears once it takes connections (over one a killed starter left)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: set[int] = set()
    while True:
        if selector.select(timeout=0.1):
            conn, _ = listener.accept()
            pid = _start_one(conn, listener)
            if pid:
                children.add(pid)
        _reap(children)


def _start_one(conn: socket.socket, listener: socket.socket) -> int | None:
    """Reads one request from `conn` and forks its node starter; its pid (None if the request
    was bad: the requester was told why)."""
    fds: list[int] = []
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not data.endswith(b"\n"):
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise OSError("the requester left")
            data += chunk
        request = json.loads(data)
        if len(fds) != 3 or not isinstance(request, dict) or len(str(request.get("run_id", ""))) > RUN_ID_MAX:
            raise ValueError("a request is one JSON object with run_id, env and cwd, and three descriptors")
        differ = sorted(name for name in {*_startup_env(os.environ), *_startup_env(request["env"])}
                        if os.environ.get(name) != request["env"].get(name))
        if differ:
            raise ValueError(f"the job's {', '.join(differ)} differ from the warm starter's, and Python reads them "
                             "only when it starts; start the warm starter with the same environment")
        conn.settimeout(None)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_starter(request, conn, fds, listener)
        return pid  # the child answers once it is ready
    except (OSError, ValueError) as exc:
        _send(conn, {"error": str(exc)})
        return None
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()


def _become_starter(request: dict, channel: socket.socket, fds: list[int], listener: socket.socket) -> None:
    """The forked child: the job's node starter (launcher/zygote.py `serve`); never returns."""
    code = 1
    try:
        listener.close()
        os.setsid()
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
        os.chdir(request["cwd"])
        sys.path[:] = _python_path(request["env"].get("PYTHONPATH", ""))
        name_run(str(request["run_id"]))
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()
        _send(channel, {"starter": os.getpid()})  # named and in place: the launcher may use it
        code = serve(channel, [])
    except BaseException:  # noqa: BLE001 - its last word goes to the launcher's stderr
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _startup_env(env: dict[str, str] | os._Environ[str]) -> set[str]:
    """The variables of `env` that Python reads only when it starts (PYTHONHASHSEED, ...), but
    PYTHONPATH, which a forked node starter applies itself (`_python_path`)."""
    return {name for name in env if name.startswith("PYTHON") and name != "PYTHONPATH"}


_OWN_PYTHONPATH = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _python_path(pythonpath: str) -> list[str]:
    """sys.path as an interpreter started here with `pythonpath` would have it: this one's,
    its own PYTHONPATH entries replaced by those of `pythonpath` (absolute, as site makes them),
    after the first entry (the script's folder, or '' for the working directory)."""
    theirs = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]
    kept = [p for p in sys.path[1:] if p not in _OWN_PYTHONPATH]
    return [sys.path[0], *theirs, *(p for p in kept if p not in theirs)]


def name_run(run_id: str) -> None:
    """Shows `run_id` as this process's `--rdzv-id=` argument in /proc/PID/cmdline, over the
    placeholder the warm starter was exec'd with (Note: [naming the run])."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # field 3 (state) onwards: the name may hold spaces
    arg_start, arg_end = int(fields[48 - 3]), int(fields[49 - 3])
    with open("/proc/self/cmdline", "rb") as f:
        shown = f.read()
    at = shown.find(_PLACEHOLDER.encode() + b"\0")
    if at < 0 or len(shown) != arg_end - arg_start or len(run_id) > RUN_ID_MAX:
        raise RuntimeError(f"cannot name run {run_id!r}: this process was not exec'd as a warm starter")
    named = f"--rdzv-id={run_id}".encode().ljust(len(_PLACEHOLDER), b"\0")
    ctypes.memmove(ctypes.c_void_p(arg_start + at), named, len(named))


def _reap(children: set[int]) -> None:
    for pid in list(children):
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                children.discard(pid)
        except ChildProcessError:
            children.discard(pid)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:  # the requester is gone
        pass


def command(path: str) -> list[str]:
    """The command line that runs a warm starter listening on `path`."""
    return [sys.executable, "-c", _ENTRY, path, _PLACEHOLDER]


def main(argv: list[str] | None = None) -> int:
    """`python -m oobleck_elastic.launcher.warm_starter PATH`: serves on the Unix socket PATH
    until killed (or until the process that started it ends)."""
    argv = sys.argv[1:] if argv is None else argv
    paths = [a for a in argv if a != _PLACEHOLDER]
    if len(paths) != 1 or paths[0].startswith("-"):
        print("usage: python -m oobleck_elastic.launcher.warm_starter SOCKET_PATH", file=sys.stderr)
        return 2
    if _PLACEHOLDER not in argv:  # run as -m: exec again with the placeholder to write over
        os.execv(sys.executable, command(paths[0]))
    if sys.platform.startswith("linux"):  # it serves the process that started it, and no longer
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    try:
        serve_forever(paths[0], list(NODE_STARTER_MODULES))
    except KeyboardInterrupt:
        pass
    exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
