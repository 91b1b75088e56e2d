"""What a restored layer is (runtime/checkpoint/layout.py Note: [checkpoint format]): the job's config
builds its optimizer (lr, weight decay, betas, the groups of train.no_weight_decay) and the
checkpoint fills in the per-parameter state, by name, so it steps exactly like a replica that a
layer transfer built; and nothing in the checkpoint directory runs code in the process that
loads it (Note: [checkpoint trust])."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from examples.gpt.model import GPTConfig, gpt_model
from oobleck_elastic.config import load_config
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.checkpoint import (
    checkpoint_id,
    host_copy,
    load_model_state,
    mark_complete,
    restore_layers,
    save_layers,
)
from oobleck_elastic.runtime.checkpoint.layout import layer_digest
from oobleck_elastic.runtime.layers import LayerState, LayerStore
from oobleck_elastic.runtime.lr import lr_factor

SPEC = gpt_model(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=2, dataset_size=32))
CPU = torch.device("cpu")
STEPS = 5
NO_DECAY = 'train.no_weight_decay=["*.bias", "*ln*"]'


def train_of(*sets: str):
    return load_config(None, [f"train.steps={STEPS}", *sets]).train


def step(state: LayerState, k: int, train) -> None:
    """Optimizer step k as the trainer takes it (scheduled lr, then step) with fixed gradients."""
    state.set_lr(lr_factor(train.lr_schedule, k, train.steps))
    for p in state.params:
        p.grad = torch.linspace(-1.0, 1.0, p.numel(), dtype=p.dtype).view_as(p) * (k + 1)
    state.optimizer.step()
    state.zero_grad()


def checkpoint(root, train, steps: int = 2, extra=lambda state: {}) -> LayerStore:
    """Every layer built under `train`, stepped `steps` times and checkpointed at that step
    (with `extra(layer)` beside each layer's state)."""
    layers = LayerStore(SPEC, train, CPU)
    for i in range(SPEC.num_layers):
        state = layers.materialize(i)
        for k in range(steps):
            step(state, k, train)
    ident = checkpoint_id("run", SPEC, load_config(None, []), 32)
    states = {i: {**host_copy(layers[i]), **extra(layers[i])} for i in range(SPEC.num_layers)}
    save_layers(str(root), steps, states, "run")
    mark_complete(str(root), steps, ident, SPEC.export)
    return layers


def transferred(source: LayerState, index: int, train) -> LayerState:
    """The replica a layer transfer builds on a worker running `train`: materialised by the
    config, optimizer primed, then every state tensor received in place (runtime.transfer
    Note: [transfer wire format]; the same tensors in the same order, without the wire)."""
    state = LayerStore(SPEC, train, CPU).materialize(index, init=False)
    state.prime_optimizer()
    with torch.no_grad():
        for mine, theirs in zip(state.state_tensors(), source.state_tensors(), strict=True):
            mine.copy_(theirs)
    return state


def hyperparameters(state: LayerState) -> list[tuple[list[str], dict]]:
    """Each param group as (its parameters' names, its hyperparameters)."""
    name_of = {id(p): n for n, p in state.named_params}
    return [([name_of[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
            for g in state.optimizer.param_groups]


def test_a_restored_layer_steps_like_a_transferred_replica_under_the_configs_hyperparameters(tmp_path):
    """Resumed with other optimizer settings, a replica restored from the checkpoint and one
    rebuilt by a transfer step alike: both take the config's weight decay, betas and lr, and the
    schedule scales the config's lr as for a fresh layer."""
    written = train_of("train.optimizer.lr=0.01", "train.optimizer.weight_decay=0.1",
                       "train.optimizer.betas=[0.8, 0.9]")
    resumed = train_of("train.optimizer.lr=0.002", "train.optimizer.weight_decay=0.0",
                       "train.lr_schedule.kind=cosine", "train.lr_schedule.warmup_steps=1")
    source = checkpoint(tmp_path, written)
    restored = LayerStore(SPEC, resumed, CPU)
    restore_layers(str(tmp_path), 2, restored, [1])
    replica = transferred(source[1], 1, resumed)
    for k in (2, 3):
        step(restored[1], k, resumed)
        step(replica, k, resumed)
        assert all(torch.equal(a, b) for a, b in zip(restored[1].state_tensors(), replica.state_tensors(),
                                                     strict=True)), f"the replicas diverge at step {k}"
    fresh = LayerStore(SPEC, resumed, CPU).materialize(1)
    fresh.set_lr(lr_factor(resumed.lr_schedule, 3, STEPS))
    assert hyperparameters(restored[1]) == hyperparameters(fresh) == hyperparameters(replica)
    assert restored[1].optimizer.param_groups[0]["lr"] == 0.002 * lr_factor(resumed.lr_schedule, 3, STEPS)


@pytest.mark.parametrize("written, resumed", [((), (NO_DECAY,)), ((NO_DECAY,), ())],
                         ids=["pattern-added", "pattern-removed"])
def test_resuming_with_other_no_weight_decay_patterns_takes_the_configs_groups(tmp_path, written, resumed):
    """train.no_weight_decay may change on resume: the groups are the config's, every
    parameter's optimizer state comes back under its own name whatever group it is in now."""
    source = checkpoint(tmp_path, train_of("train.optimizer.weight_decay=0.1", *written))
    train = train_of("train.optimizer.weight_decay=0.1", *resumed)
    restored = LayerStore(SPEC, train, CPU)
    restore_layers(str(tmp_path), 2, restored, range(SPEC.num_layers))
    for i in range(SPEC.num_layers):
        assert hyperparameters(restored[i]) == hyperparameters(LayerStore(SPEC, train, CPU).materialize(i))
        theirs = dict(source[i].named_params)
        for name, p in restored[i].named_params:
            expected = source[i].optimizer.state[theirs[name]]
            assert all(torch.equal(restored[i].optimizer.state[p][k], expected[k]) for k in expected), name
    assert len(restored[1].optimizer.param_groups) == (2 if resumed else 1)


def test_optimizer_state_the_checkpoint_lacks_is_one_clear_error(tmp_path):
    """AdamW's amsgrad keeps a state tensor more: a checkpoint written without it cannot fill it."""
    checkpoint(tmp_path, train_of())
    with pytest.raises(OobleckError, match=r"holds no optim\..*max_exp_avg_sq.*train\.optimizer"):
        restore_layers(str(tmp_path), 2, LayerStore(SPEC, train_of("train.optimizer.amsgrad=true"), CPU), [1])


# What someone who can write checkpoint.dir could plant. The manifest is rewritten with the
# planted files' checksums, as anyone able to write the directory can.
class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(root, marker: str, how: str) -> None:
    layer = root / "step_00000002" / "layer_0001"
    with open(layer / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file, before it is tampered with
    name = "model.block0.ln1.weight"
    if how == "metadata":
        metadata.planner_data = _RunsCode(marker)
    elif how == "value":
        torch.save(_RunsCode(marker), layer / "value.bin")  # as DCP writes a non-tensor entry
        metadata.state_dict_metadata[name] = BytesStorageMetadata()
        size = (layer / "value.bin").stat().st_size
        metadata.storage_data[MetadataIndex(name)] = _StorageInfo("value.bin", 0, size)
    else:  # a tensor read from a file outside the checkpoint
        outside = root.parent / "outside.pt"
        torch.save(torch.full((8,), 7.0), outside)
        assert MetadataIndex(name, [0]) in metadata.storage_data, "the entry is redirected, not added"
        metadata.storage_data[MetadataIndex(name, [0])] = _StorageInfo(str(outside), 0, outside.stat().st_size)
    with open(layer / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    manifest = json.loads((root / "step_00000002" / "manifest.json").read_text())
    manifest["sha256"][1] = layer_digest(str(layer))
    (root / "step_00000002" / "manifest.json").write_text(json.dumps(manifest))


def test_the_optim_groups_of_older_checkpoints_restore_unread(tmp_path):
    """Checkpoints written before hyperparameters left them hold `optim_groups`, the optimizer's
    hyperparameters then: they restore, and that entry (here one that runs code) is never read."""
    marker = tmp_path / "ran"

    def optim_groups(state: LayerState) -> dict:
        return {"optim_groups": [{**g, "weight_decay": _RunsCode(str(marker))}
                                 for g in state.optimizer.state_dict()["param_groups"]]}

    root = str(tmp_path / "checkpoints")
    source = checkpoint(root, train_of("train.optimizer.weight_decay=0.1"), extra=optim_groups)
    restored = LayerStore(SPEC, train_of(), CPU)
    restore_layers(root, 2, restored, range(SPEC.num_layers))
    model = load_model_state(root, 2, SPEC.num_layers)  # what the exporter reads
    assert not marker.exists(), "the checkpoint ran code"
    assert model.keys() == {k for i in range(SPEC.num_layers) for k in source[i].module.state_dict()}
    for i in range(SPEC.num_layers):
        assert all(torch.equal(model[k], v) for k, v in source[i].module.state_dict().items())
        assert all(torch.equal(a, b) for a, b in zip(restored[i].state_tensors(), source[i].state_tensors(),
                                                     strict=True))
        assert hyperparameters(restored[i]) == hyperparameters(LayerStore(SPEC, train_of(), CPU).materialize(i))


@pytest.mark.parametrize("how", ["metadata", "value", "outside"])
def test_a_checkpoint_directory_cannot_run_code_or_read_other_files(tmp_path, how):
    """A .metadata that runs code when unpickled, an entry that is a pickle instead of a tensor,
    a tensor read from outside the layer's directory: each is refused, in one line, by a
    resume and by the exporter, and nothing ran."""
    root, marker = tmp_path / "checkpoints", tmp_path / "ran"
    checkpoint(root, train_of())
    _plant(root, str(marker), how)
    for load in (lambda: restore_layers(str(root), 2, LayerStore(SPEC, train_of(), CPU), [1]),
                 lambda: load_model_state(str(root), 2, SPEC.num_layers)):
        try:
            load()
            refused = None
        except Exception as exc:  # whatever it is, only once the marker is checked
            refused = exc
        assert not marker.exists(), "the checkpoint ran code"
        assert isinstance(refused, OobleckError), f"not refused: {refused!r}"
        assert "layer_0001 is refused" in str(refused) and "checkpoint.dir" in str(refused)
        assert "\n" not in str(refused)


def test_only_the_dcp_reader_reads_checkpoint_directories():
    """torch's own readers (FileSystemReader, dcp.load, dcp_to_torch_save) unpickle `.metadata`
    and non-tensor entries unchecked: the package reads checkpoints through runtime.checkpoint.dcp_reader."""
    found = []
    for path in (pathlib.Path(__file__).resolve().parents[2] / "oobleck_elastic").rglob("*.py"):
        if path.name == "dcp_reader.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "attr", None) or getattr(node, "id", None) or getattr(node, "name", None)
            if name in ("FileSystemReader", "dcp_to_torch_save") or (
                    isinstance(node, ast.Attribute) and node.attr == "load"
                    and ast.unparse(node.value) in ("dcp", "torch.distributed.checkpoint")):
                found.append(f"{path.name}:{node.lineno} {name}")
    assert not found, found
