"""One generation's distributed objects, owned by one object with one close().

Note: [generation lifetime]
    gloo closes a process group's sockets only when the last Python reference to it goes:
    held exceptions and tracebacks, Work objects, PipelineStage and schedule objects and
    subgroup handles all keep it alive (seen with torch 2.13 on gloo). So everything of generation g
    hangs off its Generation and nothing else: close() drops every reference, destroys the
    process groups, and the next generation starts on a fresh PrefixStore("gen<g>").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from oobleck_elastic.planning import WorkerRef
from oobleck_elastic.runtime.communicators import Communicator, communicators, creation_order, tie_communicator
from oobleck_elastic.runtime.connections import SocketSet, open_sockets
from oobleck_elastic.runtime.devices import abort_groups, backend_for, prepare_backend
from oobleck_elastic.runtime.fault_hook import PhaseHook, no_phase
from oobleck_elastic.runtime.layers import LayerStore, flatten, unflatten
from oobleck_elastic.runtime.plan import GenerationPlan, StageRole

__all__ = ["Generation", "StageModule"]

logger = logging.getLogger(__name__)

# a PipelineScheduleMulti runs several stages a worker (Note: [stage to rank])
SCHEDULES: dict[str, type[PipelineScheduleSingle] | type[PipelineScheduleMulti]] = {
    "1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": ScheduleInterleaved1F1B}
# a tied parameter's group (None: one rank holds every copy) and the (layer, name) copies held here
_TieGroup = tuple["dist.ProcessGroup | None", list[tuple[int, str]]]



def _return_freed_memory() -> None:
    """Hands the heap freed by a torn-down generation back to the OS (glibc's malloc_trim).
    Without it, the gloo buffers and stage tensors of each generation leave the heap
    fragmented and resident memory creeps up by ~0.5 MB per recovery (tests/jobs/test_leaks.py).
    A no-op where the C library is not glibc."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()


class StageModule(nn.Module):
    """The layers of one stage applied in order (modules owned by the LayerStore). `fault` is
    called with "forward" before each forward and "backward" when the output's gradient
    arrives: the fault-injection points inside the schedule."""

    def __init__(self, layers: list[nn.Module], fault: PhaseHook = no_phase) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fault("forward")
        for layer in self.layers:
            x = layer(x)
        if x.requires_grad:
            x.register_hook(self._backward_hook)
        return x

    def _backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        self.fault("backward")
        return grad


def _count_group_names_from_zero() -> None:
    """Note: [group names]
        torch names the default group, and each new_group after it, by a per-process counter
        (`distributed_c10d._world.group_count`), and those names prefix the groups' store keys.
        destroy_process_group() sets it back to 0, but an init_process_group that failed (a
        peer died during the rendezvous) has already counted and leaves no group to destroy.
        That process's next generation then waits on keys such as `gen559/85//cpu//0/1` that
        its peers, counting from 0, never write: every attempt times out on both sides, for
        ever (the 30-minute chaos run found this livelock). Each generation starts the count at
        0 itself; torch offers no public way to, so this sets the private counter."""
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


class _Stage(PipelineStage):
    """A PipelineStage that calls `on_last_backward(stage_index)` once the schedule's last
    backward of a step has run on it: its parameters' gradients are then final for the step."""

    on_last_backward: Callable[[int], None] | None = None

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if last_backward and backward_type in ("full", "weight") and self.on_last_backward is not None:
            self.on_last_backward(self.stage_index)
        return result


class Generation:
    """Process groups, pipeline stage, schedule and gradient groups of one generation.

    Note: [gradient overlap]
        A layer's gradient is final once the last backward of the step has run on the stage
        that holds it, while the pipeline still drains behind it: under 1F1B the last stage
        finishes first and stage 0 last, a whole ramp of backward microbatches later. Each
        replica set's all-reduce is issued (asynchronously) from that moment, not after the
        schedule, so it runs beside the rest of the drain; sync_gradients() waits for them.
        Every replica set has a group of its own and one all-reduce per step, so the order of
        issue across groups cannot deadlock. The in-flight Work objects belong to the
        generation (`_in_flight`): close() drops them with the groups (Note: [generation
        lifetime]).
    """

    def __init__(self, plan: GenerationPlan, me: WorkerRef, store: dist.Store, layers: LayerStore,
                 *, loss_fn, schedule: str, timeout: timedelta, fault: PhaseHook = no_phase,
                 spare: Iterable[tuple[str, int]] = ()) -> None:
        """`spare`: the addresses (host, port) of the membership store, whose connections are
        never cut (`cut`)."""
        self.plan = plan
        self.me = me
        self.rank = plan.rank_of(me)
        self.layers = layers
        self.role: StageRole | None = plan.roles.get(self.rank)
        self.pipeline_group = None
        self.grad_groups: list[tuple[object, tuple[int, ...]]] = []
        self.tie_groups: list[_TieGroup] = []
        self.communicators: list[Communicator] = []
        self._tied: dict[int, set[str]] = {}
        self.stages: list[_Stage] = []
        self.stage_modules: list[StageModule] = []
        self.schedule: PipelineScheduleSingle | PipelineScheduleMulti | None = None
        self._in_flight: dict[int, tuple] = {}
        """Replica-set index -> (Work, flat gradients, the gradients) issued this step."""
        self._awaiting: dict[int, set[int]] = {}
        """Replica-set index -> the local stages whose last backward it still waits for."""
        self._groups_of_stage: dict[int, list[int]] = {}
        self.overlapped = 0
        """Replica sets of the last step whose all-reduce was issued during the schedule."""
        self._loss_fn = loss_fn
        self._schedule_name = schedule
        self._fault = fault
        self._closed = True  # until the default group exists
        self._lock = threading.Lock()  # cut() (another thread) against close()
        self.sockets = SocketSet(frozenset())
        """The connections of this generation's groups (Note: [cutting a generation's connections])."""
        self.was_cut = False
        """Whether `cut` ended this generation."""
        before = open_sockets()
        _count_group_names_from_zero()
        prepare_backend(layers.device, timeout.total_seconds())
        # on CUDA, device_id makes NCCL create each group's communicator in new_group (eagerly),
        # in the global order of Note: [communicator order], not at its first use in a step
        device_id = layers.device if layers.device.type == "cuda" else None
        dist.init_process_group(backend_for(layers.device), store=dist.PrefixStore(f"gen{plan.generation}", store),
                                rank=self.rank, world_size=len(plan.members), timeout=timeout, device_id=device_id)
        self._closed = False
        try:
            self._fault("bootstrap")
            self._make_groups(plan, timeout)
            self.sockets = SocketSet.opened_since(before, spare)
        except BaseException:
            # a peer died while the groups were made: a half-built generation leaves nothing
            # behind, or the next one could not start (the chaos run found "the default process
            # group initialised twice")
            self.close()
            raise

    def _make_groups(self, plan: GenerationPlan, timeout: timedelta) -> None:
        """Every group of the generation, created and then used once in the one global order
        (runtime/communicators.py, Note: [communicator order]): no communicator is left to be
        created at its first use in a step."""
        shared = [{layer for layer, _ in s.members} for s in self.layers.model.shared]
        self.communicators = communicators(plan, shared)
        # new_group is collective: every rank creates every group, in the list's order
        made = {c: dist.new_group(list(c.ranks), timeout=timeout) for c in self.communicators if c.kind != "p2p"}
        for comm, group in made.items():
            if self.rank not in comm.ranks:
                continue
            if comm.kind == "pipeline" and self.role is not None:
                self.pipeline_group = group
            elif comm.kind == "replica":
                self.grad_groups.append((group, comm.layers))
        held = set(self.held_layers())
        for layers, tied in zip(shared, self.layers.model.shared):
            mine = [(layer, name) for layer, name in tied.members if layer in held]
            if mine:
                self.tie_groups.append((made.get(tie_communicator(plan, layers)), mine))
                for layer, name in mine:
                    self._tied.setdefault(layer, set()).add(name)
        self._warm_up(made)

    def _warm_up(self, made: dict[Communicator, dist.ProcessGroup]) -> None:
        """Uses each of this rank's communicators once, down the global list: a collective of
        one element on each group, one message each way between neighbouring stages."""
        one = torch.zeros(1, device=self.layers.device)
        for comm in creation_order(self.communicators, self.rank):
            if comm.kind != "p2p":
                dist.all_reduce(one, group=made[comm])
                continue
            low, high = comm.ranks
            if self.rank == low:
                dist.send(one, dst=high, group=self.pipeline_group)
                dist.recv(one, src=high, group=self.pipeline_group)
            else:
                dist.recv(one, src=low, group=self.pipeline_group)
                dist.send(one, dst=low, group=self.pipeline_group)

    def build_schedule(self, boundaries: list[torch.Tensor] | None = None) -> None:
        """Builds this worker's stages and schedule once its layers are in place. `boundaries`:
        the meta tensor entering each layer and leaving the last (Note: [static stage shapes]).

        Note: [static stage shapes]
            Given no shapes, a PipelineStage infers them on a generation's first step by
            sending its output's metadata to the next stage with send_object_list: a pickle
            that the receiver unpickles, from whoever holds that socket. Every worker computes
            the activation at each layer boundary once, on the meta device (runtime.model.
            boundary_activations), and gives each stage its input and output: torch then takes
            the static path, with nothing pickled and no extra round trip at each rebuild.

        Note: [stage to rank]
            new_group sorts its ranks, so a pipeline's group ranks follow global rank order,
            not stage order. Single-stage schedules take an explicit stage -> group rank map.
            ScheduleInterleaved1F1B computes its action lists with "rank" meaning the worker
            position p (stages p, p + P, ...) and only resolves peers through the map at run
            time, so it is built with the position as its rank and then given the real map.
        """
        role = self.role
        assert role is not None, "a spare has no stage"
        sorted_ranks = sorted(set(role.stage_ranks))
        to_group_rank = {k: sorted_ranks.index(r) for k, r in enumerate(role.stage_ranks)}
        # the stage runs each layer's compute copy: the module itself, or its bf16 copy under
        # bf16-mixed (runtime.layers Note: [mixed precision])
        self.stage_modules = [StageModule([self.layers[i].compute for i in range(*layers)], self._fault)
                              for layers in role.stage_layers]
        def shape(boundary: int) -> torch.Tensor | None:  # None: torch's default, inferred at run time
            return None if boundaries is None else boundaries[boundary]
        self.stages = [_Stage(module, k, role.num_stages, self.layers.device, group=self.pipeline_group,
                              input_args=shape(layers[0]), output_args=shape(layers[1]))
                       for module, k, layers in zip(self.stage_modules, role.stages, role.stage_layers)]
        for stage in self.stages:
            stage.on_last_backward = self._stage_done
        self._groups_of_stage = {
            k: [j for j, (_, layer_ids) in enumerate(self.grad_groups) if set(layer_ids) & set(range(*layers))]
            for k, layers in zip(role.stages, role.stage_layers)}
        kind = SCHEDULES[self._schedule_name]
        if issubclass(kind, PipelineScheduleMulti):
            for stage in self.stages:
                stage.group_rank = role.position
            # ignore: torch annotates the stages list[_PipelineStageBase] (invariant), and only reads it
            self.schedule = multi = kind(self.stages, n_microbatches=role.microbatches,  # type: ignore[arg-type]
                                         loss_fn=self._loss_fn, scale_grads=False)
            for stage in self.stages:
                stage.group_rank = to_group_rank[stage.stage_index]
            multi.rank = role.position
            multi.stage_index_to_group_rank = to_group_rank
        else:
            self.schedule = kind(self.stages[0], n_microbatches=role.microbatches, loss_fn=self._loss_fn,
                                 scale_grads=False)
        for stage in self.stages:
            stage.stage_index_to_group_rank = to_group_rank

    def forward_backward(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> tuple[float, int]:
        """Runs the schedule on this pipeline's slice; returns (summed loss, samples) counted
        on last stages (0 elsewhere)."""
        return self._run_schedule("step", inputs, targets)

    def forward_only(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> tuple[float, int]:
        """Runs the schedule forward only, without gradients (evaluation); returns what
        forward_backward does."""
        with torch.no_grad():
            return self._run_schedule("eval", inputs, targets)

    def _run_schedule(self, method: str, inputs: torch.Tensor | None,
                      targets: torch.Tensor | None) -> tuple[float, int]:
        if self.role is None:  # a spare: no stage, no schedule
            return 0.0, 0
        self.layers.refresh_compute(self.held_layers())
        self._in_flight.clear()
        self._awaiting = {j: {k for k, groups in self._groups_of_stage.items() if j in groups}
                          for j in range(len(self.grad_groups))}
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.role.is_first else ()
        kwargs = {"target": targets, "losses": losses} if self.role.is_last else {}
        getattr(self.schedule, method)(*args, **kwargs)
        if not self.role.is_last:
            return 0.0, 0
        assert targets is not None, "a last stage computes the loss"
        return float(sum(loss.detach().double() for loss in losses)), int(targets.shape[0])

    def _stage_done(self, stage_index: int) -> None:
        """The last backward of the step ran on local stage `stage_index`: issue the all-reduce
        of every replica set that waited only for it (Note: [gradient overlap])."""
        for j in self._groups_of_stage.get(stage_index, ()):
            waiting = self._awaiting.get(j)
            if waiting is None:
                continue
            waiting.discard(stage_index)
            if not waiting:
                self._issue(j)

    def _issue(self, j: int) -> None:
        if j in self._in_flight:
            return
        group, layer_ids = self.grad_groups[j]
        grads = [g for i in layer_ids for g in self.layers[i].grads(exclude=self._tied.get(i, ()))]
        if grads:
            flat = flatten(grads)
            self._in_flight[j] = (dist.all_reduce(flat, group=group, async_op=True), flat, grads)
        else:
            self._in_flight[j] = (None, None, grads)

    def sync_gradients(self) -> None:
        """Sums each layer's gradient over its replicas (one flat all-reduce per replica set,
        most already issued during the schedule's drain: Note: [gradient overlap]) and each
        tied parameter's over every copy on every replica (one all-reduce per tie)."""
        self._fault("grad_sync")
        tied = []
        self.overlapped = len(self._in_flight)
        for j in range(len(self.grad_groups)):
            self._issue(j)  # a replica set whose stages' last backward was not seen (none on spares)
        pending = [self._in_flight[j] for j in sorted(self._in_flight)]
        self._in_flight.clear()
        self._awaiting = {}
        for group, copies in self.tie_groups:
            grads = [self.layers[layer].grad_of(name) for layer, name in copies]
            total = torch.stack(grads).sum(dim=0)
            tied.append((dist.all_reduce(total, group=group, async_op=True) if group is not None else None,
                         total, grads))
        for work, flat, grads in pending:
            if work is None:
                continue
            work.wait()
            for g, synced in zip(grads, unflatten(flat, grads)):
                g.copy_(synced)
        for work, total, grads in tied:
            if work is not None:
                work.wait()
            for g in grads:
                g.copy_(total)
        pending.clear()
        tied.clear()

    def reduce_stats(self, loss_sum: float, samples: int, tokens: int = 0, grads: bool = True,
                     seconds: float = 0.0) -> tuple[float, int, float, int, float]:
        """World-wide (loss sum, samples, squared grad norm, tokens, seconds): each layer counted
        once in the norm and each tied parameter once (its canonical copy); without `grads`, the
        norm is 0. Like tokens, seconds comes from one worker and the others give 0."""
        owned = [i for i, r in self.plan.layer_owner.items() if r == self.rank] if grads else []
        copies = self.layers.model.tied_copies()
        sq = torch.zeros((), dtype=torch.float64, device=self.layers.device)  # one device sync, not one a layer
        for i in owned:
            extra = {name for name, canon in copies.get(i, {}).items() if canon != (i, name)}
            sq = sq + sum(g.double().pow(2).sum() for g in self.layers[i].grads(exclude=extra))
        stats = torch.tensor([loss_sum, float(samples), float(sq), float(tokens), seconds], dtype=torch.float64)
        dist.all_reduce(stats)
        return (float(stats[0]), int(round(float(stats[1]))), float(stats[2]), int(round(float(stats[3]))),
                float(stats[4]))

    def barrier(self, agree: bool = True) -> bool:
        """Returns once every worker of the generation got here (a world-wide all-reduce of one
        number, on the CPU: gloo under either backend), or raises as any collective does;
        whether every worker passed `agree` true (a verdict all of them learn at once)."""
        verdict = torch.tensor([1.0 if agree else 0.0])
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
        return bool(verdict.item() == 1.0)

    def held_layers(self) -> tuple[int, ...]:
        return self.role.layer_ids if self.role else ()

    def cut(self) -> bool:
        """Ends every operation pending on this generation's groups, from any thread: its
        connections are shut down (gloo; Note: [cutting a generation's connections]) and, on
        CUDA, its communicators aborted. The generation is over: close() it next. Whether it is
        cut (False once closed)."""
        with self._lock:
            if self._closed:
                return False
            if not self.was_cut:
                self.was_cut = True
                cut = self.sockets.cut()
                logger.info("generation %d: cut %d of its %d connections", self.plan.generation, cut,
                            len(self.sockets.sockets))
                if self.layers.device.type == "cuda":
                    abort_groups(self.layers.device)
            return True

    def close(self) -> None:
        """Drops every reference to this generation's groups and destroys them, never waiting on
        a peer: the connections are cut first (`cut`), since destroying a group waits for its
        pending operations, and a failed step leaves some behind (a pipeline receive posted to a
        peer that went silent would hold the worker until that peer woke or the timeout).
        Between steps nothing is pending, and the cut changes nothing."""
        self.cut()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # CUDA: the communicators are aborted before anything they may still write to is freed,
        # and never waited on (a dead peer's kernels would spin for ever); an abort that fails
        # ends this worker (devices.abort_groups)
        abort_groups(self.layers.device)
        self.schedule = None
        self.stages = []
        self.stage_modules = []
        self._in_flight = {}
        self._awaiting = {}
        self._groups_of_stage = {}
        self.pipeline_group = None
        self.grad_groups = []
        self.tie_groups = []
        try:
            if dist.is_initialized():  # gloo (CUDA's groups are gone once aborted)
                dist.destroy_process_group()
        finally:
            gc.collect()
            _return_freed_memory()
            if self.layers.device.type == "cuda":  # the next generation's NCCL set-up needs it
                torch.cuda.empty_cache()
