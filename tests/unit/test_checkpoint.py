"""Checkpoints are complete or ignored (Note: [checkpoint manifest]): a checkpoint is published
by one rename once its manifest is written; the fallback of a run loads only its own (or the
one it resumed from); resuming loads the newest checkpoint of the same job and names what
differs otherwise; a damaged file is never loaded; nothing is written by a failed resume."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from examples.gpt.model import GPTConfig, gpt_model
from oobleck_elastic.config import load_config
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.runtime.checkpoint import (
    checkpoint_id,
    find_resume,
    host_copy,
    identity,
    job_digest,
    job_key,
    latest_checkpoint,
    load_model_state,
    mark_complete,
    restore_layers,
    save_layers,
)
from oobleck_elastic.runtime.layers import LayerStore

SPEC = gpt_model(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=2, dataset_size=32))
WIDER = gpt_model(GPTConfig(vocab_size=16, seq_len=4, d_model=12, n_heads=2, n_layers=2, dataset_size=32))


def store(seed: int) -> LayerStore:
    layers = LayerStore(SPEC, load_config(None, [f"train.seed={seed}"]).train, torch.device("cpu"))
    for i in range(SPEC.num_layers):
        layers.materialize(i)
    return layers


def ident(run_id: str, *sets: str, spec=SPEC, samples: int = 32):
    return checkpoint_id(run_id, spec, load_config(None, list(sets)), samples)


def copies(layers: LayerStore, indices=range(SPEC.num_layers)):
    return {i: host_copy(layers[i]) for i in indices}


def write(root, step, layers, ident, keep=None):
    save_layers(str(root), step, copies(layers), ident.run_id)
    mark_complete(str(root), step, ident, SPEC.export, keep=keep)


def snapshot(root):
    """Every file under `root` with its content's hash: what a failed resume must not change."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def test_another_runs_or_jobs_checkpoint_is_never_loaded(tmp_path):
    """The in-run fallback: only this run's checkpoints of this job, or the one it resumed from."""
    first = ident("run-a")
    write(tmp_path, 4, store(0), first)
    assert latest_checkpoint(str(tmp_path), first) == 4
    assert latest_checkpoint(str(tmp_path), ident("run-b")) is None
    assert latest_checkpoint(str(tmp_path), ident("run-a", "train.seed=1")) is None
    assert latest_checkpoint(str(tmp_path), ident("run-a", spec=WIDER)) is None
    import dataclasses

    assert latest_checkpoint(str(tmp_path), dataclasses.replace(ident("run-b"), resumed=("run-a", 4))) == 4


def test_a_step_being_rewritten_is_replaced_whole(tmp_path):
    """A second run writing the same step writes beside it and replaces it by one rename: the
    published step is always one run's whole checkpoint, never a mix of both."""
    first, second = ident("a"), ident("b")
    write(tmp_path, 2, store(0), first)
    save_layers(str(tmp_path), 2, copies(store(1), [0]), "b")  # the second run died after one layer
    assert latest_checkpoint(str(tmp_path), first) == 2, "the first run's step 2 stands until replaced whole"
    assert latest_checkpoint(str(tmp_path), second) is None
    assert sorted(os.listdir(tmp_path)) == [".partial-step_00000002-b", "step_00000002"]
    write(tmp_path, 2, store(1), second)
    assert latest_checkpoint(str(tmp_path), first) is None
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]
    assert latest_checkpoint(str(tmp_path), second) == 2
    restored = LayerStore(SPEC, load_config(None, []).train, torch.device("cpu"))
    restore_layers(str(tmp_path), 2, restored, range(SPEC.num_layers))
    expected = store(1)
    for i in range(SPEC.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(restored[i].module.state_dict().values(),
                                                     expected[i].module.state_dict().values()))


