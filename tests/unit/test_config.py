"""Every configuration error a user can make gets one clear message naming the field (from an
entry point run as a command: tests/jobs/test_config_jobs.py)."""

from __future__ import annotations

import dataclasses

import pytest

from oobleck_elastic.config import load_config
from oobleck_elastic.errors import ConfigError


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_defaults_and_file_and_overrides(tmp_path):
    path = write(tmp_path, "train:\n  global_batch_size: 64\n  optimizer: {name: SGD, lr: 0.1, momentum: 0.9}\n"
                           "fault_tolerance: 2\nplanner:\n  memory_per_worker: 2GiB\n")
    cfg = load_config(path, ["train.steps=7", "train.dtype=float64", "train.optimizer.lr=0.05"])
    assert cfg.train.global_batch_size == 64 and cfg.train.steps == 7
    assert cfg.train.precision == "fp64" and cfg.train.dtype is None  # the former name, resolved
    assert cfg.train.optimizer.name == "SGD"
    assert dict(cfg.train.optimizer.kwargs) == {"lr": 0.05, "momentum": 0.9}
    assert cfg.fault_tolerance == 2
    assert cfg.planner.memory_per_worker == 2 * 2**30
    assert cfg.train.num_microbatches == 16
    with pytest.raises(AttributeError):
        cfg.train.steps = 3  # frozen


@pytest.mark.parametrize("overrides, expected", [
    (["train.global_bach_size=8"], "unknown key 'train.global_bach_size' (did you mean 'global_batch_size'?)"),
    (["trian.steps=3"], "unknown key 'trian' (did you mean 'train'?)"),
    (["train.steps=three"], "train.steps must be an integer, got 'three'"),
    (["train.steps=2.5"], "train.steps must be an integer, got 2.5"),
    (["train.steps=true"], "train.steps must be an integer, got True"),
    (["train.steps=0"], "train.steps must be >= 1, got 0"),
    (["train.microbatch_size=-1"], "train.microbatch_size must be >= 1, got -1"),
    (["train.global_batch_size=30"], "must be a multiple of train.microbatch_size (4); nearest valid: 28 or 32"),
    (["train.dtype=float16"], "train.dtype must be one of 'float32', 'bfloat16', 'float64', got 'float16'; "
                              "train.dtype is the former name of train.precision: prefer train.precision "
                              "(fp32, bf16-mixed, bf16, fp64)"),
    (["train.precision=fp16"], "train.precision must be one of 'fp32', 'bf16-mixed', 'bf16', 'fp64' or null, "
                               "got 'fp16'"),
    (["train.precision=bf16-mixed", "train.dtype=float32"],
     "train.dtype (float32) is the former name of train.precision and means precision fp32, but "
     "train.precision is bf16-mixed; set only train.precision"),
    (["train.device=tpu"], "train.device must be one of 'auto', 'cpu', 'cuda', got 'tpu'"),
    (["train.optimizer.lr=-1"], "train.optimizer.lr must be a positive number, got -1"),
    (["fault_tolerance=-1"], "fault_tolerance must be >= 0, got -1"),
    (["planner.memory_per_worker=12XB"], "planner.memory_per_worker must be a byte count"),
    (["elastic.lease_timeout_s=5"], "collective_timeout_s < lease_timeout_s < agreement_timeout_s"),
    (["elastic.rollcall_window_s=0.5"], "elastic.rollcall_window_s (0.5) must be at least 3 heartbeats (3 x 0.2)"),
    (["elastic.rollcall_window_s=20"], "and at most elastic.lease_timeout_s (15.0)"),
    (["checkpoint.interval=-2"], "checkpoint.interval must be >= 0"),
    (["checkpoint.keep=0"], "checkpoint.keep must be >= 1 or null (keep all), got 0"),
    (["checkpoint.resume=sometimes"], "checkpoint.resume must be one of 'auto', 'never', got 'sometimes'"),
    (["checkpoint.resume=never", "checkpoint.load_step=3"], "it needs checkpoint.resume=auto, got never"),
    (["eval.interval=-1"], "eval.interval must be >= 0 (0 disables), got -1"),
    (["eval.steps=0"], "eval.steps must be >= 1, got 0"),
    (["train.grad_clip_norm=0"], "train.grad_clip_norm must be > 0 or null"),
    (["train.schedule=ZB"], "train.schedule must be one of '1F1B', 'GPipe', 'Interleaved1F1B'"),
    (["train.schedule=Interleaved1F1B", "train.virtual_stages=1"],
     "train.schedule Interleaved1F1B needs train.virtual_stages >= 2, got 1"),
    (["train.virtual_stages=0"], "train.virtual_stages must be >= 1, got 0"),
    (["train"], "--set expects dotted.key=value"),
    (["train.steps.x=1"], "'train.steps' is a value, not a section"),
])
def test_bad_values_name_field_value_and_accepted(tmp_path, overrides, expected):
    path = write(tmp_path, "train:\n  steps: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert expected in str(info.value)


@pytest.mark.parametrize("override, expected", [
    ("train.optimizer.name=AdamX",
     "train.optimizer.name 'AdamX' is not a torch.optim optimizer (did you mean 'Adam'?)"),
    ("train.optimizer.lrr=0.1", "train.optimizer.lrr is not an argument of torch.optim.AdamW (did you mean 'lr'?)"),
])
def test_optimizer_is_checked_against_torch_before_any_worker_starts(tmp_path, capsys, override, expected):
    """config does not import torch: the runtime checks the optimizer, and every entry point
    calls that check before a node or a model is built."""
    from oobleck_elastic.launch import main as launch
    from oobleck_elastic.runtime.supported import check_supported
    from oobleck_elastic.train import main as train

    cfg = load_config(None, [override])  # parses: the name is torch's business
    with pytest.raises(ConfigError) as info:
        check_supported(cfg)
    assert expected in str(info.value)
    logs = tmp_path / "logs"
    assert launch(["--oobleck-local-nodes=2", f"--oobleck-log-dir={logs}", "-m", "oobleck_elastic.train",
                   "--set", override]) == 2
    assert expected in capsys.readouterr().err and not logs.exists(), "no node was started"
    assert train(["--set", override]) == 2
    assert expected in capsys.readouterr().err


def test_yaml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, "train:\n  steps: 5\n  dtype: [float32\nfault_tolerance: 1\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error at line 4"):
        load_config(path)


