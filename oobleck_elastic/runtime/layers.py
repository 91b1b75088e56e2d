"""The layers a worker holds: module, optimizer and learning-rate schedule, per layer.

A worker's LayerStore outlives generations: a new generation takes the modules it still runs,
drops the ones it no longer needs (after transfers), and materialises or receives the rest.
Each layer has its own optimizer so its full state (parameters, optimizer tensors, step
counter) can be copied to another worker as one unit.

Note: [mixed precision]
    Under train.precision bf16-mixed a layer has two modules: `module`, the float32 master
    (parameters, the gradients that are summed across pipelines and clipped, the optimizer
    and its state: everything checkpoints and layer transfers carry), and `compute`, a
    bfloat16 copy that the pipeline stage runs forward and backward. Each bf16 gradient is
    added into the master's float32 .grad as soon as autograd has accumulated it (a
    post-accumulate-grad hook), then dropped, so microbatches accumulate in float32. The copy
    is refreshed from the master at the start of every step (`refresh_compute`), whatever
    wrote the master since (optimizer step, transfer, checkpoint restore). Activations and
    their gradients cross stage boundaries in bfloat16. Under every other precision
    `compute` is `module` itself and nothing is copied.

    Buffers a forward changes (BatchNorm's running statistics and num_batches_tracked) change
    in the copy, so the trainer's apply() copies the copy's persistent buffers back into the
    master (`buffers_into_master`) before the optimizer step: from then on checkpoints,
    transfers and exports carry them. apply() and not the end of the forward because apply()
    is the step's commit: a step that fails after its forward is replayed from a master that
    its forward never touched, so its statistics count once; an evaluation's forward changes
    the copy alone, which the next refresh overwrites. Precision: the statistics are computed
    and kept in bfloat16 (8 significant bits), so the float32 master holds bf16-rounded values,
    not what a float32 run computes: BatchNorm's running mean and variance are off by about
    1% after 12 updates (tests/multiproc/test_mixed_buffers.py), and an update below bfloat16's
    resolution is lost, as in a bf16 run. Integer buffers are copied exactly. A float buffer
    no forward changed keeps the master's float32 value: the copy-back takes, element by
    element, only values that differ from the master's rounding. A layer without persistent
    buffers does nothing.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from oobleck_elastic.config import TrainConfig
from oobleck_elastic.runtime.model import DTYPES, ModelSpec, materialize_layer
from oobleck_elastic.runtime.supported import optimizer_class

__all__ = ["LayerState", "LayerStore", "flatten", "unflatten"]


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer holding `tensors` (same dtype and device) one after another: what
    a single collective or send moves."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `like`, in order (the inverse of flatten)."""
    return [part.view_as(t) for part, t in zip(torch.split(flat, [t.numel() for t in like]), like)]


def _param_groups(named: list[tuple[str, nn.Parameter]], train: TrainConfig,
                  canonical: Mapping[str, str]) -> list[dict]:
    """One group, or two when train.no_weight_decay names some parameters (matched on the
    model's own names; a tied copy goes by its canonical name, so all copies decay alike)."""
    patterns = train.no_weight_decay
    if not patterns:
        return [{"params": [p for _, p in named]}]
    decayed: list[nn.Parameter] = []
    exempt: list[nn.Parameter] = []
    for name, p in named:
        key = canonical.get(name, name)
        (exempt if any(fnmatch.fnmatchcase(key, pat) for pat in patterns) else decayed).append(p)
    return [g for g in ({"params": decayed}, {"params": exempt, "weight_decay": 0.0}) if g["params"]]


