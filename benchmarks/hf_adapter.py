"""What the Hugging Face adapter costs: tokens/s of GPT-2 through `hf_model` against the GPT
example's layer list, and against the same HF GPT-2 blocks in a hand-written layer list.

    python benchmarks/hf_adapter.py [--steps 6] [--rounds 5] [--tied] [--activation gelu_new]

Three models of one size (benchmarks/runtime.py's MODEL: width 128, 6 blocks, 4 heads, vocab
256, 64 tokens, MLP 4x, dropout 0; GPT-2 untied unless --tied, so the parameter counts match):
`gpt` is examples/gpt's layer list (its own Block, not GPT2Block's code); `hf` is hf_model() on
a save_pretrained directory, the adapter under test; `hf-direct` is transformers' GPT2Block
called as GPT2Model calls it under SDPA (no mask tensor, causal by is_causal) in a layer list of
ours, so hf/hf-direct isolates what the adapter adds. GPT-2's activation is exact GELU here, as
examples/gpt's nn.GELU; stock GPT-2's `gelu_new` (a tanh GELU of several elementwise ops, ~20%
slower per block on CPU) is `--activation gelu_new`, and then hf/gpt measures transformers' block.

All run on our runtime, same layout (2 pipelines x 2 stages, 4 worker processes, the same even
layer split), in the same processes, in rounds that rotate the order so machine noise hits all
three. A step's wall time is the slowest rank's, its CPU time the sum over ranks (much less
sensitive to other load on the machine); the first 2 steps of each round are dropped. Printed:
median tokens/s and tokens per CPU-second, and each ratio as the median over rounds of that
round's ratio, with its range (goal: hf/gpt >= 0.97).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.runtime import MODEL, _cfg  # noqa: E402
from examples.gpt.data import SyntheticTokens  # noqa: E402
from examples.gpt.model import gpt_model  # noqa: E402

VARIANTS = ("gpt", "hf", "hf-direct")
WORKERS, STAGES, WARMUP = 4, 2, 2


def _gpt2_config(tied: bool, activation: str):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=MODEL.vocab_size, n_positions=MODEL.seq_len, n_embd=MODEL.d_model,
                      n_layer=MODEL.n_layers, n_head=MODEL.n_heads, n_inner=MODEL.mlp_ratio * MODEL.d_model,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                      activation_function=activation, bos_token_id=0, eos_token_id=0)


class _Embed(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


def _specs(model_dir: str) -> dict:
    """The three variants' ModelSpecs (hf-direct: HF's GPT2Block modules, nothing of the adapter)."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from oobleck_elastic.models.hf import causal_lm_loss, hf_model
    from oobleck_elastic.models.sequential import sequential_model

    config = GPT2Config.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"  # what from_pretrained picks, and what hf_model sets
    n, d = config.n_layer, config.n_embd
    gpt = gpt_model(MODEL)
    head = lambda: nn.Sequential(nn.LayerNorm(d, eps=config.layer_norm_epsilon),  # noqa: E731
                                 nn.Linear(d, config.vocab_size, bias=False))
    direct = sequential_model(
        [lambda: _Embed(config), *(lambda i=i: GPT2Block(config, layer_idx=i) for i in range(n)), head],
        names=["embed", *(f"block{i}" for i in range(n)), "head"], loss=causal_lm_loss,
        sample_batch=gpt.sample_batch, name="hf-direct", vocab_size=config.vocab_size,
        shared=[("embed.wte.weight", "head.1.weight")] if config.tie_word_embeddings else [])
    return {"gpt": gpt, "hf": hf_model(model_dir, seq_len=MODEL.seq_len), "hf-direct": direct}


