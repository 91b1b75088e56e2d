"""Token files: exact samples and targets, each error message, and the prepare CLI in this
process (as a module of its own: tests/jobs/test_data_jobs.py)."""

from __future__ import annotations

import os
import pickle
import sys

import numpy as np
import pytest
import torch
from hf_fixtures import DOCS, make_tokenizer

from oobleck_elastic.config.schema import DataConfig
from oobleck_elastic.data import TokenFile
from oobleck_elastic.data.prepare import choose_dtype, main
from oobleck_elastic.errors import ConfigError


def write_tokens(path, values, dtype="uint16"):
    np.asarray(values, dtype=dtype).tofile(path)
    return str(path)


@pytest.mark.parametrize("dtype, offset", [("uint16", 60_000), ("uint32", 4_000_000_000)])
def test_samples_and_targets_are_exact(tmp_path, dtype, offset):
    tokens = [offset + k for k in range(14)]  # 14 tokens, T=4: (14 - 1) // 4 = 3 samples
    data = TokenFile(write_tokens(tmp_path / "t.bin", tokens, dtype), seq_len=4, dtype=dtype)
    assert len(data) == 3 and data.num_tokens == 14
    inputs, targets = data.batch([2, 0])
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.tolist() == [tokens[8:12], tokens[0:4]]
    assert targets.tolist() == [tokens[9:13], tokens[1:5]]


def test_inputs_and_targets_equal_the_halves_of_batch(tmp_path):
    data = TokenFile(write_tokens(tmp_path / "t.bin", range(100)), seq_len=7)
    indices = [5, 1, 13, 1]
    inputs, targets = data.batch(indices)
    assert torch.equal(data.inputs(indices), inputs)
    assert torch.equal(data.targets(indices), targets)
    assert data.target_count(indices) == 4 * 7
    assert data.batch([])[0].shape == (0, 7) and data.target_count([]) == 0


def test_index_out_of_range(tmp_path):
    data = TokenFile(write_tokens(tmp_path / "t.bin", range(9)), seq_len=4)
    with pytest.raises(IndexError, match="sample index 2 is out of range: .* holds 2 samples"):
        data.inputs([0, 2])


def test_from_config_and_pickle(tmp_path):
    path = write_tokens(tmp_path / "t.bin", range(50), "uint32")
    data = TokenFile.from_config(DataConfig(tokens=path, token_dtype="uint32", seq_len=5),
                                 vocab_size=50)
    assert (len(data), data.seq_len, data.dtype) == (9, 5, "uint32")
    clone = pickle.loads(pickle.dumps(data))  # reopens the map rather than copying the file
    assert torch.equal(clone.targets([8]), data.targets([8]))
    with pytest.raises(ConfigError, match="data.tokens is not set"):
        TokenFile.from_config(DataConfig(), vocab_size=None)


def test_size_not_a_multiple_of_the_dtype(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(1001))
    with pytest.raises(ConfigError, match=r"is 1001 bytes, not a multiple of uint16's 2 bytes: "
                                          r"was it written with data.token_dtype=uint32\?"):
        TokenFile(path, seq_len=4)
    path.write_bytes(bytes(1002))
    with pytest.raises(ConfigError,
                       match="not a multiple of uint32's 4 bytes: .*token_dtype=uint16"):
        TokenFile(path, seq_len=4, dtype="uint32")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="data.tokens: no such file .*nope.bin"):
        TokenFile(tmp_path / "nope.bin", seq_len=4)


def test_too_short_for_one_sample(tmp_path):
    path = write_tokens(tmp_path / "t.bin", range(4))
    with pytest.raises(ConfigError, match="holds 4 tokens, too few for one sample of "
                                          r"data.seq_len=4 \(needs seq_len \+ 1 = 5\)"):
        TokenFile(path, seq_len=4)
    assert len(TokenFile(path, seq_len=3)) == 1


