"""models.hf: tiny random GPT-2 and Llama models saved with save_pretrained, run layer by layer
in float64 against the HF model itself (logits, gradients, state, export), plus the errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

# Set before transformers is imported: nothing in these tests may reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import safetensors.torch as safetensors_torch  # noqa: E402
import transformers  # noqa: E402

from oobleck_elastic.errors import ConfigError  # noqa: E402
from oobleck_elastic.models.hf import causal_lm_loss, export_hf, hf_model  # noqa: E402
from oobleck_elastic.runtime.model import materialize_layer, model_fingerprint  # noqa: E402

GPT2 = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64)
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
KINDS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)),
    "gpt2_nodrop": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2, **NO_DROPOUT)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)),
    "llama_tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)),
}
SHARDED = "llama_sharded"  # KINDS["llama"] saved in 20 KB shards with an index


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> directory written by save_pretrained (each built once per module)."""
    dirs: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in dirs:
            torch.manual_seed(len(dirs))
            model = KINDS["llama" if kind == SHARDED else kind]()
            with torch.no_grad():  # norms start at 1 and biases at 0: perturb so a swapped key shows
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            out = str(tmp_path_factory.mktemp(kind))
            model.save_pretrained(out, **({"max_shard_size": "20KB"} if kind == SHARDED else {}))
            dirs[kind] = out
        return dirs[kind]
    return get


def _layers(spec, dtype=torch.float64):
    return [materialize_layer(spec, i, seed=0, dtype=dtype) for i in range(spec.num_layers)]


def _run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _reference(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).double()


def _assert_close(ours, theirs, what=""):
    scale = theirs.abs().max().clamp_min(1e-30)
    assert (ours - theirs).abs().max() <= 1e-10 * scale, what


def _inputs(spec, batch=3):
    x, y = spec.sample_batch(batch)
    y[0, :5] = -100  # ignored targets stay ignored
    return x, y


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_tied", SHARDED])
def test_logits_match_hf_in_eval_mode(saved, kind):
    spec = hf_model(saved(kind))
    layers = [layer.eval() for layer in _layers(spec)]
    x, _ = _inputs(spec)
    with torch.no_grad():
        _assert_close(_run(layers, x), _reference(saved(kind)).eval()(x).logits)


@pytest.mark.parametrize("kind", ["gpt2_nodrop", "llama"])
def test_logits_match_hf_in_train_mode_without_dropout(saved, kind):
    spec = hf_model(saved(kind))
    x, _ = _inputs(spec)
    with torch.no_grad():
        _assert_close(_run([layer.train() for layer in _layers(spec)], x), _reference(saved(kind)).train()(x).logits)


def test_bfloat16_run_matches_hf_loaded_in_bfloat16(saved):
    """The rotary frequencies stay float32 as in HF, not rounded by materialize_layer's .to()."""
    spec = hf_model(saved("llama"))
    layers = [layer.eval() for layer in _layers(spec, torch.bfloat16)]
    assert layers[1].model.rotary_emb.inv_freq.dtype == torch.float32
    ref = transformers.AutoModelForCausalLM.from_pretrained(saved("llama"), dtype=torch.bfloat16).eval()
    x, _ = _inputs(spec)
    with torch.no_grad():
        assert torch.equal(_run(layers, x), ref(x).logits)


def test_dropout_follows_train_and_eval(saved):
    layers = _layers(hf_model(saved("gpt2")))  # GPT2Config's default dropout is 0.1
    x, _ = _inputs(hf_model(saved("gpt2")))
    with torch.no_grad():
        assert not torch.equal(_run([m.train() for m in layers], x), _run(layers, x))
        assert torch.equal(_run([m.eval() for m in layers], x), _run(layers, x))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_attention_is_causal(saved, kind):
    layers = [layer.eval() for layer in _layers(hf_model(saved(kind)))]
    x = torch.randint(97, (2, 16))
    changed = x.clone()
    changed[:, -1] = (x[:, -1] + 1) % 97
    with torch.no_grad():
        a, b = _run(layers, x), _run(layers, changed)
    assert torch.equal(a[:, :-1], b[:, :-1]), "an earlier position saw a later token"
    assert not torch.equal(a[:, -1], b[:, -1])


