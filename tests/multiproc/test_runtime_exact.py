"""Heterogeneous pipelines train exactly like one process on the whole batch (float64)."""

from __future__ import annotations

import torch
from runtime_harness import Phase, reference, run_job


def assert_same_weights(results, expected, rtol=1e-10):
    seen = set()
    for result in results.values():
        for layer, state in result["state"].items():
            seen.add(layer)
            for name, value in state.items():
                want = expected[layer][name]
                err = (value - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                assert err <= rtol, f"layer {layer} {name}: relative error {err:.3e}"
    assert seen == set(expected), "every layer is held somewhere"


def assert_all_reduces_overlapped(results):
    """Every replica set's all-reduce was issued during the schedule, once the last backward
    had run on the stages holding it (runtime.generation Note: [gradient overlap])."""
    records = [r for res in results.values() for r in res["records"]]
    assert records and all(r["replica_sets"] > 0 for r in records)
    assert [r for r in records if r["overlapped"] != r["replica_sets"]] == []


def test_two_heterogeneous_pipelines_match_reference(tmp_path):
    results = run_job([Phase(pipelines=((0, 1), (2, 3, 4)), steps=4)], tmp_path)
    assert_same_weights(results, reference(4))
    records = [r for res in results.values() for r in res["records"]]
    for step in range(4):
        consumed = [i for r in records if r["step"] == step for i in r["consumed"]]
        assert len(consumed) == 24 and len(set(consumed)) == 24, "each sample exactly once"
    assert_all_reduces_overlapped(results)


def test_three_pipelines_including_a_single_stage_one(tmp_path):
    results = run_job([Phase(pipelines=((0, 1, 2), (3,), (4, 5)), steps=3)], tmp_path)
    assert_same_weights(results, reference(3))


def test_rebuilt_into_a_different_layout_halfway(tmp_path):
    # 5 workers as 2 + 3, then 6 workers as 3 + 2 + 1 in the same processes: the new worker
    # and every moved stage receive their layers (parameters and AdamW state) by transfer.
    phases = [Phase(pipelines=((0, 1), (2, 3, 4)), steps=2),
              Phase(pipelines=((0, 1, 2), (3, 4), (5,)), steps=2)]
    results = run_job(phases, tmp_path)
    assert_same_weights(results, reference(4))
    # replicas, including the ones rebuilt from transfers, are bit-identical to each other
    by_layer = {}
    for res in results.values():
        for layer, state in res["state"].items():
            by_layer.setdefault(layer, []).append(state)
    assert any(len(v) > 1 for v in by_layer.values())
    for layer, states in by_layer.items():
        for other in states[1:]:
            assert all(torch.equal(states[0][k], other[k]) for k in states[0]), f"layer {layer} replicas differ"
    steps = sorted({r["step"] for res in results.values() for r in res["records"]})
    assert steps == [0, 1, 2, 3]
    for step in steps:
        consumed = [i for res in results.values() for r in res["records"] if r["step"] == step for i in r["consumed"]]
        assert sorted(consumed) == sorted(set(consumed)) and len(consumed) == 24


def test_gradient_clipping_and_gpipe_match_reference(tmp_path):
    overrides = ["train.grad_clip_norm=0.05", "train.schedule=GPipe",
                 "train.lr_schedule.kind=cosine", "train.lr_schedule.warmup_steps=1", "train.steps=3"]
    results = run_job([Phase(pipelines=((0, 1), (2, 3, 4)), steps=3)], tmp_path, overrides)
    clipped = reference(3, overrides)
    assert_same_weights(results, clipped)
    assert_all_reduces_overlapped(results)
    # the clip was active: without it the weights differ by far more than the tolerance
    unclipped = reference(3, [o for o in overrides if "grad_clip" not in o])
    diff = max((clipped[i][k] - unclipped[i][k]).abs().max().item() for i in clipped for k in clipped[i])
    assert diff > 1e-4


def test_interleaved_schedule_matches_reference(tmp_path):
    # Interleaved1F1B with 2 stages per worker: 2 + 3 workers (4 and 6 stages, a worker holds
    # two non-contiguous layer ranges), rebuilt as 3 + 1 + 1 (single-worker pipelines run both
    # of their stages locally) with the transfers the planner computes.
    overrides = ["train.schedule=Interleaved1F1B", "train.virtual_stages=2"]
    phases = [Phase(pipelines=((0, 1), (2, 3, 4)), steps=2), Phase(pipelines=((2, 3, 4), (0,), (1,)), steps=2)]
    results = run_job(phases, tmp_path, overrides)
    assert_same_weights(results, reference(4, overrides))
    held = {n: sorted(res["state"]) for n, res in results.items()}
    assert held[2] == [0, 3] and held[0] == list(range(6)), held  # stages 0 and 3 of 6 on the first worker
    assert_all_reduces_overlapped(results)
    for step in range(4):
        consumed = [i for res in results.values() for r in res["records"] if r["step"] == step for i in r["consumed"]]
        assert sorted(consumed) == sorted(set(consumed)) and len(consumed) == 24


def _replay_with_dropout(rank, port, queue):
    import datetime

    from runtime_harness import job_config, plans_for

    from examples.gpt.data import SyntheticTokens
    from examples.gpt.model import GPTConfig, gpt_model
    from oobleck_elastic.planning import WorkerRef
    from oobleck_elastic.runtime.trainer import Trainer

    torch.set_num_threads(1)
    model = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, dropout=0.3, dataset_size=64)
    spec, data = gpt_model(model), SyntheticTokens(model, seed=0)
    cfg = job_config()
    store = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=True,
                                       timeout=datetime.timedelta(seconds=60))
    _, plans = plans_for([Phase(((0,),), 2)], spec.num_layers, cfg.train.global_batch_size,
                         cfg.train.microbatch_size)
    trainer = Trainer(model=spec, dataset=data, cfg=cfg, me=WorkerRef(0, 0), store=store)
    trainer.build(plans[0])

    def grads():
        return [g.clone() for i in trainer.generation.held_layers() for g in trainer.layers[i].grads()]

    first = trainer.compute()
    first_grads = grads()
    trainer.discard()
    torch.rand(1000)  # anything else in the worker may have drawn from the global generator meanwhile
    again = trainer.compute()
    same = all(torch.equal(a, b) for a, b in zip(first_grads, grads()))
    trainer.apply(again)
    trainer.shutdown()
    queue.put((rank, first.stats.loss, again.stats.loss, same))


def test_a_replayed_step_draws_the_same_dropout_masks():
    """A step is seeded per step and worker (trainer.compute), so a step replayed after a failed
    commit computes the same loss and gradients bit for bit even with dropout, whatever the
    global generator drew meanwhile."""
    from runtime_harness import free_port, spawn_ranks

    ((_, loss, replayed, same_grads),) = spawn_ranks(_replay_with_dropout, 1, free_port())
    assert loss == replayed and same_grads