def test_a_damaged_file_is_never_loaded(tmp_path):
    me = ident("a")
    write(tmp_path, 1, store(0), me)
    write(tmp_path, 2, store(0), me)
    path = tmp_path / "step_00000002" / "layer_0001" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    # the step is chosen from the manifests (a damaged byte is not seen without reading every
    # file); the layer is checked as it is loaded, and the fallback then
    # leaves the step out (the run marks it damaged) and takes the one before it
    assert latest_checkpoint(str(tmp_path), me) == 2
    with pytest.raises(OobleckError, match="do not match their checksum"):
        restore_layers(str(tmp_path), 2, LayerStore(SPEC, load_config(None, []).train, torch.device("cpu")), [1])
    with pytest.raises(OobleckError, match="do not match their checksum"):
        load_model_state(str(tmp_path), 2, SPEC.num_layers)
    damaged = {2: identity(json.loads((tmp_path / "step_00000002/manifest.json").read_text()))}
    assert latest_checkpoint(str(tmp_path), me, damaged=damaged) == 1
    write(tmp_path, 2, store(0), me)  # published again: a new publication, not the damaged one
    assert latest_checkpoint(str(tmp_path), me, damaged=damaged) == 2
    path.write_bytes(bytes(data))
    # a file missing, or not the size it was written, is seen from the manifest alone
    (tmp_path / "step_00000002" / "layer_0000" / "__0_0.distcp").write_bytes(b"short")
    assert latest_checkpoint(str(tmp_path), me) == 1
    os.remove(tmp_path / "step_00000001" / "layer_0000" / ".metadata")
    assert latest_checkpoint(str(tmp_path), me) is None


def test_job_digest_follows_what_fixes_a_step_not_what_may_change_on_resume():
    cfg = load_config(None, [])
    same = job_digest(job_key("m", cfg, 32))
    assert same == job_digest(job_key("m", load_config(None, []), 32))
    for changed in ("train.seed=1", "train.global_batch_size=64", "train.dtype=float64", "data.seq_len=7",
                    "train.optimizer.name=SGD"):
        assert same != job_digest(job_key("m", load_config(None, [changed]), 32)), changed
    assert same != job_digest(job_key("other", cfg, 32)) != job_digest(job_key("m", cfg, 33))
    for free in ("train.steps=99", "train.optimizer.lr=0.1", "train.microbatch_size=8", "checkpoint.interval=3"):
        assert same == job_digest(job_key("m", load_config(None, [free]), 32)), free


def test_a_checkpoint_dir_that_is_not_shared_is_a_clear_error(tmp_path):
    """The node completing the set does not see the others' files."""
    save_layers(str(tmp_path), 3, copies(store(0), [0, 1]), "a")  # this node's layers; the others wrote elsewhere
    with pytest.raises(OobleckError, match="must be a directory every node shares"):
        mark_complete(str(tmp_path), 3, ident("a"))


def test_export_takes_the_newest_runs_checkpoint_not_the_highest_step(tmp_path):
    from safetensors.torch import load_file

    from oobleck_elastic.export import export_checkpoint

    os.makedirs(tmp_path / "ckpt")
    write(tmp_path / "ckpt", 6, store(0), ident("long-run"))
    write(tmp_path / "ckpt", 3, store(1), ident("short-run"))
    assert export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out")) == (3, "safetensors")
    exported = load_file(tmp_path / "out/model.safetensors")
    assert torch.equal(exported["embed.tokens.weight"], store(1)[0].module.state_dict()["embed.tokens.weight"])


def test_resume_takes_the_newest_checkpoint_of_the_job_or_the_one_named(tmp_path):
    write(tmp_path, 4, store(0), ident("a"))
    write(tmp_path, 8, store(1), ident("a"))
    save_layers(str(tmp_path), 12, copies(store(0), [0]), "a")  # killed while writing step 12: never loaded
    later = ident("b", "train.steps=30", "train.optimizer.lr=0.01")  # another run; steps and lr may change
    step, manifest = find_resume(str(tmp_path), later, load_step=None, max_step=30)
    assert (step, manifest["run_id"]) == (8, "a")
    assert find_resume(str(tmp_path), later, load_step=4, max_step=30)[0] == 4
    assert find_resume(str(tmp_path / "empty"), later, load_step=None, max_step=30) is None
    with pytest.raises(OobleckError, match=r"load_step=5: .* no checkpoint of step 5 \(steps found: 4, 8\)"):
        find_resume(str(tmp_path), later, load_step=5, max_step=30)
    with pytest.raises(OobleckError, match="it is after step 8 but train.steps is 6"):
        find_resume(str(tmp_path), later, load_step=None, max_step=6)


