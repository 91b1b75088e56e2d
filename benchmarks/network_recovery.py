"""Recovery from the failures real networks have, on hosts of their own (needs root).

    python benchmarks/network_recovery.py [--runs 5] [--kinds kill,poweroff,hang,partition]

Four hosts, each a network namespace (oobleck_elastic/testing/netbed.py, Note: [test bed]),
etcd on a store host of its own, the float64 GPT example under the default timeouts, one
launcher per host: `python -m oobleck_elastic.launch` and, separately, stock `torchrun
--rdzv-backend=oobleck`. After step 3 is logged, host 2 fails from outside:

    kill       every process of the host SIGKILLed (the kernel resets its connections: the control)
    poweroff   the host's links down, then its processes SIGKILLed (nothing reaches anyone)
    hang       every process of the host stopped for 4 s, then woken
    partition  the host's links down for 4 s, its processes alive, then up again

For each it prints the time from the injection to the first step completed by the next
generation (median of --runs, with the range) and the steps redone. Stock torchrun's own
restart after a kill is measured by benchmarks/recovery.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from oobleck_elastic.testing.netbed import Bed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples/gpt/train.py")
CONFIG = os.path.join(ROOT, "examples/gpt/config.yaml")
HOSTS, VICTIM, PORT, OUT_S = 4, 2, 2379, 4.0
KINDS = ("kill", "poweroff", "hang", "partition")


def _job(work: str) -> list[str]:
    return [SCRIPT, "--config", CONFIG, "--set", "train.steps=12", "--set", "train.dtype=float64",
            "--set", "planner.memory_per_worker=16MB", "--set", f"planner.profile_dir={work}/../profiles",
            "--set", f"monitoring.metrics_path={work}/metrics.jsonl", "--set", f"monitoring.tensorboard_dir={work}/tb",
            "--set", "checkpoint.interval=0", "--set", f"checkpoint.dir={work}/checkpoints"]


def _launcher(kind: str, endpoint: str) -> list[str]:
    flags = [f"--nnodes={HOSTS}", "--nproc-per-node=1", f"--rdzv-endpoint={endpoint}", "--rdzv-conf=store=etcd",
             "--rdzv-id=bench"]
    if kind == "ours":
        return [sys.executable, "-m", "oobleck_elastic.launch", *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=oobleck", "--monitor-interval=0.1", *flags]


def _records(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _inject(bed: Bed, failure: str) -> None:
    host = bed.hosts[VICTIM]
    if failure == "kill":
        for pid in bed.pids(host):
            os.kill(pid, 9)
    elif failure == "poweroff":
        bed.poweroff(host)
    elif failure == "hang":
        stopped = bed.stop(host)
        time.sleep(OUT_S)
        bed.cont(stopped)
    else:
        bed.link(host, up=False)
        time.sleep(OUT_S)
        bed.link(host, up=True)


def one_run(work: str, launcher: str, failure: str) -> tuple[float, int]:
    """(injection -> first step of the next generation, steps redone) of one run."""
    os.makedirs(work)
    with Bed(HOSTS) as bed:
        url = f"http://{bed.store.address('store')}:{PORT}"
        etcd = bed.popen(bed.store, ["etcd", "--enable-v2=true", "--name", "b", "--data-dir", f"{work}/etcd",
                                     "--listen-client-urls", url, "--advertise-client-urls", url,
                                     "--listen-peer-urls", "http://127.0.0.1:2380",
                                     "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                                     "--initial-cluster", "b=http://127.0.0.1:2380"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs = []
        try:
            endpoint = f"{bed.store.address('store')}:{PORT}"
            for k in range(HOSTS):
                with open(f"{work}/host{k}.log", "w") as log:
                    procs.append(bed.popen(bed.hosts[k], [*_launcher(launcher, endpoint), *_job(work)], cwd=ROOT,
                                           env=Bed.env({**os.environ, "OMP_NUM_THREADS": "1"}), stdout=log,
                                           stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 300
            while not any(r.get("step") == 3 and "event" not in r for r in _records(f"{work}/metrics.jsonl")):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit(f"{launcher} never got going; logs in {work}")
                time.sleep(0.05)
            at = time.time()
            _inject(bed, failure)
            for p in procs:
                p.wait(timeout=300)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            etcd.kill()
    log = _records(f"{work}/metrics.jsonl")
    steps = [r for r in log if "step" in r and "event" not in r]
    before = max(r["step"] for r in steps if r["time"] <= at)
    after = [r for r in steps if r["time"] > at and r["generation"] > 0]
    if not after or not any(r.get("event") == "final" for r in log):
        raise SystemExit(f"{launcher} did not recover from {failure}; logs in {work}")
    return after[0]["time"] - at, before + 1 - after[0]["step"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--kinds", default=",".join(KINDS))
    args = p.parse_args()
    Bed.check()
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        p.error(f"--kinds takes {', '.join(KINDS)}")
    print(f"{HOSTS} hosts (network namespaces), etcd on a host of its own, GPT example (float64), default "
          f"timeouts; host {VICTIM} fails after step 3; {args.runs} run(s) each")
    with tempfile.TemporaryDirectory() as tmp:
        for failure in kinds:
            for launcher in ("ours", "torchrun"):
                runs = [one_run(f"{tmp}/{failure}-{launcher}-{i}", launcher, failure) for i in range(args.runs)]
                times = [t for t, _ in runs]
                name = "oobleck_elastic.launch" if launcher == "ours" else "torchrun --rdzv-backend=oobleck"
                print(f"  {failure:9s} {name:32s} injection -> next step {statistics.median(times):5.2f} s "
                      f"(median; {min(times):.2f}-{max(times):.2f}), steps redone {max(r for _, r in runs)}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
