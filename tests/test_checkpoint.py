"""Checkpoints are complete or ignored: the manifest (Note: [checkpoint manifest]) names the run,
the job and every layer file's checksum; another run's or job's checkpoint in the same
directory, a half-rewritten step or a damaged file is never loaded."""

from __future__ import annotations

import os

import pytest
import torch

from examples.gpt.model import GPTConfig, gpt_model
from oobleck_elastic.config import load_config
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.checkpoint import (
    CheckpointId,
    job_digest,
    latest_checkpoint,
    load_model_state,
    mark_complete,
    restore_layers,
    save_layers,
)
from oobleck_elastic.runtime.layers import LayerStore
from oobleck_elastic.runtime.model import model_fingerprint

SPEC = gpt_model(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=2, dataset_size=32))


def store(seed: int) -> LayerStore:
    layers = LayerStore(SPEC, load_config(None, [f"train.seed={seed}"]).train, torch.device("cpu"))
    for i in range(SPEC.num_layers):
        layers.materialize(i)
    return layers


def write(root, step, layers, ident):
    save_layers(str(root), step, layers, range(SPEC.num_layers))
    mark_complete(str(root), step, ident, SPEC.export)


def test_another_runs_or_jobs_checkpoint_is_never_loaded(tmp_path):
    first = CheckpointId("run-a", "digest-1", SPEC.num_layers)
    write(tmp_path, 4, store(0), first)
    assert latest_checkpoint(str(tmp_path), first) == 4
    assert latest_checkpoint(str(tmp_path), CheckpointId("run-b", "digest-1", SPEC.num_layers)) is None
    assert latest_checkpoint(str(tmp_path), CheckpointId("run-a", "digest-2", SPEC.num_layers)) is None
    assert latest_checkpoint(str(tmp_path), CheckpointId("run-a", "digest-1", SPEC.num_layers + 1)) is None


def test_a_step_being_rewritten_is_not_complete(tmp_path):
    """A second run writing the same step: until its manifest is written the step is no
    checkpoint for anyone (not the first run's, not a mix of both)."""
    first, second = CheckpointId("a", "d", SPEC.num_layers), CheckpointId("b", "d", SPEC.num_layers)
    write(tmp_path, 2, store(0), first)
    save_layers(str(tmp_path), 2, store(1), [0])  # the second run died after one layer
    assert latest_checkpoint(str(tmp_path), first) is None
    assert latest_checkpoint(str(tmp_path), second) is None
    write(tmp_path, 2, store(1), second)
    assert latest_checkpoint(str(tmp_path), second) == 2
    restored = LayerStore(SPEC, load_config(None, []).train, torch.device("cpu"))
    restore_layers(str(tmp_path), 2, restored, range(SPEC.num_layers))
    expected = store(1)
    for i in range(SPEC.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(restored[i].module.state_dict().values(),
                                                     expected[i].module.state_dict().values()))


def test_a_damaged_file_is_never_loaded(tmp_path):
    ident = CheckpointId("a", "d", SPEC.num_layers)
    write(tmp_path, 1, store(0), ident)
    write(tmp_path, 2, store(0), ident)
    path = tmp_path / "step_00000002" / "layer_0001.pt"
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    assert latest_checkpoint(str(tmp_path), ident) == 1, "the damaged step is skipped, the older one used"
    with pytest.raises(OobleckError, match="does not match its checksum"):
        restore_layers(str(tmp_path), 2, LayerStore(SPEC, load_config(None, []).train, torch.device("cpu")), [1])
    with pytest.raises(OobleckError, match="does not match its checksum"):
        load_model_state(str(tmp_path), 2, SPEC.num_layers)
    os.remove(tmp_path / "step_00000001" / "layer_0000.pt")
    assert latest_checkpoint(str(tmp_path), ident) is None


def test_job_digest_follows_the_training_config_and_model():
    fp = model_fingerprint(SPEC, torch.float32)
    cfg = load_config(None, [])
    same = job_digest(fp, cfg.train, cfg.data)
    assert same == job_digest(fp, load_config(None, []).train, cfg.data)
    assert same != job_digest(fp, load_config(None, ["train.seed=1"]).train, cfg.data)
    assert same != job_digest(fp, cfg.train, load_config(None, ["data.seq_len=7"]).data)
    assert same != job_digest("other", cfg.train, cfg.data)


def test_a_checkpoint_dir_that_is_not_shared_is_a_clear_error(tmp_path):
    """The node completing the set does not see the others' files (issue 10, item 9)."""
    save_layers(str(tmp_path), 3, store(0), [0, 1])  # this node's layers; the others wrote elsewhere
    with pytest.raises(OobleckError, match="must be a directory every node shares"):
        mark_complete(str(tmp_path), 3, CheckpointId("a", "d", SPEC.num_layers))


def test_export_takes_the_newest_runs_checkpoint_not_the_highest_step(tmp_path):
    from safetensors.torch import load_file

    from oobleck_elastic.export import export_checkpoint

    write(tmp_path / "ckpt", 6, store(0), CheckpointId("long-run", "d", SPEC.num_layers))
    write(tmp_path / "ckpt", 3, store(1), CheckpointId("short-run", "d", SPEC.num_layers))
    assert export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out")) == (3, "safetensors")
    exported = load_file(tmp_path / "out/model.safetensors")
    assert torch.equal(exported["embed.tokens.weight"], store(1)[0].module.state_dict()["embed.tokens.weight"])