@pytest.mark.parametrize("case, expected", [
    ("model", r"the model differs \(embed.tokens.weight is float32\[16, 12\] here, float32\[16, 8\] in the "
              r"checkpoint; .*\(and \d+ more\)"),
    ("batch", r"train.global_batch_size = 64 here, 32 in the checkpoint"),
    ("manifest", r"its manifest.json is damaged or missing"),
    ("file", r"a layer file is missing or is not the size it was written"),
])
def test_a_checkpoint_that_cannot_be_resumed_is_one_clear_error_and_stays_untouched(tmp_path, case, expected):
    write(tmp_path, 4, store(0), ident("a"))
    me = ident("b")
    if case == "model":
        me = ident("b", spec=WIDER)
    elif case == "batch":
        me = ident("b", "train.global_batch_size=64")
    elif case == "manifest":
        (tmp_path / "step_00000004/manifest.json").write_text('{"format": 3, "step": 4, "run_')
    else:
        (tmp_path / "step_00000004/layer_0002/__0_0.distcp").write_bytes(b"not a layer")
    before = snapshot(tmp_path)
    with pytest.raises(OobleckError, match=expected) as caught:
        find_resume(str(tmp_path), me, load_step=None, max_step=10)
    assert "\n" not in str(caught.value) and "checkpoint.resume=never" in str(caught.value)
    assert snapshot(tmp_path) == before


