"""Hugging Face models end to end: a tiny GPT-2 (tied embeddings) and a tiny Llama (grouped-
query attention), saved with save_pretrained, trained in float64 on a token file by
`python -m oobleck_elastic.train` on 4 local nodes with a node SIGKILLed mid-step, exported,
and loaded with from_pretrained, equal the same model trained in one plain PyTorch process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
from hf_fixtures import make_causal_lm, write_tokens  # noqa: E402
from jobs import records  # noqa: E402

from oobleck_elastic.data import TokenFile  # noqa: E402
from oobleck_elastic.runtime.data import SampleOrder  # noqa: E402

STEPS, BATCH, SEQ, LR = 6, 16, 16, 1e-3


def job_yaml(tmp_path, model_dir, tokens, memory) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(f"""
model: {{hf: {model_dir}}}
data: {{tokens: {tokens}, seq_len: {SEQ}}}
train: {{global_batch_size: {BATCH}, microbatch_size: 2, steps: {STEPS}, dtype: float64,
         optimizer: {{name: AdamW, lr: {LR}}}}}
fault_tolerance: 1
planner: {{memory_per_worker: {memory}, profile_dir: {tmp_path.parent / 'profiles'}}}
checkpoint: {{dir: {tmp_path / 'ckpt'}, interval: 0}}
monitoring: {{tensorboard_dir: {tmp_path / 'tb'}, metrics_path: {tmp_path / 'metrics.jsonl'}}}
""")
    return str(path)


def plain_pytorch(model_dir, tokens) -> dict[str, torch.Tensor]:
    """The same training as one user would write it: the HF model, its mean token loss, AdamW."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    data = TokenFile(tokens, seq_len=SEQ)
    order = SampleOrder(len(data), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data.batch(order.indices(step, BATCH))
        F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


# budgets that hold about half of each model: every pipeline has two stages on two nodes
@pytest.mark.parametrize("kind,memory", [("gpt2", "2.5MB"), ("llama", "1.6MB")])
def test_hf_model_trains_through_a_failure_and_exports_exactly(tmp_path, kind, memory):
    model_dir = make_causal_lm(tmp_path / kind, kind)
    tokens = write_tokens(tmp_path / "tokens.bin", 20_000, 97)
    env = {**os.environ, "OOBLECK_FAULT": "node=1,step=2,phase=backward"}
    proc = subprocess.run([sys.executable, "-m", "oobleck_elastic.launch", "--oobleck-local-nodes=4",
                           "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}", "-m",
                           "oobleck_elastic.train", "--config", job_yaml(tmp_path, model_dir, tokens, memory)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = records(tmp_path / "metrics.jsonl")
    first = [r for r in log if r.get("event") == "generation"][0]
    assert [len(p["nodes"]) for p in first["pipelines"]] == [2, 2], "embeddings and head on different nodes"
    assert [r["lost"] for r in log if r.get("event") == "recovery"] == [[1]]
    steps = [r for r in log if "step" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all(r["tokens"] == BATCH * SEQ and r["lr"] == LR and r["tokens_per_s"] > 0 for r in steps)

    out = tmp_path / "exported"
    export = subprocess.run([sys.executable, "-m", "oobleck_elastic.export", str(tmp_path / "ckpt"), str(out)],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    assert f"exported the checkpoint of step {STEPS}" in export.stdout
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    if kind == "gpt2":
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr(), "tied as HF ties"
    got, want = loaded.state_dict(), plain_pytorch(model_dir, tokens)
    assert set(got) == set(want)
    for name in want:
        err = (got[name] - want[name]).abs().max().item() / want[name].abs().max().item()
        assert err <= 1e-9, f"{name}: relative error {err:.3e}"
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).state_dict()
    assert all(not torch.equal(start[k], got[k]) for k in want if k.endswith("weight")), "every weight trained"