def _steps(rank, plan, cfg, spec, data, steps, store) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each step of one generation of our runtime."""
    from oobleck_elastic.runtime.trainer import Trainer

    trainer = Trainer(model=spec, dataset=data, cfg=cfg, me=plan.members[rank], store=store)
    trainer.build(plan)
    times = []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.step()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    trainer.close()
    return times[WARMUP:]  # the first steps infer shapes


def _worker(rank, port, plan, model_dir, steps, rounds, queue) -> None:
    torch.set_num_threads(1)
    cfg = _cfg(steps)
    specs = _specs(model_dir)
    data = SyntheticTokens(MODEL, seed=0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    results = []
    for r in range(rounds):
        for k in range(len(VARIANTS)):
            name = VARIANTS[(r + k) % len(VARIANTS)]  # rotate the order: no variant always goes first
            gen = r * len(VARIANTS) + k
            times = _steps(rank, dataclasses.replace(plan, generation=gen), cfg, specs[name], data, steps,
                           dist.PrefixStore(f"bench{gen}", store))
            results.append((name, r, times))
    queue.put(results)


def _even_plan(steps: int):
    """2 pipelines x 2 stages with the layers split evenly (the same plan for every variant)."""
    from oobleck_elastic.planning import build_instantiation, plan_templates, template_from_bounds
    from oobleck_elastic.planning.job import make_cluster
    from oobleck_elastic.runtime.plan import GenerationPlan
    from oobleck_elastic.runtime.profiler import profile_model

    cfg, spec = _cfg(steps), gpt_model(MODEL)
    profile = profile_model(spec, microbatch_size=cfg.train.microbatch_size, dtype="float32", iterations=2)
    cluster = make_cluster(cfg.planner, profile, 1)
    ts = plan_templates(profile, cluster, max_nodes=WORKERS, fault_tolerance=0,
                        total_microbatches=cfg.train.num_microbatches)
    even = template_from_bounds(profile, cluster, STAGES, [0, spec.num_layers // 2, spec.num_layers],
                                ts.get(STAGES).microbatches)
    ts = dataclasses.replace(ts, templates=tuple(even if t.nodes == STAGES else t for t in ts.templates))
    inst = build_instantiation([even, even], [[0, 1], [2, 3]], cfg.train.global_batch_size,
                               cfg.train.microbatch_size)
    return GenerationPlan(generation=0, start_step=0, workers_per_node=1, instantiation=inst, templates=ts)


def _run_workers(plan, model_dir: str, steps: int, rounds: int) -> list:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, server.port, plan, model_dir, steps, rounds, queue))
             for r in range(WORKERS)]
    for proc in procs:
        proc.start()
    results = []
    while len(results) < WORKERS:
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # queue.Empty: fail fast if a worker died instead of waiting forever
            if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a benchmark worker failed (exit codes {dead})") from None
    for proc in procs:
        proc.join(60)
    return results


def _per_round(results: list) -> dict[tuple[str, str], list[list[float]]]:
    """(variant, wall|cpu) -> per round, the step times (wall: slowest rank; cpu: sum of ranks)."""
    by_key: dict[tuple[str, int], list[list[tuple[float, float]]]] = {}
    for rows in results:
        for name, r, times in rows:
            by_key.setdefault((name, r), []).append(times)
    out: dict[tuple[str, str], list[list[float]]] = {}
    for (name, _), ranks in sorted(by_key.items(), key=lambda kv: kv[0][1]):
        steps = list(zip(*ranks))
        out.setdefault((name, "wall"), []).append([max(w for w, _ in s) for s in steps])
        out.setdefault((name, "cpu"), []).append([sum(c for _, c in s) for s in steps])
    return out


def _report(rounds: dict[tuple[str, str], list[list[float]]], tokens: int) -> None:
    for name in VARIANTS:
        wall = statistics.median(t for r in rounds[(name, "wall")] for t in r)
        cpu = statistics.median(t for r in rounds[(name, "cpu")] for t in r)
        print(f"  {name:<10} {tokens / wall:7.0f} tokens/s ({wall * 1e3:6.1f} ms/step), "
              f"{tokens / cpu:7.0f} tokens per CPU-second")
    for a, b, note in (("hf", "gpt", " (goal >= 0.97)"), ("hf", "hf-direct", " (the adapter alone)")):
        parts = []
        for kind in ("wall", "cpu"):
            per_round = [statistics.median(tb) / statistics.median(ta)  # a's rate over b's
                         for ta, tb in zip(rounds[(a, kind)], rounds[(b, kind)])]
            parts.append(f"{kind} {statistics.median(per_round):.3f} ({min(per_round):.3f}-{max(per_round):.3f})")
        print(f"  ratio {a}/{b}: {', '.join(parts)}{note}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help=f"steps per round and variant ({WARMUP} are warm-up)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tied", action="store_true", help="tie wte and lm_head as GPT-2 does (gpt stays untied)")
    p.add_argument("--activation", default="gelu", help="GPT-2's activation_function (stock GPT-2: gelu_new)")
    args = p.parse_args()
    if args.steps <= WARMUP:
        p.error(f"--steps must be > {WARMUP} (the first {WARMUP} of each round are warm-up)")
    from transformers import GPT2LMHeadModel

    plan = _even_plan(args.steps)
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        GPT2LMHeadModel(_gpt2_config(args.tied, args.activation)).save_pretrained(model_dir)
        results = _run_workers(plan, model_dir, args.steps, args.rounds)
    tokens = _cfg(args.steps).train.global_batch_size * MODEL.seq_len  # per step
    print(f"2 pipelines x {STAGES} stages, {WORKERS} workers, {args.rounds} rotating rounds x "
          f"{args.steps - WARMUP} steps, {tokens} tokens/step, GPT-2 {args.activation}, "
          f"head {'tied' if args.tied else 'untied'}; ratios: median over rounds (range):")
    _report(_per_round(results), tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
