"""Recovery speed: oobleck_elastic against stock torchrun, the same job and the same SIGKILL.

    python benchmarks/recovery.py [--nodes 5] [--kill-step 17] [--steps 30]

Runs the GPT example twice on local nodes (one agent process group each): once with
`python -m oobleck_elastic.launch` (a node SIGKILLed by OOBLECK_FAULT at --kill-step), once
data-parallel under stock `torchrun` (c10d rendezvous, --nnodes N, --max-restarts=3, a
checkpoint every 5 steps; benchmarks/torchrun_baseline.py) with the same node killed at the
same step and started again at once (a cluster manager replacing the machine: torchrun's best
case, since it restarts every worker and needs a full group). For each it prints the time from the kill to the first step completed afterwards
and the steps of work lost (re-executed beyond the interrupted one), and the ratio. For ours it
also prints the recovery's phases and the transfer throughput beside a raw gloo send/recv of
the same number of bytes measured here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples/gpt/config.yaml")


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ours(tmp: str, nodes: int, steps: int, kill_step: int) -> dict:
    sets = ["--set", f"train.steps={steps}", "--set", "train.global_batch_size=60",
            "--set", f"monitoring.metrics_path={tmp}/ours/metrics.jsonl",
            "--set", f"monitoring.tensorboard_dir={tmp}/ours/tb", "--set", "checkpoint.interval=0"]
    env = {**os.environ, "OOBLECK_FAULT": f"node=1,step={kill_step},phase=backward",
           "OOBLECK_FAULT_LOG": f"{tmp}/ours/kill.jsonl"}
    os.makedirs(f"{tmp}/ours", exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", f"--oobleck-local-nodes={nodes}",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp}/ours/logs",
                           os.path.join(ROOT, "examples/gpt/train.py"), "--config", CONFIG, *sets],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"oobleck run failed:\n{proc.stdout}\n{proc.stderr}")
    kill = _records(f"{tmp}/ours/kill.jsonl")[0]
    log = _records(f"{tmp}/ours/metrics.jsonl")
    # the first step of the new generation (a step of the old one may finish just after the kill)
    after = [r for r in log if "step" in r and "event" not in r and r["time"] > kill["time"] and r["generation"] > 0]
    recovery = [r for r in log if r.get("event") == "recovery"][0]
    phases = {"detect": recovery["failed_at"] - kill["time"], **recovery["phases_s"],
              "replay": after[0]["step_time_s"]}
    return {"recover_s": after[0]["time"] - kill["time"], "lost_steps": kill["step"] - after[0]["step"],
            "recovery": recovery, "phases": phases}


def _records_or_empty(path):
    return _records(path) if os.path.exists(path) else []


def run_torchrun(tmp: str, nodes: int, steps: int, kill_step: int, *, min_nodes: int | None = None,
                 restart: bool = False, share_store: bool = True, killed: int = 1,
                 rdzv_conf: str = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
                 patience: float = 180.0) -> dict:
    work = f"{tmp}/torchrun"
    os.makedirs(work, exist_ok=True)
    port = _free_port()
    procs = []
    env_extra = {} if share_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def start(node: int) -> None:
        env = {**os.environ, **env_extra, "BENCH_DIR": work, "BENCH_NODE": str(node), "OMP_NUM_THREADS": "1",
               "BENCH_KILL": f"{killed},{kill_step}"}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={min_nodes or nodes}:{nodes}",
               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=bench", f"--rdzv-conf=is_host={int(node == 0)},{rdzv_conf}",
               "--max-restarts=3", "--monitor-interval=0.1", os.path.join(ROOT, "benchmarks/torchrun_baseline.py"),
               "--config", CONFIG, "--set", f"train.steps={steps}", "--set", "train.global_batch_size=60"]
        log = open(f"{work}/node{node}-{len(procs)}.log", "w")  # noqa: SIM115
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))

    try:
        for node in range(nodes):
            start(node)
        deadline = time.time() + 300
        while not os.path.exists(f"{work}/killed"):
            if time.time() > deadline or all(p.poll() is not None for p, _ in procs):
                raise RuntimeError("never reached the kill")
            time.sleep(0.05)
        if restart:
            procs[killed][0].wait(timeout=30)
            start(killed)
        kill = json.load(open(f"{work}/killed"))
        deadline = time.time() + patience
        after = []
        while time.time() < deadline and not after:
            after = [r for r in _records_or_empty(f"{work}/steps.jsonl") if r["started"] > kill["time"]]
            time.sleep(0.1)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.close()
    if not after:
        errors = set()
        for name in os.listdir(work):
            if name.endswith(".log"):
                with open(os.path.join(work, name)) as f:
                    errors |= {line.strip()[:160] for line in f if "Error" in line}
        return {"recover_s": None, "lost_steps": None,
                "failure": f"no step completed within {patience:.0f} s of the kill: " + " | ".join(sorted(errors)[:6])}
    return {"recover_s": after[0]["time"] - kill["time"], "lost_steps": kill["step"] - after[0]["step"],
            "world": after[0]["world"]}


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
    times = [queue.get(timeout=120) for _ in range(3)]
    for p in procs:
        p.join(60)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-step", type=int, default=17)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_ours(tmp, args.nodes, args.steps, args.kill_step)
        base = run_torchrun(tmp, args.nodes, args.steps, args.kill_step)
    rec = ours["recovery"]
    print(f"{args.nodes} local nodes, GPT example, a node SIGKILLed at step {args.kill_step} (0-based)")
    print(f"  oobleck_elastic: kill -> next completed step {ours['recover_s']:6.2f} s, steps lost "
          f"{ours['lost_steps']} (the interrupted step is replayed)")
    if base["recover_s"] is None:
        print(f"  stock torchrun:  did not recover: {base['failure']}")
    else:
        print(f"  stock torchrun:  kill -> next completed step {base['recover_s']:6.2f} s, steps lost "
              f"{base['lost_steps']} (restart of every worker, checkpoint every 5 steps)")
        print(f"  ratio torchrun/oobleck: {base['recover_s'] / ours['recover_s']:.1f}x (goal >= 10x, ours < 1 s)")
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
