"""Runtime overhead: our generation/trainer against a plain torch.distributed.pipelining loop.

    python benchmarks/runtime.py [--steps 12] [--workers 4] [--bandwidth GB/s]

Both run in the same worker processes, alternating rounds, on the same homogeneous layouts of
the GPT example (2 pipelines x W/2 stages, and 1 pipeline x W stages): the baseline is
Schedule1F1B plus one all-reduce of each stage's flattened gradients across the pipelines and
one AdamW per stage.
Prints the median steady-state step time of each and their ratio, the median of the rounds'
ratios (goal: ours within 5%). It also measures the link between two worker processes
(bandwidth: a gloo all-reduce of the model's gradients; latency: a gloo exchange of one
activation each way, as torch's schedule pairs its sends and receives, between workers that
compute between exchanges: Note: [latency under load] at measure_latency_us), plans
heterogeneous layouts and prints, for every layout, the measured step time beside the cost
model's estimate (pipeline schedule with its exchanges + gradient all-reduce across pipelines
+ optimizer step) and the error. The estimate re-times each
layout's split with profiles (forward, backward and optimizer step per layer) that the workers
take at the start of every round, --workers of them at once: this shared machine's speed
drifts by 15% and more between minutes, and workers computing at once share its memory
bandwidth, so a profile taken alone before the run is not the machine the steps ran on.
The goals hold where each worker has a core of its own: with more workers than cores they
take turns on the cores, which no cost model of a GPU cluster predicts, so the verdict line
counts only the layouts that fit this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from examples.gpt.data import SyntheticTokens  # noqa: E402
from examples.gpt.model import GPTConfig, gpt_model  # noqa: E402

MODEL = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=6, dataset_size=4096)
OVERRIDES = ["train.global_batch_size=64", "train.microbatch_size=4", "planner.memory_per_worker=1GB",
             "elastic.collective_timeout_s=600", "elastic.lease_timeout_s=650", "elastic.agreement_timeout_s=700"]


def _cfg(steps):
    from oobleck_elastic.config import load_config

    return load_config(None, [*OVERRIDES, f"train.steps={steps}"])


def _baseline_steps(rank, pipelines, cfg, spec, data, steps, timeout):
    """Plain pipelining: the reference implementation the runtime is measured against."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from oobleck_elastic.runtime.data import SampleOrder
    from oobleck_elastic.runtime.model import materialize_layer

    stages = len(pipelines[0])
    p, s = divmod(rank, stages)
    per = spec.num_layers // stages
    bounds = [min(k * per, spec.num_layers) for k in range(stages)] + [spec.num_layers]
    pipe_groups = [dist.new_group(list(range(q * stages, (q + 1) * stages)), timeout=timeout)
                   for q in range(len(pipelines))]
    stage_groups = [dist.new_group([q * stages + k for q in range(len(pipelines))], timeout=timeout)
                    for k in range(stages)]
    module = torch.nn.Sequential(*(materialize_layer(spec, i, seed=0, dtype=torch.float32)
                                   for i in range(bounds[s], bounds[s + 1])))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    stage = PipelineStage(module, s, stages, torch.device("cpu"), group=pipe_groups[p])
    m = cfg.train.num_microbatches // len(pipelines)
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda o, t: spec.loss(o, t) / cfg.train.global_batch_size,
                         scale_grads=False)
    order = SampleOrder(len(data), 0)
    b = cfg.train.microbatch_size
    times = []
    for step in range(steps):
        start = time.perf_counter()
        x, y = data.batch(order.indices(step, cfg.train.global_batch_size, p * m * b, (p + 1) * m * b))
        if stages == 1:
            sched.step(x, target=y, losses=[])
        elif s == 0:
            sched.step(x)
        elif s == stages - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        grads = [q.grad for q in module.parameters()]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=stage_groups[s])
        for g, v in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(v)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    del sched, stage, pipe_groups, stage_groups
    return times


def _ours_steps(rank, plan, cfg, spec, data, steps, store):
    from oobleck_elastic.runtime.trainer import Trainer

    me = plan.members[rank]
    trainer = Trainer(model=spec, dataset=data, cfg=cfg, me=me, store=store)
    trainer.build(plan)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - start)
    trainer.close()
    return times


