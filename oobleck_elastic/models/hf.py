"""Hugging Face causal LMs (GPT-2, Llama) read from a `save_pretrained` directory, as a ModelSpec.

The layers are the embeddings, each decoder block, and the final norm with the LM head. Each
layer module is built from transformers' own submodules (GPT2Block, LlamaDecoderLayer, ...)
under containers that mirror the HF attribute path, so its state_dict keys are the HF model's
own (runtime.model Note: [parameter names]), and its factory reads just its own tensors from the
safetensors file(s). The whole-model forward computes a few things once and hands them to every
block (position ids, the causal mask, Llama's rotary cos/sin); here only one tensor crosses a
layer boundary, so each block recomputes them (see Note: [causal attention]).

Note: [causal attention]
    In transformers 5.25 a block never masks by itself: the model builds the mask once with
    `create_causal_mask`, and the attention function decides. With `sdpa` the builder returns
    None and SDPA runs with `is_causal=True`; with `eager` it returns an additive float mask,
    and eager attention given None attends to every position. A config read by
    `AutoConfig.from_pretrained` has `_attn_implementation = None`, which selects eager
    attention *and* makes `create_causal_mask` return None: a block built from it silently
    attends to the future. So we set `sdpa` (what `from_pretrained` picks for these models, and
    the path to the fused kernels) and still build the mask with `create_causal_mask`, exactly
    as the HF model does, so the block stays causal whatever the implementation.

transformers is imported lazily: `import oobleck_elastic.models.hf` works without it.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oobleck_elastic.errors import ConfigError
from oobleck_elastic.runtime.model import LayerSpec, ModelSpec, SharedParameter

__all__ = ["SUPPORTED_ARCHITECTURES", "causal_lm_loss", "export_hf", "hf_model"]


@dataclass(frozen=True)
class _Arch:
    architecture: str
    name: str
    prefix: str
    """The base model's attribute (`transformer.`, `model.`); some checkpoints store keys without it."""
    embedding: str
    """The input embedding, which a tied LM head shares."""
    ignored: tuple[str, ...]
    """Stored keys HF itself skips on load (old causal-mask and rotary buffers)."""


_ARCHS = {a.architecture: a for a in (
    _Arch("GPT2LMHeadModel", "gpt2", "transformer", "transformer.wte.weight", (r"\.attn\.(masked_)?bias$",)),
    _Arch("LlamaForCausalLM", "llama", "model", "model.embed_tokens.weight", (r"rotary_emb\.inv_freq$",)),
)}
SUPPORTED_ARCHITECTURES = tuple(_ARCHS)

# Config keys that do not change the architecture (bookkeeping, generation and output switches).
_NOT_ARCHITECTURE = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures",
                     "output_hidden_states", "output_attentions", "return_dict", "use_cache", "id2label",
                     "label2id", "problem_type", "bos_token_id", "eos_token_id"}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError("model.hf needs the transformers library: pip install oobleck_elastic[hf]") from exc
    return transformers


def _container(**modules: nn.Module) -> Any:
    """An empty module holding `modules`: one step of the HF attribute path. Any: its
    submodules are attributes added by name, which no type describes."""
    box = nn.Module()
    for name, module in modules.items():
        box.add_module(name, module)
    return box


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _causal_mask(config: Any, hidden: torch.Tensor) -> torch.Tensor | None:
    from transformers.masking_utils import create_causal_mask

    # No position_ids: they are always arange(T) here, and passing them makes transformers look
    # for packed sequences, a host-device sync per block (Note: [causal attention]).
    return create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None)


class GPT2Embeddings(nn.Module):
    """Layer 0 of GPT-2: token plus position embeddings, then dropout, as GPT2Model does."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.transformer = _container(wte=nn.Embedding(config.vocab_size, config.n_embd),
                                      wpe=nn.Embedding(config.n_positions, config.n_embd),
                                      drop=nn.Dropout(config.embd_pdrop))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        return t.drop(t.wte(input_ids) + t.wpe(_positions(input_ids)))


class GPT2Layer(nn.Module):
    """Decoder block `index` of GPT-2 (`transformer.h.{index}`)."""

    def __init__(self, config: Any, index: int) -> None:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        super().__init__()
        self.config, self.index = config, str(index)
        self.transformer = _container(h=nn.ModuleDict({self.index: GPT2Block(config, layer_idx=index)}))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        block = self.transformer.h[self.index]
        return block(hidden, attention_mask=_causal_mask(self.config, hidden), position_ids=_positions(hidden))


class GPT2Head(nn.Module):
    """The last layer of GPT-2: final LayerNorm and LM head, hidden -> logits."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.transformer = _container(ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(hidden))


