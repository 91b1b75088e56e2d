"""`-m oobleck_elastic.train`: a model directory and a token file that do not fit each other,
or are not what they should be, are one clear line from the launcher before any node starts."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_fixtures import make_causal_lm, write_tokens  # noqa: E402

from oobleck_elastic.launch import main as launch  # noqa: E402


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return make_causal_lm(tmp_path_factory.mktemp("gpt2"), "gpt2")  # vocab 97, 64 positions


def run(tmp_path, capsys, *sets):
    code = launch(["--oobleck-local-nodes=2", "--nproc-per-node=1", f"--oobleck-log-dir={tmp_path / 'logs'}",
                   "-m", "oobleck_elastic.train", *(a for s in ("data.seq_len=16", *sets) for a in ("--set", s))])
    err = capsys.readouterr().err
    assert not (tmp_path / "logs").exists(), "no node was started"
    return code, err.strip()


def test_bad_model_and_data_are_one_line_each_before_any_node_starts(tmp_path, capsys, gpt2):
    tokens = write_tokens(tmp_path / "ok.bin", 5000, 97)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 1001)
    beyond = write_tokens(tmp_path / "beyond.bin", 5000, 500)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    cases = [
        ([f"model.hf={tmp_path}", f"data.tokens={tokens}"], "has no config.json"),
        ([f"model.hf={bert}", f"data.tokens={tokens}"], "supported are GPT2LMHeadModel, LlamaForCausalLM"),
        ([f"model.hf={gpt2}", f"data.tokens={odd}"], "not a multiple"),
        ([f"model.hf={gpt2}", f"data.tokens={beyond}"], ">= the model's vocab_size 97"),
        ([f"model.hf={gpt2}", f"data.tokens={tokens}", "data.seq_len=65"], "longer than the model's 64 positions"),
        ([f"model.hf={gpt2}"], "the job names no data"),
        ([f"data.tokens={tokens}"], "the job names no model"),
        ([f"model.hf={gpt2}", "model.layers=3", f"data.tokens={tokens}"], "unknown key 'model.layers'"),
        ([f"model.hf={gpt2}", f"data.tokens={tokens}", "eval.interval=2"], "the job has no eval data"),
        ([f"model.hf={gpt2}", f"data.tokens={tokens}", f"data.eval_tokens={beyond}", "eval.interval=2"],
         "data.eval_tokens: token id"),
        # the plan, for the 2 nodes the job starts with (known before any node starts)
        ([f"model.hf={gpt2}", f"data.tokens={tokens}", "fault_tolerance=3", f"planner.profile_dir={tmp_path}/p"],
         "fault_tolerance=3 needs 4 replicas"),
        ([f"model.hf={gpt2}", f"data.tokens={tokens}", "planner.memory_per_worker=1KB",
          f"planner.profile_dir={tmp_path}/p"], "no pipeline of 1..2 node(s) fits"),
    ]
    for sets, message in cases:
        code, err = run(tmp_path, capsys, *sets)
        assert code == 2 and err.startswith("error: ") and message in err, (sets, err)
        assert len(err.splitlines()) == 1, err