def test_id_beyond_the_vocabulary_is_caught_on_each_batch(tmp_path):
    tokens = list(range(20))
    tokens[12] = 999  # with seq_len 4: an input of sample 3 and a target of sample 2
    data = TokenFile(write_tokens(tmp_path / "t.bin", tokens), seq_len=4, vocab_size=100)
    data.batch([0, 1])  # clean samples load
    message = (r"token id 999 in sample {} .* >= the model's vocab_size 100: "
               r"the tokenizer .* do not match")
    with pytest.raises(ConfigError, match=message.format(2)):
        data.batch([0, 2])
    with pytest.raises(ConfigError, match=message.format(3)):
        data.inputs([1, 3])
    with pytest.raises(ConfigError, match=message.format(2)):
        data.targets([1, 2])
    # each half checks only what it reads: sample 3's targets and sample 2's inputs are clean
    assert data.targets([3]).tolist() == [[13, 14, 15, 16]]
    assert data.inputs([2]).tolist() == [[8, 9, 10, 11]]


# --- python -m oobleck_elastic.data.prepare ---------------------------------------------------


def test_prepare_writes_documents_joined_by_eos(tokenizer_dir, texts, tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "sub" / "train.bin"
    assert main(["--tokenizer", str(tokenizer_dir), "--output", str(out), *texts]) == 0
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = [tok(doc, add_special_tokens=False)["input_ids"] for doc in DOCS]
    expected = ids[0] + [tok.eos_token_id] + ids[1]
    assert np.fromfile(out, dtype="<u2").tolist() == expected
    printed = capsys.readouterr().out
    assert f"wrote {len(expected)} tokens (uint16, vocabulary of {len(tok)})" in printed
    assert f"tokens: {out}\n    token_dtype: uint16" in printed
    assert [p.name for p in out.parent.iterdir()] == ["train.bin"]  # no temporary left behind
    data = TokenFile(out, seq_len=3, vocab_size=len(tok))
    assert data.inputs([0]).tolist() == [expected[:3]]

    assert main(["--tokenizer", str(tokenizer_dir), "--output", str(out), "--dtype", "uint32",
                 *texts]) == 0
    assert np.fromfile(out, dtype="<u4").tolist() == expected


def test_choose_dtype():
    assert choose_dtype(65_536) == "uint16"
    assert choose_dtype(65_537) == "uint32"
    assert choose_dtype(100, "uint32") == "uint32"
    with pytest.raises(ConfigError, match="--dtype uint16 holds ids below 65536, but .* 70000 "
                                          "tokens; use --dtype uint32"):
        choose_dtype(70_000, "uint16")


def test_prepare_errors(tokenizer_dir, texts, tmp_path, capsys):
    out = str(tmp_path / "x.bin")
    assert main(["--tokenizer", str(tmp_path / "none"), "--output", out, *texts]) == 2
    assert capsys.readouterr().err.startswith("error: --tokenizer ")
    assert main(["--tokenizer", str(tokenizer_dir), "--output", out, texts[0], "gone.txt"]) == 2
    assert capsys.readouterr().err == "error: no such text file 'gone.txt'\n"
    assert main(["--tokenizer", str(tmp_path), "--output", out, *texts]) == 2  # no tokenizer in it
    err = capsys.readouterr().err
    assert err.startswith(f"error: could not load a tokenizer from '{tmp_path}': ")
    assert err.count("\n") == 1
    assert not os.path.exists(out)


def test_prepare_without_transformers(tokenizer_dir, texts, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    out = str(tmp_path / "x.bin")
    assert main(["--tokenizer", str(tokenizer_dir), "--output", out, *texts]) == 2
    assert "pip install 'oobleck_elastic[hf]'" in capsys.readouterr().err


def test_prepare_without_eos_concatenates(texts, tmp_path, capsys):
    from transformers import AutoTokenizer

    directory = make_tokenizer(tmp_path / "tok", DOCS, eos_token=None)
    out = tmp_path / "x.bin"
    assert main(["--tokenizer", str(directory), "--output", str(out), *texts]) == 0
    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    expected = sum((tok(doc, add_special_tokens=False)["input_ids"] for doc in DOCS), [])
    assert np.fromfile(out, dtype="<u2").tolist() == expected