class LlamaEmbeddings(nn.Module):
    """Layer 0 of Llama: the token embedding (positions enter as rotary embeddings in each block)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.model = _container(embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size,
                                                          config.pad_token_id))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)


class LlamaLayer(nn.Module):
    """Decoder layer `index` of Llama (`model.layers.{index}`) with its own rotary embedding."""

    def __init__(self, config: Any, index: int) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        self.config, self.index = config, str(index)
        self.model = _container(layers=nn.ModuleDict({self.index: LlamaDecoderLayer(config, index)}),
                                rotary_emb=LlamaRotaryEmbedding(config))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = _positions(hidden)
        return self.model.layers[self.index](
            hidden, attention_mask=_causal_mask(self.config, hidden), position_ids=positions,
            position_embeddings=self.model.rotary_emb(hidden, positions))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> LlamaLayer:
        # HF computes the rotary frequencies in float32 and keeps them so whatever the weights'
        # dtype; materialize_layer's .to(bfloat16) would round them. Moves still apply.
        rotary = self.model.rotary_emb
        kept = dict(rotary._buffers)
        super()._apply(fn, recurse)
        for name, old in kept.items():
            if old is not None and not old.is_meta:
                rotary._buffers[name] = old.to(device=rotary._buffers[name].device)
        return self


class LlamaHead(nn.Module):
    """The last layer of Llama: final RMSNorm and LM head, hidden -> logits."""

    def __init__(self, config: Any) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.model = _container(norm=LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))


_LAYERS = {"gpt2": (GPT2Embeddings, GPT2Layer, GPT2Head), "llama": (LlamaEmbeddings, LlamaLayer, LlamaHead)}


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over targets that are not -100; targets are already the next tokens
    (no shift). Half-precision logits are upcast to float32; float32 and float64 stay as they are."""
    flat = logits.flatten(0, 1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    return F.cross_entropy(flat, targets.flatten())


def _read_config(directory: str) -> tuple[Any, _Arch]:
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ConfigError(f"model.hf: {directory} has no config.json; point model.hf at a directory "
                          "written by save_pretrained")
    config = _transformers().AutoConfig.from_pretrained(directory)
    found = list(getattr(config, "architectures", None) or [])
    arch = next((_ARCHS[a] for a in found if a in _ARCHS), None)
    if arch is None:
        raise ConfigError(f"model.hf: {directory}/config.json declares architectures {found}; supported "
                          f"are {', '.join(SUPPORTED_ARCHITECTURES)}")
    config._attn_implementation = "sdpa"  # Note: [causal attention]
    return config, arch


def _stored_files(directory: str) -> dict[str, str]:
    """Stored tensor name -> the safetensors file holding it (reads the index or one header)."""
    from safetensors import safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ConfigError(f"model.hf: {directory} has no safetensors weights (model.safetensors or "
                      "model.safetensors.index.json); save the model there with save_pretrained "
                      "(safe_serialization=True)")


def _plan_loads(directory: str, arch: _Arch, names: list[list[str]], ties: Mapping[str, str],
                stored: Mapping[str, str]) -> list[dict[str, tuple[str, str]]]:
    """Per layer: parameter name -> (file, stored key). A tied copy loads from its source, so
    both copies start bit-identical; a key may be stored without the base-model prefix."""
    used: set[str] = set()
    plans = []
    for layer, layer_names in enumerate(names):
        plan = {}
        for name in layer_names:
            candidates = [ties.get(name, name), name]
            candidates += [c.removeprefix(arch.prefix + ".") for c in candidates]
            key = next((c for c in candidates if c in stored), None)
            if key is None:
                raise ConfigError(f"model.hf: {directory} stores no weight {name!r} (layer {layer}); the "
                                  "weights do not match config.json, re-save the model with save_pretrained")
            used.add(key)
            plan[name] = (stored[key], key)
        plans.append(plan)
    extra = sorted(k for k in stored if k not in used and not any(re.search(p, k) for p in arch.ignored))
    if extra:
        raise ConfigError(f"model.hf: {directory} stores weights no layer of this {arch.name} config uses: "
                          f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}; the weights do not "
                          "match config.json, re-save the model with save_pretrained")
    return plans


