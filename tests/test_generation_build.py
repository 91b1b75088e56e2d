"""A generation whose process groups cannot all be made (a peer died while new_group ran)
leaves nothing behind: the default group is destroyed, so the next generation can start (the
chaos run found workers crashing with "trying to initialize the default process group twice")."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.planning import WorkerRef
from oobleck_elastic.runtime.trainer import Trainer
from runtime_harness import Phase, free_port, job_config, model_and_data, plans_for


def test_a_build_that_fails_while_making_groups_leaves_no_default_group(monkeypatch):
    torch.set_num_threads(1)
    cfg = job_config()
    spec, data = model_and_data("gpt")
    _, (plan,) = plans_for([Phase(pipelines=((0,),), steps=1)], spec.num_layers, cfg.train.global_batch_size,
                           cfg.train.microbatch_size)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    trainer = Trainer(model=spec, dataset=data, cfg=cfg, me=WorkerRef(0, 0), store=store)
    real_new_group = dist.new_group

    def peer_gone(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "new_group", peer_gone)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        trainer.build(plan)
    assert not dist.is_initialized(), "the half-built generation's default group is gone"
    monkeypatch.setattr(dist, "new_group", real_new_group)
    try:
        trainer.build(plan)  # what used to raise "initialize the default process group twice"
        assert trainer.step().step == 0
    finally:
        trainer.shutdown()