def test_top_level_must_be_mapping_and_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_section_must_be_mapping(tmp_path):
    with pytest.raises(ConfigError, match="train must be a mapping"):
        load_config(write(tmp_path, "train: 3\n"))


@pytest.mark.parametrize("overrides, precision, param, compute", [
    ([], "fp32", "float32", "float32"),
    (["train.precision=bf16-mixed"], "bf16-mixed", "float32", "bfloat16"),
    (["train.precision=bf16"], "bf16", "bfloat16", "bfloat16"),
    (["train.dtype=bfloat16"], "bf16", "bfloat16", "bfloat16"),  # the former name: pure bf16, as before
    (["train.dtype=float32", "train.precision=fp32"], "fp32", "float32", "float32"),  # both, agreeing
    (["train.precision=fp64"], "fp64", "float64", "float64"),
])
def test_precision_and_its_former_name(overrides, precision, param, compute):
    train = load_config(None, overrides).train
    assert (train.precision, train.param_dtype, train.compute_dtype) == (precision, param, compute)
    assert train.mixed == (precision == "bf16-mixed") and train.dtype is None
    assert dataclasses.replace(train, steps=3).precision == precision  # a loaded config replaces cleanly
    assert train.device == "auto"


def test_cuda_without_a_gpu_is_refused_before_any_worker_starts(monkeypatch):
    from oobleck_elastic.runtime.devices import resolve_device
    from oobleck_elastic.runtime.supported import check_supported

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.device is cuda but torch .* sees no CUDA device; set "
                                          "train.device=auto"):
        check_supported(load_config(None, ["train.device=cuda"]))
    check_supported(load_config(None, ["train.device=auto"]))
    assert str(resolve_device("auto", 3)) == "cpu"  # auto falls back to the CPU whatever the local rank