def _read(plan: Mapping[str, tuple[str, str]], expected: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in sorted({path for path, _ in plan.values()}):
        with safe_open(path, "pt") as f:
            out |= {name: f.get_tensor(key) for name, (p, key) in plan.items() if p == path}
    for name, tensor in out.items():
        if tensor.shape != expected[name].shape:
            raise ConfigError(f"model.hf: weight {name!r} in {plan[name][0]} has shape {list(tensor.shape)}, "
                              f"config.json implies {list(expected[name].shape)}")
    return out


def _factory(build: Callable[[], nn.Module], plan: Mapping[str, tuple[str, str]]) -> Callable[[], nn.Module]:
    def factory() -> nn.Module:
        module = build()
        state = module.state_dict()
        if any(t.is_meta for t in state.values()):  # model_fingerprint: shapes only, read nothing
            return module
        module.load_state_dict(_read(plan, state), strict=True)
        return module
    return factory


def hf_model(directory: str, *, seq_len: int | None = None) -> ModelSpec:
    """The ModelSpec of the GPT-2 or Llama causal LM saved in `directory` (config.json plus
    safetensors weights, one file or sharded), starting from exactly those weights.
    `seq_len` is the length of the profiler's sample batch (default min(128, max positions))."""
    directory = os.path.expanduser(directory)
    config, arch = _read_config(directory)
    max_positions = int(config.max_position_embeddings)
    seq_len = min(128, max_positions) if seq_len is None else seq_len
    if not 1 <= seq_len <= max_positions:
        raise ConfigError(f"data.seq_len ({seq_len}) is longer than the model's {max_positions} positions "
                          f"(model.hf: {directory}); set data.seq_len <= {max_positions}")
    embed_cls, block_cls, head_cls = _LAYERS[arch.name]
    n = config.num_hidden_layers
    builds: list[Callable[[], nn.Module]] = [lambda: embed_cls(config)]
    builds += [functools.partial(block_cls, config, i) for i in range(n)]
    builds.append(lambda: head_cls(config))
    with torch.device("meta"):
        names = [list(build().state_dict()) for build in builds]
    tied = bool(getattr(config, "tie_word_embeddings", True))
    ties = {"lm_head.weight": arch.embedding} if tied else {}
    plans = _plan_loads(directory, arch, names, ties, _stored_files(directory))
    full = json.loads(config.to_json_string(use_diff=False))
    full.pop("_name_or_path", None)
    description = {k: v for k, v in full.items() if k not in _NOT_ARCHITECTURE}
    description["architecture"] = arch.architecture
    vocab = int(config.vocab_size)

    def sample_batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    layer_names = ["embed", *(f"block{i}" for i in range(n)), "head"]
    return ModelSpec(
        name=arch.name,
        layers=tuple(LayerSpec(nm, _factory(b, p)) for nm, b, p in zip(layer_names, builds, plans)),
        loss=causal_lm_loss, sample_batch=sample_batch, description=description,
        shared=(SharedParameter(((0, arch.embedding), (n + 1, "lm_head.weight"))),) if tied else (),
        export={"format": "hf", "config": full}, vocab_size=vocab, max_positions=max_positions)


def export_hf(state: Mapping[str, torch.Tensor], export_info: Mapping[str, Any], out_dir: str) -> None:
    """Writes `state` (every layer's state_dict merged) as a HF model directory that
    `AutoModelForCausalLM.from_pretrained(out_dir)` loads, in `state`'s dtype."""
    transformers = _transformers()
    info = dict(export_info["config"])
    config = transformers.AutoConfig.for_model(info.pop("model_type"), **info)
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"export_hf needs one floating dtype in the state, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    arch = _ARCHS[config.architectures[0]]
    if getattr(config, "tie_word_embeddings", True) and not torch.equal(state[arch.embedding],
                                                                        state["lm_head.weight"]):
        raise ValueError(f"{arch.embedding} and lm_head.weight are tied but differ in the state; "
                         "the copies of a tied parameter must stay identical")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(dict(state), strict=True)
    model.save_pretrained(out_dir)
