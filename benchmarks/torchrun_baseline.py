"""The stock-torchrun side of benchmarks/recovery.py: the GPT example trained data-parallel
under torchrun (c10d rendezvous, --max-restarts), with a checkpoint every few steps. When a node
dies, torchrun restarts every worker of every node and they resume from the last checkpoint:
the behaviour oobleck_elastic replaces.

Each worker holds the whole model; the global batch is split over the ranks; gradients are
all-reduced. Env: BENCH_DIR (checkpoints, step log), BENCH_KILL="node,step" (this node SIGKILLs
itself, agent included, when it reaches that step), BENCH_NODE (this torchrun's node tag).
Rank 0 logs each step to BENCH_DIR/steps.jsonl with the time its worker process started, which
tells the restarted workers' steps from a step of the old ones that ends just after the kill.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from examples.gpt.data import SyntheticTokens  # noqa: E402
from examples.gpt.model import gpt_model, parse_gpt_config  # noqa: E402
from oobleck_elastic.config import load_config  # noqa: E402
from oobleck_elastic.runtime.data import SampleOrder  # noqa: E402
from oobleck_elastic.runtime.model import materialize_layer  # noqa: E402


def main() -> int:
    started = time.time()
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--checkpoint-every", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config, args.set)
    gpt = parse_gpt_config(cfg.model)
    spec = gpt_model(gpt)
    data = SyntheticTokens(gpt, seed=cfg.train.seed)
    order = SampleOrder(len(data), cfg.train.seed)
    root = os.environ["BENCH_DIR"]
    kill_node, kill_step = (int(x) for x in os.environ.get("BENCH_KILL", "-1,-1").split(","))
    node = int(os.environ.get("BENCH_NODE", "-1"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Sequential(*(materialize_layer(spec, i, seed=cfg.train.seed, dtype=torch.float32)
                                  for i in range(spec.num_layers)))
    opt = torch.optim.AdamW(model.parameters(), **dict(cfg.train.optimizer.kwargs))
    start = 0
    ckpt = os.path.join(root, "checkpoint.pt")
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    batch = cfg.train.global_batch_size
    share = batch // world
    for step in range(start, cfg.train.steps):
        if node == kill_node and step == kill_step and not os.path.exists(os.path.join(root, "killed")):
            with open(os.path.join(root, "killed"), "w") as f:
                json.dump({"time": time.time(), "step": step}, f)
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = data.batch(order.indices(step, batch, rank * share, (rank + 1) * share))
        loss = spec.loss(model(x), y) / batch
        loss.backward()
        grads = [q.grad for q in model.parameters()]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for g, v in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(v)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            with open(os.path.join(root, "steps.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), "world": world,
                                    "started": started}) + "\n")
            if (step + 1) % args.checkpoint_every == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1},
                           ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
