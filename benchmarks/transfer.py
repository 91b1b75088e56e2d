"""Layer-state transfer against a raw gloo send/recv of the same bytes, on large layers.

    python benchmarks/transfer.py [--d-model 1024] [--layers 2] [--repeats 3]

Two processes on gloo (loopback). Rank 0 holds `--layers` blocks of the GPT example
(d_model `--d-model`: about 144 d_model^2 bytes of parameters and AdamW state each, 151 MB at
1024) after one optimizer step; rank 1 holds none. For each repeat, rank 1 drops its copies and
`run_transfers` (the runtime's own transfer phase: materialise the layer, prime its optimizer,
receive, copy in) brings them over, timed on rank 1 from a barrier; then a raw `dist.send` /
`dist.recv` of one buffer of the same number of bytes is timed the same way. Prints the best
of each and the ratio raw/ours (>= 0.8 on >= 200 MB). Also checks that the copies are
bit-identical to the source.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Plan:
    """The one thing run_transfers asks of a generation plan: each worker's rank."""

    def rank_of(self, worker) -> int:
        return worker.node


def _worker(rank: int, port: int, args, queue) -> None:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist

    from examples.gpt.model import GPTConfig, gpt_model
    from oobleck_elastic.config import load_config
    from oobleck_elastic.planning import Transfer, WorkerRef
    from oobleck_elastic.runtime.layers import LayerStore
    from oobleck_elastic.runtime.transfer import run_transfers

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    spec = gpt_model(GPTConfig(vocab_size=128, seq_len=16, d_model=args.d_model, n_heads=8, n_layers=args.layers))
    train = load_config(None, []).train
    layers = LayerStore(spec, train, torch.device("cpu"))
    blocks = range(1, args.layers + 1)
    if rank == 0:
        for i in blocks:
            state = layers.materialize(i)
            for p in state.params:
                p.grad = torch.randn_like(p)
            state.optimizer.step()
    src, dst = WorkerRef(0, 0), WorkerRef(1, 0)
    transfers = [Transfer(layer=i, src=src, dst=dst, bytes=0) for i in blocks]
    timeout = datetime.timedelta(seconds=300)
    ours, raw, moved = [], [], 0
    for _ in range(args.repeats):
        if rank == 1:
            layers.keep_only([])
        dist.barrier()
        start = time.perf_counter()
        moved = run_transfers(transfers, _Plan(), WorkerRef(rank, 0), layers, stepped=True, timeout=timeout)
        ours.append(time.perf_counter() - start)
        buf = torch.empty(moved // 4, dtype=torch.float32)
        dist.barrier()
        start = time.perf_counter()
        dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
        raw.append(time.perf_counter() - start)
        del buf
    # the copies are bit-identical to the source
    sums = torch.tensor([float(t.detach().double().sum()) for i in blocks for t in layers[i].state_tensors()],
                        dtype=torch.float64)
    theirs = sums.clone()
    dist.broadcast(theirs, 0)
    if rank == 1:
        queue.put((moved, min(ours), min(raw), bool(torch.equal(sums, theirs))))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2, help="blocks moved (each ~144 d_model^2 bytes)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        moved, ours, raw, equal = queue.get(timeout=900)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    print(f"{args.layers} GPT blocks of d_model {args.d_model}: {moved / 1e6:.0f} MB of layer state moved "
          f"(best of {args.repeats})")
    print(f"  run_transfers (materialise, prime, receive, copy in): {ours * 1e3:8.1f} ms "
          f"({moved / ours / 2**20:.0f} MiB/s)")
    print(f"  raw gloo send/recv of the same bytes:                  {raw * 1e3:8.1f} ms "
          f"({moved / raw / 2**20:.0f} MiB/s)")
    print(f"  ratio raw/ours: {raw / ours:.2f} (goal >= 0.8); copies bit-identical: {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
