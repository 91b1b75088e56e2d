"""Recovery speed: oobleck_elastic against stock torchrun, the same job and the same SIGKILL.

    python benchmarks/recovery.py [--nodes 5] [--kill-step 17] [--steps 30] [--runs 5]
    python benchmarks/recovery.py --failure hang [--runs 5]

Runs the GPT example twice on local nodes, each node an agent and its worker: once with
`python -m oobleck_elastic.launch` (node 1 SIGKILLed by OOBLECK_FAULT at --kill-step), once
data-parallel under stock torchrun (benchmarks/torchrun_baseline.py, a checkpoint every 5 steps)
with node 1 SIGKILLed, agent and worker, at the same step. For each it prints the time from the
kill to the first step completed afterwards, the steps of work lost (re-executed beyond the
interrupted one) and the ratio. For ours it also prints the recovery's phases and the transfer
throughput beside a raw gloo send/recv of the same number of bytes measured here. A third run
is ours under stock torchrun (`--rdzv-backend=oobleck` on an etcd server started here).

torchrun runs as its docs' fault-tolerant job: `--nnodes=N --max-restarts=3 --rdzv-backend=c10d`,
the dead node started again at once (a cluster manager replacing the machine at no cost: its
best case, since it restarts every worker and needs the full group back). Three settings make
it recover at all, or within seconds, on torch 2.13:

* TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. By default the agents share the rank-0 agent's TCPStore
  with the workers, and dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous builds that
  store's address (RendezvousStoreInfo.build: rank 0 publishes MASTER_ADDR/PORT under the round's
  key prefix) only in an agent's first round. The surviving rank 0 never publishes it again, so
  the replacement node waits for .../<round>/MASTER_ADDR until the 60 s store timeout; and the
  restarted workers of later rounds reuse the same store and key names, reading the gloo
  addresses of the dead workers (connectFullMesh: connection refused). Off, each round's rank-0
  worker hosts a fresh store (pytorch/pytorch#135712).
* is_host=1 on node 0 only: every agent here matches 127.0.0.1 as its own address
  (utils._matches_machine_hostname), so whichever bound the port first would host the
  rendezvous store; on a real cluster only the endpoint's machine does, which this pins.
* keep_alive_interval=1, keep_alive_max_attempt=3: a round moves on only once every participant
  of the last one has left it, and the SIGKILLed agent leaves only when its heartbeat expires
  (15 s by default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from oobleck_elastic.monitoring.metrics import read_records  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples/gpt/config.yaml")
KILLED = 1  # the node SIGKILLed on both sides; neither side's stores live on it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every process below it, then reap it. Both launchers start their
    children in sessions of their own, so a process group does not reach them; each process is
    stopped before its children are listed, so none can start another one meanwhile."""
    if proc.poll() is not None:  # exited and reaped: its pid may belong to another process now
        return
    found, todo = [], [proc.pid]
    while todo:
        try:
            p = psutil.Process(todo.pop())
            p.suspend()
            todo += [c.pid for c in p.children()]
            found.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in found:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


FAULTS = {  # what OOBLECK_FAULT does to node KILLED, for each --failure
    "kill": "phase=backward",  # SIGKILL of its agent and worker: the kernel resets their sockets
    "hang": "phase=backward,action=hang,seconds=6",  # stopped 6 s, then woken: no socket closes
}


def _fault(failure: str, kill_step: int) -> str:
    return f"node={KILLED},step={kill_step},{FAULTS[failure]}"