def test_keep_retains_the_newest_checkpoints_of_this_job_only(tmp_path):
    other = ident("x", "train.seed=5")
    save_layers(str(tmp_path), 1, copies(store(5)), "x")
    mark_complete(str(tmp_path), 1, other)
    for step in (2, 4, 6):
        write(tmp_path, step, store(0), ident("a"), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000004", "step_00000006"]
    assert json.loads((tmp_path / "step_00000001/manifest.json").read_text())["run_id"] == "x"


def test_a_host_copy_is_what_the_layer_was_when_copied(tmp_path):
    """The background write saves the state of its step, not what training made of it since."""
    layers = store(0)
    state = layers[1]
    for p in state.params:
        p.grad = torch.ones_like(p)
    state.optimizer.step()
    copy = host_copy(state)
    expected = {k: v.clone() for k, v in state.module.state_dict().items()}
    name, first = state.named_params[0]
    moment = state.optimizer.state[first]["exp_avg"].clone()
    for p in state.params:
        p.grad = torch.ones_like(p)
    state.optimizer.step()  # the next step changes parameters and optimizer state in place
    assert all(torch.equal(copy["model"][k], v) for k, v in expected.items())
    assert torch.equal(copy["optim"][name]["exp_avg"], moment), "optimizer state under the parameter's own name"
    assert not torch.equal(state.optimizer.state[first]["exp_avg"], moment)


def test_a_checkpoint_is_one_dcp_checkpoint_under_the_models_own_names(tmp_path):
    """torch.distributed.checkpoint's own tools read a whole step (every layer's files, one
    merged .metadata) under the model's parameter names, optimizer state included; and a layer
    restores parameters and optimizer state exactly."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    layers = store(0)
    for i in range(SPEC.num_layers):
        for p in layers[i].params:
            p.grad = torch.full_like(p, 0.5)
        layers[i].optimizer.step()
    write(tmp_path, 1, layers, ident("a"))
    dcp_to_torch_save(str(tmp_path / "step_00000001"), str(tmp_path / "all.pt"))
    everything = torch.load(tmp_path / "all.pt", weights_only=False)
    names = {n for i in range(SPEC.num_layers) for n in layers[i].module.state_dict()}
    assert set(everything["model"]) == names
    name, param = layers[1].named_params[0]
    assert torch.equal(everything["optim"][name]["exp_avg_sq"], layers[1].optimizer.state[param]["exp_avg_sq"])
    restored = LayerStore(SPEC, load_config(None, []).train, torch.device("cpu"))
    restore_layers(str(tmp_path), 1, restored, [1])
    assert all(torch.equal(a, b) for a, b in zip(restored[1].module.state_dict().values(),
                                                 layers[1].module.state_dict().values()))
    assert restored[1].optimizer.state_dict()["state"].keys() == layers[1].optimizer.state_dict()["state"].keys()
    for ours, theirs in zip(restored[1].optimizer.state_dict()["state"].values(),
                            layers[1].optimizer.state_dict()["state"].values()):
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_the_background_writer_runs_one_write_at_a_time_and_keeps_its_error():
    import threading

    from oobleck_elastic.runtime.checkpoint import BackgroundWriter

    writer, order, release = BackgroundWriter("test"), [], threading.Event()

    def slow():
        release.wait(10)
        order.append("first")

    def failing():
        order.append("second")
        raise OSError("disk full")

    writer.submit(slow, timeout=10)
    threading.Timer(0.2, release.set).start()
    writer.submit(failing, timeout=10)  # waits for the first
    assert isinstance(writer.wait(timeout=10), OSError) and order == ["first", "second"]
    assert writer.wait(timeout=10) is None
    writer.submit(lambda: release.clear() or threading.Event().wait(5), timeout=10)
    with pytest.raises(OobleckError, match="has not finished after 0 s"):
        writer.wait(timeout=0.01)


def test_resume_and_keep_follow_the_newest_run_not_the_highest_step(tmp_path):
    """A run that went back (checkpoint.load_step) writes lower steps than the run it left:
    resume takes its newest checkpoint and `keep` retires the oldest, never its own new ones
    (keep used to delete them as soon as they were published, and resume
    went back to the longer run)."""
    import dataclasses

    long_run = dataclasses.replace(ident("none"), instance="first", instance_started=1000.0)
    for step in (4, 8, 12):
        write(tmp_path, step, store(0), long_run)
    went_back = dataclasses.replace(ident("none"), instance="second", instance_started=2000.0, resumed=("none", 4))
    # before it wrote anything, its fallback is the checkpoint it resumed from, not the
    # other start's newer ones under the same run id (torchrun's default id is "none")
    assert latest_checkpoint(str(tmp_path), went_back) == 4
    write(tmp_path, 6, store(1), went_back, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000006", "step_00000012"]
    assert find_resume(str(tmp_path), ident("later"), load_step=None, max_step=30)[0] == 6
    assert latest_checkpoint(str(tmp_path), went_back) == 6


def test_a_clock_ahead_on_one_node_does_not_reorder_a_runs_checkpoints(tmp_path):
    """Within one start of a run the higher step is the newer, whichever node's clock
    published it; starts are ordered by their own start time."""
    import dataclasses

    me = dataclasses.replace(ident("a"), instance="one", instance_started=1000.0)
    write(tmp_path, 10, store(0), me)
    manifest = tmp_path / "step_00000010/manifest.json"
    ahead = json.loads(manifest.read_text())
    ahead["time"] += 100.0  # published by a node whose clock runs 100 s ahead
    manifest.write_text(json.dumps(ahead))
    write(tmp_path, 20, store(0), me, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step_00000020"]


def test_keep_spares_the_step_a_generation_restores(tmp_path):
    """A write of the failed generation may publish while the next one restores an older step:
    `keep` does not retire it under the readers."""
    me = ident("a")
    write(tmp_path, 2, store(0), me)
    save_layers(str(tmp_path), 4, copies(store(0)), "a")
    mark_complete(str(tmp_path), 4, me, SPEC.export, keep=1, protect=lambda: {2})
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000004"]
    write(tmp_path, 6, store(0), me, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step_00000006"]


def test_another_jobs_checkpoint_is_refused_at_start_never_replaced_and_never_restored(tmp_path):
    """Two jobs in one checkpoint.dir: the second is refused before it trains, whatever
    checkpoint.resume says; a checkpoint of another job at the same step is not replaced; and a
    step_<k> that is not this run's is not taken for its own."""
    from oobleck_elastic.runtime.checkpoint import check_dir, published

    theirs = ident("x", "train.seed=5")
    write(tmp_path, 4, store(5), theirs)
    mine = ident("y")
    with pytest.raises(OobleckError, match=r"holds a checkpoint of another job .*train.seed = 0 here, 5 in the "
                                           r"checkpoint.*give this job its own checkpoint.dir") as caught:
        check_dir(str(tmp_path), mine)
    assert "\n" not in str(caught.value)
    check_dir(str(tmp_path), ident("z", "train.seed=5"))  # the same job: allowed
    before = snapshot(tmp_path)
    save_layers(str(tmp_path), 4, copies(store(0)), "y")
    with pytest.raises(OobleckError, match="belongs to another job"):
        mark_complete(str(tmp_path), 4, mine)
    assert {k: v for k, v in snapshot(tmp_path).items() if k.startswith("step_")} == before
    assert not published(str(tmp_path), 4, mine) and published(str(tmp_path), 4, theirs)
