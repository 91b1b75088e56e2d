"""The training loop of one worker: builds generations, runs steps, reports metrics.

A Trainer lives as long as its worker process. It holds the LayerStore (state that survives
generations) and at most one Generation at a time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from oobleck_elastic.config import JobConfig
from oobleck_elastic.errors import ConfigError
from oobleck_elastic.planning import Transfer, WorkerRef
from oobleck_elastic.runtime.checkpoint import CheckpointUnreadable, restore_layers
from oobleck_elastic.runtime.data import BatchLoader, Dataset, SampleOrder
from oobleck_elastic.runtime.devices import resolve_device
from oobleck_elastic.runtime.fault_hook import NO_FAULTS, FaultHook
from oobleck_elastic.runtime.generation import Generation
from oobleck_elastic.runtime.layers import LayerStore
from oobleck_elastic.runtime.lr import lr_factor
from oobleck_elastic.runtime.model import ModelSpec, boundary_activations, layer_seed
from oobleck_elastic.runtime.plan import GenerationPlan
from oobleck_elastic.runtime.supported import check_supported
from oobleck_elastic.runtime.transfer import run_transfers

__all__ = ["Trainer", "StepStats", "Dataset"]  # Dataset: runtime.data

logger = logging.getLogger(__name__)


@dataclass
class _Computed:
    """A step whose gradients are summed and reduced but not yet applied."""

    stats: StepStats
    clip_coef: float


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    samples: int
    grad_norm: float
    seconds: float
    """The step's compute time, the same on every worker: pipeline 0's first stage's, from its
    start to its gradients summed across the pipelines."""
    consumed: tuple[int, ...] = ()
    """Dataset indices this worker's last stage consumed (empty elsewhere)."""
    tokens: int = 0
    """Counted target elements of the global batch (the loss's denominator)."""
    lr: float | None = None
    """Learning rate of this step (the optimizer's lr times the schedule's factor)."""