@pytest.mark.parametrize("kind", ["gpt2_nodrop", "llama", "llama_tied"])
def test_gradients_match_hf(saved, kind):
    spec = hf_model(saved(kind))
    layers = _layers(spec)
    ref = _reference(saved(kind))
    x, y = _inputs(spec)
    causal_lm_loss(_run(layers, x), y).backward()
    causal_lm_loss(ref(x).logits, y).backward()
    grads: dict[str, torch.Tensor] = {}
    for layer in layers:
        for name, p in layer.named_parameters():
            grads[name] = p.grad
    for group in spec.shared:  # HF has one tied parameter: its gradient is the sum of our copies'
        names = [name for _, name in group.members]
        total = sum(grads.pop(name) for name in names)
        grads[names[0]] = total
    theirs = dict(ref.named_parameters())
    assert sorted(grads) == sorted(theirs)
    for name, grad in grads.items():
        _assert_close(grad, theirs[name].grad, name)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama_tied", SHARDED])
def test_state_dict_is_the_hf_state_dict(saved, kind):
    merged: dict[str, torch.Tensor] = {}
    for layer in _layers(hf_model(saved(kind))):
        assert not merged.keys() & layer.state_dict().keys()
        merged.update(layer.state_dict())
    theirs = _reference(saved(kind)).state_dict()
    assert sorted(merged) == sorted(theirs)
    assert all(torch.equal(merged[k], v) for k, v in theirs.items())


def test_layer_names_and_ties(saved):
    gpt2, llama, tied = (hf_model(saved(k)) for k in ("gpt2", "llama", "llama_tied"))
    names = [list(m.state_dict()) for m in _layers(gpt2)]
    assert names[0] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert names[1][0] == "transformer.h.0.ln_1.weight" and all(n.startswith("transformer.h.1.") for n in names[2])
    assert names[3] == ["transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]
    assert [g.members for g in gpt2.shared] == [((0, "transformer.wte.weight"), (3, "lm_head.weight"))]
    assert llama.shared == ()
    assert [g.members for g in tied.shared] == [((0, "model.embed_tokens.weight"), (3, "lm_head.weight"))]
    llama_names = [list(m.state_dict()) for m in _layers(llama)]
    assert llama_names[0] == ["model.embed_tokens.weight"] and llama_names[3] == ["model.norm.weight", "lm_head.weight"]
    assert not any("inv_freq" in n for layer in llama_names for n in layer)


@pytest.mark.parametrize("kind", ["gpt2", "llama_tied"])
def test_export_round_trips(saved, kind, tmp_path):
    spec = hf_model(saved(kind))
    merged = {k: v for layer in _layers(spec) for k, v in layer.state_dict().items()}
    export_hf(merged, json.loads(json.dumps(spec.export)), str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).state_dict()
    assert sorted(back) == sorted(merged)
    assert all(v.dtype == torch.float64 and torch.equal(merged[k], v) for k, v in back.items())


def test_meta_factories_read_nothing(saved, monkeypatch, tmp_path):
    directory = shutil.copytree(saved("gpt2"), tmp_path / "gpt2")
    spec = hf_model(str(directory))  # reads the safetensors header: which keys, in which file
    others = {k: hf_model(saved(k)) for k in ("gpt2", "llama", "llama_tied")}
    first = model_fingerprint(spec, torch.float64)
    os.remove(directory / "model.safetensors")

    def no_reading(*args, **kwargs):
        raise AssertionError("a factory opened a weights file")
    monkeypatch.setattr("safetensors.safe_open", no_reading)
    prints = {k: model_fingerprint(s, torch.float64) for k, s in others.items()}
    assert model_fingerprint(spec, torch.float64) == first == prints["gpt2"]  # independent of the path
    assert len(set(prints.values())) == 3
    with pytest.raises(AssertionError, match="opened a weights file"):  # off meta the patch does bite
        materialize_layer(spec, 0, seed=0, dtype=torch.float64)


def test_description_and_sample_batch(saved):
    spec = hf_model(saved("gpt2"))
    assert spec.name == "gpt2" and spec.vocab_size == 97 and spec.max_positions == 64
    assert spec.description["architecture"] == "GPT2LMHeadModel" and spec.description["n_embd"] == 32
    assert not {"transformers_version", "_name_or_path", "dtype", "torch_dtype"} & spec.description.keys()
    assert spec.export["format"] == "hf" and spec.export["config"]["model_type"] == "gpt2"
    json.dumps([spec.description, spec.export])
    x, y = spec.sample_batch(2)
    assert x.shape == y.shape == (2, 64) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(spec.sample_batch(2)[0], x)
    assert hf_model(saved("llama"), seq_len=16).sample_batch(3)[0].shape == (3, 16)
    with pytest.raises(ConfigError, match="seq_len"):
        hf_model(saved("llama"), seq_len=65)


def test_loss_dtype_and_ignore_index():
    logits, targets = torch.randn(2, 3, 5, dtype=torch.float64), torch.tensor([[1, -100, 2], [0, 4, -100]])
    loss = causal_lm_loss(logits, targets)
    assert loss.dtype == torch.float64
    kept = targets.flatten() != -100
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1)[kept], targets.flatten()[kept])
    assert torch.equal(loss, expected)
    assert causal_lm_loss(logits.bfloat16(), targets).dtype == torch.float32