def run_ours(tmp: str, nodes: int, steps: int, kill_step: int, failure: str = "kill") -> dict:
    sets = ["--set", f"train.steps={steps}", "--set", "train.global_batch_size=60",
            "--set", f"monitoring.metrics_path={tmp}/ours/metrics.jsonl",
            "--set", f"monitoring.tensorboard_dir={tmp}/ours/tb", "--set", "checkpoint.interval=0",
            "--set", f"checkpoint.dir={tmp}/ours/checkpoints"]
    env = {**os.environ, "OOBLECK_FAULT": _fault(failure, kill_step), "OOBLECK_FAULT_LOG": f"{tmp}/ours/kill.jsonl"}
    shutil.rmtree(f"{tmp}/ours", ignore_errors=True)
    os.makedirs(f"{tmp}/ours", exist_ok=True)
    with open(f"{tmp}/ours/launch.log", "w+") as out:
        proc = subprocess.Popen([sys.executable, "-m", "oobleck_elastic.launch",
                                 f"--oobleck-local-nodes={nodes}", "--nproc-per-node=1",
                                 f"--oobleck-log-dir={tmp}/ours/logs",
                                 os.path.join(ROOT, "examples/gpt/train.py"), "--config", CONFIG,
                                 *sets],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=900)
        finally:
            _kill_tree(proc)  # after a timeout or an interrupt (the launcher stops its nodes)
        out.seek(0)
        if proc.returncode:
            raise SystemExit(f"oobleck run failed:\n{out.read()}")
    return _measure(f"{tmp}/ours")