def _profile_together(rank, store, key, profilers, microbatch_size):
    """The model's profile on this worker, started with the other profiling workers: the
    workers of a layout compute at the same time and share this machine's memory bandwidth
    and caches, and the machine's speed drifts, so the profile is taken beside each round."""
    from oobleck_elastic.runtime.profiler import profile_model

    store.add(key, 1)
    deadline = time.monotonic() + 300
    while store.add(key, 0) < profilers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other profiling workers did not start within 300 s")
        time.sleep(0.01)
    return profile_model(gpt_model(MODEL), microbatch_size=microbatch_size, precision="fp32", iterations=10)


def _worker(rank, world, port, layouts, steps, rounds, profilers, queue):
    torch.set_num_threads(1)
    cfg = _cfg(steps)
    spec = gpt_model(MODEL)
    data = SyntheticTokens(MODEL, seed=0)
    # a rank left out of the smaller layouts waits in the store until a layout needs it again
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1200))
    timeout = datetime.timedelta(seconds=120)
    results = []
    runs = [run for r in range(rounds) for run in [("profile", None, r, "profile")] + [
        (name, plan, r, kind) for name, plan in layouts
        for kind in (("baseline", "ours") if name.endswith(" stages") else ("ours",))]]
    profiles = []
    for gen, (name, plan, r, kind) in enumerate(runs):
        if kind == "profile":
            if rank < profilers:
                profiles.append(_profile_together(rank, store, f"profile{r}", profilers, cfg.train.microbatch_size))
            continue
        if rank >= len(plan.members):
            continue  # layouts smaller than the process count leave the rest idle
        sub = dist.PrefixStore(f"bench{gen}", store)
        if kind == "baseline":
            dist.init_process_group("gloo", store=sub, rank=rank, world_size=len(plan.members), timeout=timeout)
            times = _baseline_steps(rank, [p.nodes for p in plan.instantiation.pipelines], cfg, spec, data,
                                    steps, timeout)
            dist.destroy_process_group()
        else:
            times = _ours_steps(rank, dataclasses.replace(plan, generation=gen), cfg, spec, data, steps, sub)
        results.append((name, kind, r, times[2:]))  # the first steps infer shapes
    queue.put((rank, results, profiles))


def _bandwidth_worker(rank, port, numel, queue):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("bandwidth", store), rank=rank, world_size=2)
    flat = torch.ones(numel)
    times = []
    for i in range(13):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        if i >= 3:  # the first ones connect and warm up
            times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    queue.put(statistics.median(times))


def mean_profile(profiles):
    """One profile whose layer times are the mean of these profiles' (same model and key)."""
    def mean(values):
        return sum(values) / len(values)

    layers = tuple(dataclasses.replace(layer, forward_ms=mean([q.layers[i].forward_ms for q in profiles]),
                                       backward_ms=mean([q.layers[i].backward_ms for q in profiles]),
                                       optimizer_ms=mean([q.layers[i].optimizer_ms for q in profiles]))
                   for i, layer in enumerate(profiles[0].layers))
    return dataclasses.replace(profiles[0], layers=layers)


def predicted_ms(plan, profile, cluster) -> tuple[float, float]:
    """The cost model's step for this layout, its templates' splits re-timed with `profile`, and
    the largest all-reduce + optimizer step of a stage in it."""
    from oobleck_elastic.planning import template_from_bounds

    inst, by_nodes = plan.instantiation, plan.templates.by_nodes()
    worst = tail = 0.0
    for pipeline in inst.pipelines:
        t = by_nodes[pipeline.template]
        again = template_from_bounds(profile, cluster, t.nodes, t.bounds(), t.microbatches, t.virtual_stages,
                                     t.pipelines)
        worst = max(worst, again.iteration_ms_at(pipeline.microbatches, len(inst.pipelines)))
        tail = max(tail, *again.tails(len(inst.pipelines)))
    return worst, tail