def _rewrite(directory, change):
    path = os.path.join(directory, "model.safetensors")
    tensors = safetensors_torch.load_file(path)
    safetensors_torch.save_file(change(tensors), path, metadata={"format": "pt"})


def test_stored_keys_without_prefix_and_ignored_buffers_load(saved, tmp_path):
    directory = str(shutil.copytree(saved("gpt2"), tmp_path / "gpt2"))
    _rewrite(directory, lambda t: {k.removeprefix("transformer."): v for k, v in t.items()}
             | {"h.0.attn.bias": torch.ones(1, 1, 64, 64)})  # the Hub's gpt2 checkpoint looks like this
    layers = [m.eval() for m in _layers(hf_model(directory))]
    x = torch.randint(97, (2, 8))
    with torch.no_grad():
        _assert_close(_run(layers, x), _reference(saved("gpt2")).eval()(x).logits)


def test_errors(saved, tmp_path, monkeypatch):
    usage = "has no config.json; point model.hf at a directory written by save_pretrained"
    with pytest.raises(ConfigError, match="missing " + usage):
        hf_model(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=usage):
        hf_model(str(tmp_path))
    other = shutil.copytree(saved("gpt2"), tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2ForSequenceClassification"]}))
    with pytest.raises(ConfigError, match="GPT2ForSequenceClassification.*GPT2LMHeadModel, LlamaForCausalLM"):
        hf_model(str(other))
    bare = shutil.copytree(saved("gpt2"), tmp_path / "bare")
    os.remove(bare / "model.safetensors")
    with pytest.raises(ConfigError, match="no safetensors weights.*save_pretrained"):
        hf_model(str(bare))
    missing = str(shutil.copytree(saved("gpt2"), tmp_path / "missing_key"))
    _rewrite(missing, lambda t: {k: v for k, v in t.items() if k != "transformer.h.1.ln_2.bias"})
    with pytest.raises(ConfigError, match=r"no weight 'transformer.h.1.ln_2.bias' \(layer 2\)"):
        hf_model(missing)
    extra = str(shutil.copytree(saved("gpt2"), tmp_path / "extra_key"))
    _rewrite(extra, lambda t: t | {"transformer.h.0.adapter.weight": torch.zeros(2)})
    with pytest.raises(ConfigError, match="no layer of this gpt2 config uses: transformer.h.0.adapter.weight"):
        hf_model(extra)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"pip install oobleck_elastic\[hf\]"):
        hf_model(saved("gpt2"))


def test_shape_mismatch_names_the_weight(saved, tmp_path):
    directory = str(shutil.copytree(saved("gpt2"), tmp_path / "gpt2"))
    _rewrite(directory, lambda t: t | {"transformer.wpe.weight": torch.zeros(32, 32)})
    spec = hf_model(directory)
    shapes = r"'transformer.wpe.weight' .* shape \[32, 32\], config.json implies \[64, 32\]"
    with pytest.raises(ConfigError, match=shapes):
        materialize_layer(spec, 0, seed=0, dtype=torch.float64)


def test_import_needs_no_transformers():
    code = "import sys; sys.modules['transformers'] = None; import oobleck_elastic.models.hf"
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