def run_ours_under_torchrun(tmp: str, nodes: int, steps: int, kill_step: int, failure: str = "kill") -> dict:
    """The same job under stock torchrun with our rendezvous on etcd: no launcher of ours marks
    the dead node, so the survivors find it by gloo errors and its still lease."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
    from etcd_server import etcd_server

    work = f"{tmp}/ours_torchrun"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OOBLECK_FAULT_LOG": f"{work}/kill.jsonl",
           "OOBLECK_FAULT": _fault(failure, kill_step)}
    procs = []
    with etcd_server() as port:
        try:
            for node in range(nodes):
                with open(f"{work}/node{node}.log", "w") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", "--nproc-per-node=1",
                         "--rdzv-backend=oobleck", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=store=etcd",
                         "--rdzv-id=bench", "--monitor-interval=0.1", os.path.join(ROOT, "examples/gpt/train.py"),
                         "--config", CONFIG, "--set", f"train.steps={steps}", "--set", "train.global_batch_size=60",
                         "--set", f"monitoring.metrics_path={work}/metrics.jsonl",
                         "--set", f"monitoring.tensorboard_dir={work}/tb", "--set", "checkpoint.interval=0",
                         "--set", f"checkpoint.dir={work}/checkpoints"],
                        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + 600
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                _kill_tree(proc)
    if sum(p.returncode == 0 for p in procs) < nodes - 1:  # the failed node's own code is its failure's
        raise SystemExit(f"oobleck under torchrun failed: exit codes {[p.returncode for p in procs]}; logs in {work}")
    return _measure(work)


def _measure(work: str) -> dict:
    """Kill -> next completed step, steps lost and the recovery record of a run of ours."""
    kill = read_records(f"{work}/kill.jsonl")[0]
    log = read_records(f"{work}/metrics.jsonl")
    # the first step of the new generation (a step of the old one may finish just after the kill)
    after = [r for r in log if "step" in r and "event" not in r and r["time"] > kill["time"] and r["generation"] > 0]
    recovery = [r for r in log if r.get("event") == "recovery"][0]
    order = ["detect", "teardown", "agree", "reinit", "transfer", "rebuild", "replay"]
    phases = dict(sorted(recovery["phases_s"].items(),  # timed by the workers
                         key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    return {"recover_s": after[0]["time"] - kill["time"], "lost_steps": kill["step"] - after[0]["step"],
            "recovery": recovery, "phases": phases}


def _records_or_empty(path):
    return read_records(path, missing_ok=True)


def _errors(work: str) -> str:
    """The distinct errors in the torchrun nodes' logs, past the "closed/reset by peer" of the
    old workers, which the kill itself causes."""
    errors = set()
    for name in os.listdir(work):
        if name.endswith(".log"):
            with open(os.path.join(work, name)) as f:
                errors |= {line.strip()[:150] for line in f
                           if "Error: " in line and "by peer" not in line}
    return " | ".join(sorted(errors)[:3]) or "no error logged"


def run_torchrun(tmp: str, nodes: int, steps: int, kill_step: int, patience: float = 180.0) -> dict:
    """Stock torchrun recovering from the same kill (its setup: the module docstring); it gets
    `patience` seconds from the kill to complete a step."""
    work = f"{tmp}/torchrun"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work, exist_ok=True)
    port = _free_port()
    procs = []
    flags = [f"--nnodes={nodes}", "--nproc-per-node=1", "--max-restarts=3",
             "--monitor-interval=0.1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=bench"]
    conf = "join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"
    setup = (f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun {' '.join(flags)} "
             f"--rdzv-conf=is_host=<node 0>,{conf}; node {KILLED} started again at once")

    def start(node: int) -> None:
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
               "BENCH_DIR": work, "BENCH_NODE": str(node), "BENCH_KILL": f"{KILLED},{kill_step}"}
        cmd = [sys.executable, "-m", "torch.distributed.run", *flags,
               f"--rdzv-conf=is_host={int(node == 0)},{conf}",
               os.path.join(ROOT, "benchmarks/torchrun_baseline.py"),
               "--config", CONFIG, "--set", f"train.steps={steps}",
               "--set", "train.global_batch_size=60"]
        with open(f"{work}/node{node}-{len(procs)}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))

    after = []
    try:
        for node in range(nodes):
            start(node)
        deadline = time.time() + 300
        while not os.path.exists(f"{work}/killed"):
            if time.time() > deadline or all(p.poll() is not None for p in procs):
                raise SystemExit(f"torchrun never reached step {kill_step}: {_errors(work)}")
            time.sleep(0.05)
        procs[KILLED].wait(timeout=30)  # the worker SIGKILLs its agent, then itself
        start(KILLED)  # the replacement machine
        with open(f"{work}/killed") as f:
            kill = json.load(f)
        deadline = time.time() + patience
        while not after and time.time() < deadline:
            time.sleep(0.1)
            # a step of a worker started after the kill (one of the old workers' steps may end
            # just after it)
            after = [r for r in _records_or_empty(f"{work}/steps.jsonl")
                     if r["started"] > kill["time"]]
        errors = None if after else _errors(work)  # now: stopping the nodes logs errors too
    finally:
        for proc in procs:
            _kill_tree(proc)
    if not after:
        return {"recover_s": None, "lost_steps": None, "setup": setup,
                "failure": f"no step within {patience:.0f} s of the kill: {errors}"}
    return {"recover_s": after[0]["time"] - kill["time"], "setup": setup,
            "lost_steps": kill["step"] - after[0]["step"], "resumed_at": after[0]["step"]}


def _raw_gloo(rank: int, port: int, nbytes: int, queue) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    buf = torch.empty(max(nbytes // 4, 1), dtype=torch.float32)
    for attempt in range(4):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        elapsed = time.perf_counter() - start
        if rank == 1 and attempt:
            queue.put(elapsed)
    dist.destroy_process_group()


def raw_transfer_seconds(nbytes: int) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_raw_gloo, args=(r, port, nbytes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        times = [queue.get(timeout=120) for _ in range(3)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    return min(times)


def _spread(values: list[float]) -> str:
    """The median of `values`, with their range when there are several."""
    if len(values) == 1:
        return f"{values[0]:6.2f} s"
    return f"{statistics.median(values):6.2f} s (median of {len(values)}, {min(values):.2f}-{max(values):.2f})"


def _hang(args, tmp: str) -> None:
    """Ours against a silent failure: node KILLED stopped (agent and worker) for 6 s, then
    woken; stock torchrun is not run (its survivors would wait in gloo for the process
    group's 30-minute timeout)."""
    ours = [run_ours(tmp, args.nodes, args.steps, args.kill_step, "hang") for _ in range(args.runs)]
    under = [run_ours_under_torchrun(tmp, args.nodes, args.steps, args.kill_step, "hang") for _ in range(args.runs)]
    print(f"{args.nodes} local nodes, GPT example, node {KILLED} stopped (SIGSTOP of its agent and worker, "
          f"woken 6 s later) at step {args.kill_step} (0-based), default timeouts (collective 10 s)")
    for name, runs in (("oobleck_elastic", ours), ("oobleck_elastic under stock torchrun (etcd)", under)):
        print(f"  {name}: hang -> next completed step {_spread([r['recover_s'] for r in runs])}, steps lost "
              f"{max(r['lost_steps'] for r in runs)}; detect {_spread([r['phases'].get('detect', 0) for r in runs])}")
    print("  stock torchrun: not run (a silent peer holds its workers in gloo for the 30-minute default timeout)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-step", type=int, default=17)
    p.add_argument("--failure", choices=sorted(FAULTS), default="kill",
                   help="kill: SIGKILL (sockets reset); hang: the node stopped 6 s (nothing closes)")
    p.add_argument("--runs", type=int, default=1, help="runs of each side; medians are printed")
    args = p.parse_args()
    # `timeout` and the like send SIGTERM: exit through the finally clauses that stop the nodes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp:
        if args.failure == "hang":
            _hang(args, tmp)
            return 0
        mine = [run_ours(tmp, args.nodes, args.steps, args.kill_step) for _ in range(args.runs)]
        bases = [run_torchrun(tmp, args.nodes, args.steps, args.kill_step) for _ in range(args.runs)]
        unders = [run_ours_under_torchrun(tmp, args.nodes, args.steps, args.kill_step) for _ in range(args.runs)]
    ours, base, under = mine[-1], bases[-1], unders[-1]  # the phases shown are the last run's
    ours_s = [r["recover_s"] for r in mine]
    rec = ours["recovery"]
    print(f"{args.nodes} local nodes, GPT example, node {KILLED} SIGKILLed (agent and worker) at step "
          f"{args.kill_step} (0-based)")
    print(f"  oobleck_elastic: kill -> next completed step {_spread(ours_s)}, steps lost "
          f"{ours['lost_steps']} (the interrupted step is replayed)")
    if any(b["recover_s"] is None for b in bases):
        print(f"  stock torchrun:  did not recover: {next(b['failure'] for b in bases if b['recover_s'] is None)}")
    else:
        base_s = [b["recover_s"] for b in bases]
        print(f"  stock torchrun:  kill -> next completed step {_spread(base_s)}, steps lost "
              f"{base['lost_steps']} (every worker restarted from the checkpoint of step "
              f"{base['resumed_at']})")
        print(f"  ratio torchrun/oobleck: {statistics.median(base_s) / statistics.median(ours_s):.1f}x "
              "(goal >= 10x, ours < 1 s)")
    print(f"  torchrun setup: {base['setup']}")
    print(f"  oobleck_elastic under stock torchrun (--rdzv-backend=oobleck, etcd): kill -> next completed "
          f"step {_spread([u['recover_s'] for u in unders])}, steps lost {under['lost_steps']}; phases: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in under["phases"].items())
          + " (no launcher marks the node dead: the roll call waits out elastic.rollcall_window_s)")
    print("  our recovery phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in ours["phases"].items())
          + f"; {rec['transfers']} layer copies, {rec['bytes_moved']} bytes; " + "; ".join(rec["actions"]))
    if rec["bytes_moved"]:
        raw = raw_transfer_seconds(rec["bytes_moved"])
        print(f"  raw gloo send/recv of the same {rec['bytes_moved']} bytes: {raw * 1e3:.1f} ms "
              f"({rec['bytes_moved'] / raw / 2**20:.0f} MiB/s); our transfer phase "
              f"{rec['phases_s'].get('transfer', 0) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