def _exchange_worker(rank, port, numel, queue):
    """Exchange timings between two processes: alone, and between busy ones (Note: [latency
    under load])."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("exchange", store), rank=rank, world_size=2)
    out, into = torch.ones(numel), torch.empty(numel)
    a = torch.randn(256, 256)

    def exchange():
        # torch's Schedule1F1B fuses a send with the next receive from the same neighbour
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, 1 - rank),
                                            dist.P2POp(dist.irecv, into, 1 - rank)]):
            work.wait()

    def compute():  # a few ms on one core, as a stage computes a microbatch between exchanges
        for _ in range(15):
            a @ a

    for _ in range(20):  # the first exchanges connect
        exchange()
    alone = []
    for _ in range(50):
        start = time.perf_counter()
        exchange()
        alone.append(time.perf_counter() - start)
    added = []  # what an exchange adds to a computing worker's time, paired against compute alone
    for _ in range(200):
        start = time.perf_counter()
        compute()
        busy = time.perf_counter() - start
        exchange()  # both start the next compute together
        start = time.perf_counter()
        compute()
        exchange()
        added.append(time.perf_counter() - start - busy)
    dist.destroy_process_group()
    queue.put((statistics.median(alone), statistics.median(added)))


def _two_workers(target, numel: int):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, server.port, numel, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results, deadline = [], time.monotonic() + 300
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # queue.Empty: fail fast if a worker died instead of waiting out the deadline
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a link-measuring worker failed (exit codes {dead}) or took over 300 s") from None
    for proc in procs:
        proc.join(60)
    return results


def measure_latency_us(message_bytes: int, bandwidth: float) -> tuple[float, float]:
    """The link latency (us) in the cost model's terms, less the message's bytes over
    `bandwidth` GB/s: (between busy processes, the one the model is given; alone, printed
    beside it). Note: [latency under load]
        A gloo exchange of one activation each way (as torch's schedule pairs them) between
        two processes doing nothing else takes ~0.1 ms here. Pipeline stages exchange between
        microbatches they compute, each on its own core, and on this machine gloo's transport
        threads then wait for a core: the same exchange, timed as what it adds to a few ms of
        computing on each side, costs ~1 ms, and a 2-stage pipeline's step spent 2-3 ms per
        microbatch outside its compute. Where the computing is on GPUs the CPUs are free and
        the two figures meet."""
    results = _two_workers(_exchange_worker, message_bytes // 4)
    transfer = message_bytes / (bandwidth * 1e9)
    busy = max(r[1] for r in results)
    alone = max(r[0] for r in results)
    return max(0.0, busy - transfer) * 1e6, max(0.0, alone - transfer) * 1e6


def measure_bandwidth(grad_bytes: int) -> float:
    """GB/s of a gloo all-reduce of `grad_bytes` between two processes on this machine, in the
    cost model's terms (ring form: with 2 participants each sends its bytes once): the link
    the benchmark's pipelines really have, where the planner's default assumes a 100 Gb/s
    network."""
    return grad_bytes / max(_two_workers(_bandwidth_worker, grad_bytes // 4)) / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=4 if (os.cpu_count() or 1) >= 4 else 2,
                   help="even: 2 pipelines of workers/2 stages (default: 4, or 2 on a machine with fewer "
                        "than 4 cores, so each worker has a core of its own)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="GB/s between workers for the cost model (default: measured here, a gloo all-reduce)")
    p.add_argument("--latency-us", type=float, default=None,
                   help="link latency between workers for the cost model (default: measured here, a gloo "
                        "exchange of one activation each way between busy workers, less its bytes over "
                        "the bandwidth)")
    args = p.parse_args()
    from oobleck_elastic.planning import build_instantiation, plan_templates
    from oobleck_elastic.planning.job import make_cluster
    from oobleck_elastic.runtime.plan import GenerationPlan
    from oobleck_elastic.runtime.profiler import profile_model

    cfg = _cfg(args.steps)
    spec = gpt_model(MODEL)
    torch.set_num_threads(1)  # as each worker runs
    # for the splits only: the predictions use the profiles the workers take beside each round
    profile = profile_model(spec, microbatch_size=cfg.train.microbatch_size, precision="fp32", iterations=10)
    bandwidth = (args.bandwidth if args.bandwidth is not None else
                 measure_bandwidth(sum(layer.grad_bytes for layer in profile.layers)))
    latency, alone = ((args.latency_us, None) if args.latency_us is not None else
                      measure_latency_us(max(layer.output_bytes for layer in profile.layers), bandwidth))
    cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, inter_node_bandwidth=bandwidth,
                                                               link_latency_us=latency))
    cluster = make_cluster(cfg.planner, profile, 1)
    ts = plan_templates(profile, cluster, max_nodes=args.workers + 2, fault_tolerance=0,
                        total_microbatches=cfg.train.num_microbatches)
    half = args.workers // 2

    def layout(sizes, templates=ts):
        nodes, start = [], 0
        for size in sizes:
            nodes.append(list(range(start, start + size)))
            start += size
        inst = build_instantiation([templates.get(n) for n in sizes], nodes, cfg.train.global_batch_size,
                                   cfg.train.microbatch_size)
        return GenerationPlan(generation=0, start_step=0, workers_per_node=1, instantiation=inst, templates=templates)

    from oobleck_elastic.planning import template_from_bounds

    def even(stages):
        """The baseline splits layers evenly; ours gets the same split so only the runtime differs."""
        bounds = [k * (spec.num_layers // stages) for k in range(stages)] + [spec.num_layers]
        same = template_from_bounds(profile, cluster, stages, bounds, ts.get(stages).microbatches)
        return dataclasses.replace(ts, templates=tuple(same if t.nodes == stages else t for t in ts.templates))

    compared = [(f"2 x {half} stages", layout([half, half], even(half))),
                (f"1 x {args.workers} stages", layout([args.workers], even(args.workers)))]
    # 1+1 and 2 use no more workers than this machine's 2 cores: the cost model's own conditions
    hetero = [("pipelines " + "+".join(map(str, sizes)), layout(sizes))
              for sizes in ([1, 1], [2], [2, 3], [1, 2, 3]) if sum(sizes) <= 6]
    layouts = [*compared, *hetero]
    world = max(len(pl.members) for _, pl in layouts)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=1200))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, server.port, layouts, args.steps, args.rounds,
                                                     args.workers, queue))
             for r in range(world)]
    for proc in procs:
        proc.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # queue.Empty: fail fast if a worker died instead of waiting forever
            dead = [p_.exitcode for p_ in procs if p_.exitcode not in (None, 0)]
            if dead:
                for p_ in procs:
                    p_.kill()
                raise SystemExit(f"a benchmark worker failed (exit codes {dead})") from None
    for proc in procs:
        proc.join(60)
    # a step's time is the slowest rank's
    by_key: dict[tuple[str, str, int], list[list[float]]] = {}
    for _, rows, _ in results:
        for name, kind, r, times in rows:
            by_key.setdefault((name, kind, r), []).append(times)
    step_times = {k: [max(ts_) for ts_ in zip(*v)] for k, v in by_key.items()}
    med = {}
    for (name, kind, _), times in step_times.items():
        med.setdefault((name, kind), []).extend(times)
    print(f"steady state against plain pipelining + one all-reduce per stage, {args.rounds} alternating "
          f"rounds x {args.steps - 2} steps (ratio: the median of the rounds' ratios, each of a round's "
          f"medians, so the machine's drift between rounds cancels):")
    for name, _ in compared:
        base = statistics.median(med[(name, "baseline")])
        ours = statistics.median(med[(name, "ours")])
        ratios = [statistics.median(step_times[(name, "ours", r)])
                  / statistics.median(step_times[(name, "baseline", r)])
                  for r in range(args.rounds)]
        print(f"  {name:18s} baseline {base * 1e3:8.1f} ms/step, ours {ours * 1e3:8.1f} ms/step, "
              f"ratio ours/baseline {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}; "
              f"goal <= 1.05)")
    bandwidth_from = 'given' if args.bandwidth is not None else 'measured: gloo all-reduce here'
    latency_from = ('given' if alone is None
                    else f'measured: gloo exchange between busy workers here; {alone:.0f} us between idle ones')
    print(f"cost model (pipelines, gradient all-reduce over {cfg.planner.inter_node_bandwidth:.2f} GB/s "
          f"({bandwidth_from}), link latency "
          f"{cfg.planner.link_latency_us:.0f} us ({latency_from}), "
          f"optimizer step) against measured, {os.cpu_count()} cores for up to {world} workers:")
    taken = [q for _, _, profiles in results for q in profiles]
    beside = mean_profile(taken)
    print(f"  profile: the mean of {len(taken)} taken by {args.workers} workers at once beside the rounds, "
          f"{sum(x.compute_ms for x in beside.layers):.1f} ms forward + backward per microbatch "
          f"(one process alone before the run: {sum(x.compute_ms for x in profile.layers):.1f} ms)")
    errors, fair = [], []
    for name, plan in layouts:
        measured = statistics.median(med[(name, "ours")]) * 1e3
        predicted, tail = predicted_ms(plan, beside, cluster)
        errors.append(abs(predicted - measured) / measured)
        workers = len(plan.members)
        print(f"  {name:18s} {workers} workers: measured {measured:8.1f} ms/step, predicted {predicted:8.1f} ms "
              f"(all-reduce + optimizer up to {tail:5.2f} ms), error {100 * (predicted - measured) / measured:+6.1f}%")
        if workers <= (os.cpu_count() or 1):
            fair.append(abs(predicted - measured) / measured)
    print(f"  largest error {100 * max(errors):.1f}%; where workers <= cores: "
          f"{100 * max(fair):.1f}% (goal: 15% with at least as many cores as workers)" if fair else
          f"  largest error {100 * max(errors):.1f}% (goal: 15% with at least as many cores as workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
