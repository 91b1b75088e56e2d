"""Every node acts on the generation record that won the compare-and-set, whatever it proposed
itself: `Run.adopt` on its own, with the store and the build replaced by
recorders (the multi-process tests exercise the real ones)."""

from __future__ import annotations

import types

import pytest
from runtime_harness import templates_for

from oobleck_elastic.config import load_config
from oobleck_elastic.elastic.protocol import Fenced
from oobleck_elastic.elastic.records import GenerationRecord
from oobleck_elastic.elastic.run import Run
from oobleck_elastic.planning import WorkerRef, build_instantiation, layer_holders
from oobleck_elastic.planning.values import to_jsonable

TEMPLATES = templates_for(6, 6)
BASE = build_instantiation([TEMPLATES.get(2), TEMPLATES.get(3)], [(0, 1), (2, 3, 4)], 24, 2)
AFTER = build_instantiation([TEMPLATES.get(2), TEMPLATES.get(2)], [(0, 1), (2, 4)], 24, 2)


class Trainer:
    """The trainer's side of adopt(): which layers this worker holds."""

    def __init__(self, held, completed):
        self.held, self.completed_steps = tuple(held), completed

    def holds_layers(self):
        return bool(self.held)

    def keep_layers(self, keep):
        self.held = tuple(i for i in self.held if i in set(keep))


def run_for(node: int, held, completed: int) -> tuple[Run, list]:
    run = Run.__new__(Run)  # no store, no process group: only the decision is under test
    run.me, run.templates = WorkerRef(node, 0), TEMPLATES
    run.cfg = load_config(None, ["checkpoint.dir=ckpt", "train.global_batch_size=24", "train.microbatch_size=2"])
    run.trainer, run.records, run.last_transfers = Trainer(held, completed), {}, []
    run.checkpoints = types.SimpleNamespace(note_restored=lambda step: None)
    built = []
    run._enter = lambda record, transfers, restore_from, factor: built.append(
        {"generation": record.generation, "start": record.start_step, "nodes": record.instantiation.nodes,
         "transfers": transfers, "restore_from": restore_from})
    return run, built


def record(generation, inst, start, *, base=None, restored_from=None):
    """The record as read from the store: parsed from its JSON, as the protocol does."""
    return GenerationRecord.from_json(
        {"generation": generation, "nodes": list(inst.nodes), "start_step": start, "lost": [], "joined": [],
         "base": base, "restored_from": restored_from, "cause": "test", "actions": [],
         "instantiation": to_jsonable(inst)})


def test_an_in_memory_survivor_adopts_a_winning_restore_record():
    run, built = run_for(2, layer_holders(BASE, TEMPLATES)[WorkerRef(2, 0)], completed=5)
    run.adopt(record(3, AFTER, 4, restored_from=4))
    assert built == [{"generation": 3, "start": 4, "nodes": AFTER.nodes, "transfers": [], "restore_from": "ckpt"}]


def test_a_survivor_that_proposed_a_restore_adopts_a_winning_in_memory_record():
    run, built = run_for(2, layer_holders(BASE, TEMPLATES)[WorkerRef(2, 0)], completed=5)
    run.records[1] = record(1, BASE, 0)
    run.adopt(record(2, AFTER, 5, base=1))
    (build,) = built
    assert build["restore_from"] is None and build["start"] == 5 and build["transfers"], build
    assert all(t.src.node != 3 for t in build["transfers"]), "node 3 is gone: nothing comes from it"


def test_partial_copies_of_a_failed_build_are_dropped_for_the_records_base():
    base_held = layer_holders(BASE, TEMPLATES)[WorkerRef(0, 0)]
    run, built = run_for(0, (*base_held, 5), completed=5)  # layer 5: half-received in a failed build
    run.records[1] = record(1, BASE, 0)
    run.adopt(record(3, AFTER, 5, base=1))
    assert run.trainer.held == base_held and built


def test_a_worker_left_out_or_at_another_step_is_fenced():
    run, built = run_for(3, (0, 1), completed=5)
    with pytest.raises(Fenced, match="not a member of generation 2"):
        run.adopt(record(2, AFTER, 5, base=1))
    run, built = run_for(2, (0, 1), completed=4)
    run.records[1] = record(1, BASE, 0)
    with pytest.raises(Fenced, match="starts at step 5 but this worker has completed 4"):
        run.adopt(record(2, AFTER, 5, base=1))
    assert not built


def test_a_forged_or_damaged_record_is_refused_before_anything_acts_on_it():
    """A record read from the store is checked against the job first."""
    from oobleck_elastic.errors import OobleckError
    from oobleck_elastic.planning import Instantiation, PipelinePlan

    run, built = run_for(2, (0, 1), completed=5)
    run.records[1] = record(1, BASE, 0)
    short = Instantiation(pipelines=(PipelinePlan(template=2, nodes=(0, 1), microbatches=3, iteration_ms=1.0),
                                     PipelinePlan(template=2, nodes=(2, 4), microbatches=3, iteration_ms=1.0)),
                          global_batch_size=24, microbatch_size=2, iteration_ms=1.0)
    with pytest.raises(OobleckError, match="hold 12 samples, not the global batch of 24"):
        run.adopt(record(2, short, 5, base=1))
    twice = Instantiation(pipelines=(PipelinePlan(template=2, nodes=(0, 1), microbatches=6, iteration_ms=1.0),
                                     PipelinePlan(template=2, nodes=(1, 2), microbatches=6, iteration_ms=1.0)),
                          global_batch_size=24, microbatch_size=2, iteration_ms=1.0)
    with pytest.raises(OobleckError, match="not distinct node ids"):
        run.adopt(record(2, twice, 5, base=1))
    with pytest.raises(OobleckError, match="not an earlier generation"):
        run.adopt(record(2, AFTER, 5, base=7))
    with pytest.raises(OobleckError, match="not one this job wrote"):
        run.adopt(GenerationRecord.from_json({"generation": 2, "nodes": [0], "base": 1}))
    assert not built