class LayerState:
    """One layer's module and optimizer. `canonical` maps the names of this layer's tied copies
    to their canonical parameter's name (runtime.model Note: [tied parameters])."""

    def __init__(self, module: nn.Module, train: TrainConfig, canonical: Mapping[str, str] | None = None) -> None:
        self.module = module
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.compute = self._compute_copy(module, DTYPES[train.compute_dtype]) if train.mixed else module
        # the buffers a forward may change in the copy and a checkpoint carries (persistent ones)
        self._buffer_names = [] if self.compute is module else [
            n for n, _ in module.named_buffers() if n in module.state_dict(keep_vars=True)]
        cls = optimizer_class(train.optimizer)
        groups = _param_groups(self.named_params, train, canonical or {})
        self.optimizer = cls(groups, **dict(train.optimizer.kwargs)) if self.params else None
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def _compute_copy(self, module: nn.Module, dtype: torch.dtype) -> nn.Module:
        """The low-precision copy the stage runs, its gradients routed into the master's
        (Note: [mixed precision])."""
        compute = copy.deepcopy(module).to(dtype=dtype)
        copies = [p for p in compute.parameters() if p.requires_grad]
        assert len(copies) == len(self.params), "a module's copy has the same trainable parameters"
        for low, master in zip(copies, self.params):
            low.register_post_accumulate_grad_hook(self._into_master(master))
        return compute

    @staticmethod
    def _into_master(master: nn.Parameter):
        def hook(low: torch.Tensor) -> None:
            assert low.grad is not None, "torch runs the hook once the gradient is accumulated"
            if master.grad is None:
                master.grad = low.grad.to(master.dtype)
            else:
                master.grad.add_(low.grad)
            low.grad = None
        return hook

    def refresh_compute(self) -> None:
        """Copies the master parameters and buffers into the compute copy (no-op unless mixed)."""
        if self.compute is self.module:
            return
        with torch.no_grad():
            for low, master in zip(self.compute.state_dict(keep_vars=True).values(),
                                   self.module.state_dict(keep_vars=True).values()):
                low.copy_(master)

    def buffers_into_master(self) -> None:
        """Copies the compute copy's buffers into the master's, in its dtype (Note: [mixed
        precision]); nothing without persistent buffers or unless mixed."""
        if not self._buffer_names:
            return
        with torch.no_grad():
            for name in self._buffer_names:
                # by name: a module may assign a new tensor to its buffer instead of writing it
                low, master = self.compute.get_buffer(name), self.module.get_buffer(name)
                if master.is_floating_point():  # where the copy still holds the master's rounding, keep the master's
                    master.copy_(torch.where(low == master.to(low.dtype), master, low.to(master.dtype)))
                else:
                    master.copy_(low)

    def set_lr(self, factor: float) -> None:
        if self.optimizer:
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base * factor

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grads(self, exclude: Iterable[str] = ()) -> list[torch.Tensor]:
        """Gradients (of every parameter but those named in `exclude`), materialising zeros for
        parameters that got none this step."""
        skip = set(exclude)
        grads = []
        for n, p in self.named_params:  # self.params, with their names
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if n not in skip:
                grads.append(p.grad)
        return grads

    def grad_of(self, name: str) -> torch.Tensor:
        self.grads()
        grad = self.module.get_parameter(name).grad
        assert grad is not None, f"{name} is a trainable parameter of the layer"
        return grad

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything a replica of this layer is made of, in a fixed order: parameters and
        buffers, then the optimizer's per-parameter state tensors (sorted keys)."""
        tensors = list(self.module.state_dict(keep_vars=True).values())
        if self.optimizer:
            for p in self.params:
                state = self.optimizer.state.get(p, {})
                for key in sorted(state):
                    value = state[key]
                    if not torch.is_tensor(value):
                        raise TypeError(f"optimizer state {key!r} is not a tensor; cannot transfer it")
                    tensors.append(value)
        return tensors

    def has_optimizer_state(self) -> bool:
        return bool(self.optimizer and self.optimizer.state)

    def prime_optimizer(self) -> None:
        """Creates the optimizer's state tensors, their values undefined, for a transfer or a
        checkpoint to overwrite (Note: [priming on meta])."""
        if not self.optimizer or self.optimizer.state:
            return
        try:
            self._prime_on_meta()
        except Exception:  # an optimizer whose step does not run on meta (ASGD reads .item())
            self.optimizer.state.clear()
            for p in self.params:
                p.grad = torch.zeros_like(p)
            self.optimizer.step()  # changes the parameters too, which are overwritten as well
            self.zero_grad()

    def _prime_on_meta(self) -> None:
        """Note: [priming on meta]
            A torch optimizer creates its per-parameter state in its first step. Running that
            step on the real parameters costs several passes over them (0.5 s for a 150 MB
            AdamW layer on one core) only to be overwritten. So the same optimizer class, with
            the same groups, steps once on meta copies of the parameters: that gives the state's
            keys, shapes and dtypes for free, and each tensor is then allocated (not filled) on
            the layer's device; scalars the optimizer keeps on the CPU (AdamW's `step`) are
            copied. The state is what a real first step makes, key for key."""
        assert self.optimizer is not None, "called by prime_optimizer() for a layer with an optimizer"
        meta = {p: nn.Parameter(torch.empty_like(p, device="meta")) for p in self.params}
        for m in meta.values():
            m.grad = torch.empty_like(m)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [meta[p] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        # ignore: the base Optimizer's signature (params, defaults) is not its subclasses' (params, **options)
        shadow = type(self.optimizer)(groups)  # type: ignore[call-arg]
        shadow.step()
        for p, m in meta.items():
            self.optimizer.state[p] = {
                k: (torch.empty_like(v, device=p.device) if v.is_meta else v.clone()) if torch.is_tensor(v) else v
                for k, v in shadow.state[m].items()}


class LayerStore:
    """The layers this worker holds, by index."""

    def __init__(self, model: ModelSpec, train: TrainConfig, device: torch.device) -> None:
        self.model = model
        self.train = train
        self.device = device
        self.dtype = DTYPES[train.param_dtype]
        """dtype of the master parameters (Note: [mixed precision])."""
        self.compute_dtype = DTYPES[train.compute_dtype]
        """dtype the stages compute in and send between them."""
        self.layers: dict[int, LayerState] = {}

    def materialize(self, index: int, *, init: bool = True) -> LayerState:
        """Builds layer `index`; `init=False` for one whose whole state is about to arrive."""
        module = materialize_layer(self.model, index, seed=self.train.seed, dtype=self.dtype, device=self.device,
                                   init=init)
        canonical = {name: canon for name, (_, canon) in self.model.tied_copies().get(index, {}).items()}
        state = LayerState(module, self.train, canonical)
        self.layers[index] = state
        return state

    def refresh_compute(self, indices: Iterable[int]) -> None:
        """Brings the compute copies of these layers up to their masters (Note: [mixed precision])."""
        for index in indices:
            self.layers[index].refresh_compute()

    def keep_only(self, indices: Iterable[int]) -> None:
        keep = set(indices)
        for index in [i for i in self.layers if i not in keep]:
            del self.layers[index]

    def __contains__(self, index: int) -> bool:
        return index in self.layers

    def __getitem__(self, index: int) -> LayerState:
        return self.layers[index]
