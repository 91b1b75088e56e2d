"""Workers forked by a node's worker starter (launcher/zygote.py, launcher/forked_workers.py)
behave for torch's agent as exec'd ones do: each runs its script as `python -u SCRIPT ARGS`
would (argv, environment, __main__, sys.path[0], exit status, its own log files and logging
configuration) on the heap its starter froze, dies with
its starter, and torch's context stops them with its signal. Run in a fresh interpreter: the
starter must be forked before any thread starts, and pytest's process may have some."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import psutil

SCENARIO = textwrap.dedent('''
    import json, os, signal, sys, time
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from oobleck_elastic.launcher.forked_workers import starting_through
    from oobleck_elastic.launcher.zygote import Zygote

    out, script = sys.argv[1], sys.argv[2]
    import logging
    logging.basicConfig(level=logging.WARNING, format="NODE %(message)s")  # as a node's entry point does
    starter = Zygote.fork([])
    start = starting_through(starter)

    def run(mode, log_dir):
        return start(name="trainer", entrypoint=sys.executable,
                     args={r: ("-u", script, mode, str(r)) for r in range(2)},
                     envs={r: {"OOBLECK_NODE_ID": "7", "LOCAL_RANK": str(r)} for r in range(2)},
                     logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL), log_line_prefixes=None,
                     start_method="fork", numa_options=None, duplicate_stdout_filters=None,
                     duplicate_stderr_filters=None)

    report = {}
    ctx = run("exit", os.path.join(out, "a"))
    deadline = time.monotonic() + 60
    while (result := ctx.wait(0)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    report["failures"] = {r: f.exitcode for r, f in result.failures.items()}
    report["stdout"] = {r: open(p).read() for r, p in result.stdouts.items()}
    report["stderr"] = {r: open(p).read() for r, p in result.stderrs.items()}

    ctx = run("sleep", os.path.join(out, "b"))
    pids = list(ctx.pids().values())
    while not all(os.path.exists(os.path.join(out, f"ready{r}")) for r in range(2)):
        time.sleep(0.05)
    report["names"] = [open(f"/proc/{p}/comm").read().strip() for p in pids]
    report["sessions"] = [os.getsid(p) == p for p in pids]
    report["parents"] = [int(open(f"/proc/{p}/stat").read().split(")")[1].split()[1]) == starter.pid for p in pids]
    ctx.close(death_sig=signal.SIGTERM)
    report["closed"] = {r: h.proc.returncode for r, h in ctx.subprocess_handlers.items()}

    ctx = run("sleep", os.path.join(out, "c"))
    report["orphans"] = list(ctx.pids().values())
    os.kill(starter.pid, signal.SIGKILL)  # the starter dies: its workers die with it
    print(json.dumps(report))
''')

WORKER = textwrap.dedent('''
    import os, sys, time
    mode, rank = sys.argv[1], int(sys.argv[2])
    print("argv", sys.argv[1:], "main", __name__, "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
    print("env", os.environ["LOCAL_RANK"], os.environ["OOBLECK_NODE_ID"], file=sys.stderr)
    import logging
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")  # the worker's, not its node's
    logging.info("worker logs")
    import gc
    print("frozen heap", gc.get_freeze_count() > 0)  # inherited frozen from its starter
    if mode == "sleep":
        open(os.path.join(os.environ["OUT"], f"ready{rank}"), "w").close()
        time.sleep(600)
    sys.exit(3 * rank)
''')


def test_forked_workers_run_their_script_exit_with_its_status_and_die_with_their_starter(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path), str(script)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failures"] == {"1": 3}, report  # rank 0 exited 0, rank 1 with its status
    for rank in ("0", "1"):
        assert report["stdout"][rank] == f"argv ['exit', '{rank}'] main __main__ path0 True\nfrozen heap True\n"
        assert report["stderr"][rank] == f"env {rank} 7\nINFO worker logs\n"
    assert report["names"] == ["oobleck-w7.0", "oobleck-w7.1"]
    assert report["sessions"] == [True, True] and report["parents"] == [True, True]
    assert report["closed"] == {"0": -15, "1": -15}, "torch's context stopped them with its signal"
    left = []
    for pid in report["orphans"]:
        try:
            left.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    gone, alive = psutil.wait_procs(left, timeout=10)
    for orphan in alive:
        orphan.kill()
    assert not alive, "a worker outlived its starter"