class Trainer:
    def __init__(self, *, model: ModelSpec, dataset: Dataset, cfg: JobConfig, me: WorkerRef,
                 store: dist.Store, device: torch.device | str | None = None, fault: FaultHook = NO_FAULTS,
                 eval_dataset: Dataset | None = None, store_address: tuple[str, int] | None = None) -> None:
        """`store_address`: the membership store's (host, port), whose connections a cut spares."""
        check_supported(cfg)
        self.store_address = store_address
        self.fault = fault
        self._fault_step: int | None = None  # see fault_step
        self.model = model
        self.dataset = dataset
        self.cfg = cfg
        self.me = me
        self.store = store
        # None: train.device, resolved for this worker's local rank (runtime.devices)
        device = resolve_device(cfg.train.device, me.local_rank) if device is None else torch.device(device)
        self.layers = LayerStore(model, cfg.train, device)
        self.order = SampleOrder(len(dataset), cfg.train.seed, cfg.data.shuffle)
        self.loader = BatchLoader(dataset, self.order, cfg.train.global_batch_size, model.loss_count,
                                  self.layers.device)
        self.eval_loader = None if eval_dataset is None else BatchLoader(
            eval_dataset, SampleOrder(len(eval_dataset), cfg.train.seed, shuffle=False), cfg.train.global_batch_size,
            model.loss_count, self.layers.device)
        self.generation: Generation | None = None
        self.completed_steps = 0
        self.last_build_s: dict[str, float] = {}
        self.timeout = timedelta(seconds=cfg.elastic.collective_timeout_s)
        self._step_count = 0  # counted target elements of the step being computed
        self._boundaries: list[torch.Tensor] | None = None  # stage shapes, computed at the first build

    @property
    def fault_step(self) -> int:
        """The step a fault at a phase belongs to now (runtime/fault_hook.py): the step this
        worker computes or computed last, or, before any, the start step of its first generation."""
        return self.completed_steps if self._fault_step is None else self._fault_step

    def _phase(self, phase: str) -> None:
        """The hook the generation, its stages and the transfers call at each phase."""
        self.fault(phase, self.fault_step)

    def boundaries(self) -> list[torch.Tensor] | None:
        """Meta tensors of every layer boundary (runtime.generation Note: [static stage shapes]);
        None where the model cannot run on the meta device (then shapes are inferred at run time)."""
        if self._boundaries is None:
            sample = self.loader.microbatch_input(self.cfg.train.microbatch_size)
            try:
                self._boundaries = boundary_activations(self.model, self.layers.compute_dtype, sample)
            except Exception as exc:  # a layer with data-dependent control flow, say
                logger.warning("%s: the model does not run on the meta device (%s: %s), so pipeline stages "
                               "exchange their shapes at each generation's first step, as pickles "
                               "(docs/recovery.md, Trust model)", self.me, type(exc).__name__,
                               str(exc).splitlines()[0][:160])
                self._boundaries = []
        return self._boundaries or None

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The microbatch's share of the global-batch mean (runtime.model Note: [loss])."""
        count = self.model.loss_count(target)
        if count == 0:  # nothing counted (all padding): no gradient, and no 0/0 from the mean
            return output.sum() * 0.0
        if output.dtype != self.layers.dtype and output.is_floating_point():
            output = output.to(self.layers.dtype)  # bf16-mixed: the loss in the master's float32
        return self.model.loss(output, target) * (count / self._step_count)

    def set_timeout(self, seconds: float) -> None:
        """The timeout of the next generation's collectives and transfers."""
        self.timeout = timedelta(seconds=seconds)

    def build(self, plan: GenerationPlan, transfers: Sequence[Transfer] = (), *, settle: bool = True,
              restore_from: str | None = None) -> int:
        """Closes the current generation, builds `plan`'s, moves layer state; returns bytes moved.
        With `restore_from` (a checkpoint directory), layers come from its checkpoint of step
        plan.start_step instead of from this worker's memory."""
        if self.generation is not None:
            self.generation.close()
            self.generation = None
        if self._fault_step is None:  # before any step: faults of the build count from the first
            self._fault_step = plan.start_step
        if restore_from is not None:
            self.layers.keep_only(())
        if self.layers.layers and self.completed_steps != plan.start_step:
            raise RuntimeError(f"{self.me} has completed {self.completed_steps} steps but generation "
                               f"{plan.generation} starts at step {plan.start_step}")
        self.completed_steps = plan.start_step
        t0 = time.perf_counter()
        gen = Generation(plan, self.me, self.store, self.layers, loss_fn=self._loss_fn,
                         schedule=self.cfg.train.schedule, timeout=self.timeout, fault=self._phase,
                         spare=[self.store_address] if self.store_address else [])
        self.generation = gen
        self._phase("build")
        t1 = time.perf_counter()
        if transfers:
            self._phase("transfer")
        moved = run_transfers(transfers, plan, self.me, self.layers, stepped=self.completed_steps > 0,
                              timeout=self.timeout, fault=self._phase)
        t2 = time.perf_counter()
        if restore_from is not None:
            self._phase("restore")
            try:
                restore_layers(restore_from, plan.start_step, self.layers, gen.held_layers())
            except ConfigError:  # the job's settings do not fit the checkpoint: say so, once
                raise
            except Exception as exc:  # whatever failed reading it: a failed build (Note: [newest checkpoint])
                raise CheckpointUnreadable.of(plan.start_step, exc) from exc
        for i in gen.held_layers():
            if i not in self.layers:
                if self.completed_steps:
                    raise AssertionError(f"{self.me} needs layer {i} but holds no copy and none was "
                                         "transferred: the transfer plan is incomplete")
                self.layers.materialize(i)
        if gen.role is not None:
            gen.build_schedule(self.boundaries())
        if settle:
            self.settle()
        self.last_build_s = {"reinit": t1 - t0, "transfer": t2 - t1, "rebuild": time.perf_counter() - t2}
        return moved

    def _built(self) -> Generation:
        """The current generation: what steps, evaluates and settles runs in one, once built."""
        assert self.generation is not None, f"{self.me} has no generation built"
        return self.generation

    def settle(self) -> None:
        """Forgets the layers the current generation does not run. Until then a worker keeps the
        previous generation's layers, so a build that fails part-way can fall back to them."""
        self.layers.keep_only(self._built().held_layers())

    def step(self) -> StepStats:
        """compute() then apply(): one whole step, for callers without a commit protocol."""
        computed = self.compute()
        self.apply(computed)
        return computed.stats

    def compute(self) -> _Computed:
        """Forward, backward, gradient sums and the world-wide statistics of the next step.
        Every collective of the step happens here; apply() is local."""
        gen = self._built()
        step = self._fault_step = self.completed_steps
        start = time.perf_counter()
        inputs = targets = None
        consumed: tuple[int, ...] = ()
        if gen.role is not None:
            lo, hi = gen.role.samples
            batch = self.loader.get(step, lo, hi, first=gen.role.is_first, last=gen.role.is_last)
            inputs, targets = batch.inputs, batch.targets
            if gen.role.is_last:
                consumed = batch.indices
                self._step_count = batch.count
        # Dropout draws from the global generator, seeded per step and worker: a step replayed
        # or resumed on the same layout draws the same masks, and no RNG state needs saving.
        # Only this device's generator: torch.manual_seed also queues a lazy seed for each
        # accelerator backend not started, formatting the call's stack each time (1.3 ms a step).
        seed = layer_seed(self.cfg.train.seed, step, salt=f"step:{gen.rank}")
        torch.default_generator.manual_seed(seed)
        device = self.layers.device
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed)
        loss_sum, samples = gen.forward_backward(inputs, targets)
        gen.sync_gradients()
        counts = self._step_count if gen.role is not None and gen.role.is_last and gen.role.pipeline == 0 else 0
        # The step's time is the first stage of pipeline 0's: it finishes its pipeline's last
        # backward, and its gradient sum waits for every other pipeline's. A worker's own time
        # is not the step's: a hot spare that was busy reporting starts late, waits for nobody
        # and measured a few ms for a 0.2 s step (its samples/s 60 times too high).
        timer = gen.role is not None and gen.role.is_first and gen.role.pipeline == 0
        loss, samples, sq_norm, tokens, seconds = gen.reduce_stats(
            loss_sum, samples, counts, seconds=time.perf_counter() - start if timer else 0.0)
        norm = math.sqrt(sq_norm)
        clip = self.cfg.train.grad_clip_norm
        coef = min(1.0, clip / (norm + 1e-6)) if clip is not None else 1.0
        base_lr = self.cfg.train.optimizer.kwargs.get("lr")
        lr = None if base_lr is None else base_lr * lr_factor(self.cfg.train.lr_schedule, step, self.cfg.train.steps)
        stats = StepStats(step=step, loss=loss, samples=samples, grad_norm=norm,
                          seconds=seconds, consumed=consumed, tokens=tokens, lr=lr)
        return _Computed(stats=stats, clip_coef=coef)

    def evaluate(self, batch: int) -> tuple[float, int]:
        """The loss of eval batch `batch` (its global mean, as training averages a step's: Note:
        [loss] in runtime/model.py) and its counted targets, world-wide; forward only, the
        layers in eval mode."""
        gen = self._built()
        inputs = targets = None
        if gen.role is not None:
            assert self.eval_loader is not None, "evaluations run only with an eval dataset"
            lo, hi = gen.role.samples
            data = self.eval_loader.get(batch, lo, hi, first=gen.role.is_first, last=gen.role.is_last)
            inputs, targets = data.inputs, data.targets
            if gen.role.is_last:
                self._step_count = data.count
        modules = [self.layers[i].compute for i in gen.held_layers()]
        for module in modules:  # as model.eval() would: no dropout, BatchNorm on its running statistics
            module.eval()
        try:
            loss_sum, samples = gen.forward_only(inputs, targets)
        finally:
            for module in modules:
                module.train()
        counts = self._step_count if gen.role is not None and gen.role.is_last and gen.role.pipeline == 0 else 0
        loss, _, _, tokens, _ = gen.reduce_stats(loss_sum, samples, counts, grads=False)
        return loss, tokens

    def apply(self, computed: _Computed) -> None:
        """Keeps the step's buffers, then clips and steps every held layer's optimizer (local:
        cannot fail because of a peer)."""
        assert computed.stats.step == self.completed_steps, "apply() must follow its own compute()"
        factor = lr_factor(self.cfg.train.lr_schedule, computed.stats.step, self.cfg.train.steps)
        for n, i in enumerate(self._built().held_layers()):
            state = self.layers[i]
            state.buffers_into_master()  # bf16-mixed (runtime.layers Note: [mixed precision])
            if computed.clip_coef < 1.0:
                for g in state.grads():
                    g.mul_(computed.clip_coef)
            state.set_lr(factor)
            if state.optimizer:
                state.optimizer.step()
            state.zero_grad()
            if n == 0:
                self._phase("optimizer")
        self.completed_steps += 1

    def barrier(self, agree: bool = True) -> bool:
        """Every worker of the current generation got here; whether all of them `agree`
        (Generation.barrier)."""
        return self._built().barrier(agree)

    def holds_layers(self) -> bool:
        """Whether this worker holds any layer state (a joiner or a restarted worker holds none)."""
        return bool(self.layers.layers)

    def keep_layers(self, indices: Sequence[int]) -> None:
        """Forgets every layer but `indices` (what this worker held in a generation that was
        built: a failed build's partial copies go; `()`: before a restore)."""
        self.layers.keep_only(indices)

    def discard(self) -> None:
        """Drops the gradients of an aborted step (it will be replayed)."""
        for state in self.layers.layers.values():
            state.zero_grad()

    def layer_summaries(self) -> tuple[list[float], list[float]]:
        """float64 sum and L2 norm of every layer's parameters, world-wide (each layer once)."""
        gen = self._built()
        n = self.model.num_layers
        stats = torch.zeros(2 * n, dtype=torch.float64)
        for i, rank in gen.plan.layer_owner.items():
            if rank == gen.rank:
                params = [p.detach().double() for p in self.layers[i].module.parameters()]
                stats[i] = sum(float(p.sum()) for p in params)
                stats[n + i] = math.sqrt(sum(float(p.pow(2).sum()) for p in params))
        dist.all_reduce(stats, group=None)
        return stats[:n].tolist(), stats[n:].tolist()

    def cut(self, generation: int) -> bool:
        """Ends what is pending on generation `generation`'s groups, from any thread (a member
        went silent: Note: [cutting a generation's connections] in runtime/connections.py);
        whether it was there to cut (not while it is being built, nor once closed)."""
        gen = self.generation
        return gen is not None and gen.plan.generation == generation and gen.cut()

    def leave(self) -> None:
        """This worker is not in the next generation: close the current one and forget the
        layers (they go stale while others train)."""
        self.close()
        self.layers.keep_only(())

    def close(self) -> None:
        """Closes the current generation (the loader lives as long as the trainer: shutdown())."""
        if self.generation is not None:
            self.generation.close()
            self.generation = None

    def shutdown(self) -> None:
        self.close()
        self.loader.close()
        if self.eval_loader is not None:
            self.eval_loader.close()
