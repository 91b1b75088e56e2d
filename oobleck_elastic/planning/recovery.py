"""The next generation's layout after a membership change: one pure function for every kind
of change (nodes lost, nodes joined, a retried admission, a replay on the same nodes, the
fallback to a checkpoint, a first generation started again).

Note: [next generation]
    A generation is planned from its *base*: the last generation every member finished
    building (a generation whose build failed part-way is skipped, its partial copies
    dropped). Given the base's instantiation and the nodes that answered the roll call,
    `plan_next` returns the next layout: the base reconfigured without the lost nodes and
    with the joined ones (Note: [transfers] says who sends what), the base itself when no
    member of it was lost (a replay), or, when the survivors no longer hold every layer, a
    fresh layout restored from the newest checkpoint. Every worker runs this on the same
    inputs; only the proposal that wins the compare-and-set is acted on, and every worker
    derives that record's transfers with `transfers_between`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from oobleck_elastic.errors import LayersLostError, OobleckError
from oobleck_elastic.planning.instantiate import Instantiation, fresh_layout
from oobleck_elastic.planning.reconfigure import Transfer, plan_transfers, reconfigure
from oobleck_elastic.planning.templates import TemplateSet

__all__ = ["Base", "NextLayout", "NoCheckpointError", "is_replay", "plan_next", "transfers_between"]


class NoCheckpointError(OobleckError):
    """More nodes failed than replicas cover and there is no checkpoint to fall back to."""


@dataclass(frozen=True)
class Base:
    """The generation a change starts from (one every member finished building): its number
    and instantiation."""

    generation: int
    instantiation: Instantiation


@dataclass(frozen=True, kw_only=True)
class NextLayout:
    """What the next generation runs (the record's planning part)."""

    instantiation: Instantiation
    start_step: int
    base: int | None
    """The generation its layers come from in memory; None: built from scratch."""
    restored_from: int | None = None
    """The checkpoint step it restores, if the layers are read from a checkpoint."""
    lost: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    actions: tuple[str, ...] = ()


def plan_next(templates: TemplateSet, base: Base | None, *, alive: Sequence[int], dead: Sequence[int] = (),
              step: int, checkpoint: Callable[[], int | None], global_batch: int, microbatch: int,
              fresh: bool = False) -> NextLayout:
    """The layout after a change (Note: [next generation]).

    `base`: the generation to reconfigure, None when the failed generation had none (the first,
    or one restored from a checkpoint). `alive`: the nodes to lay it on (members that answered
    the roll call and live joiners). `dead`: nodes known dead (recorded as the change's loss).
    `step`: the steps every survivor has completed. `checkpoint()`: the newest checkpoint's
    step (0: the initial state, before the first checkpoint), read only when needed. `fresh`:
    with no base, start the run again at step 0 (the first generation failed before it trained)
    instead of restoring."""
    dead = tuple(sorted(set(dead)))
    if base is None:
        if fresh:
            inst = fresh_layout(templates, alive, global_batch, microbatch)
            return NextLayout(instantiation=inst, start_step=0, base=None, lost=dead,
                              actions=(f"started the run again on nodes {list(inst.nodes)}",))
        return _restore(templates, alive, dead, checkpoint, global_batch, microbatch, why=None)
    old = base.instantiation
    lost = sorted(set(old.nodes) - set(alive))
    joined = tuple(sorted(set(alive) - set(old.nodes)))
    if lost or joined:
        try:
            recon = reconfigure(templates, old, lost=lost, joined=joined)
        except LayersLostError as exc:
            return _restore(templates, alive, dead, checkpoint, global_batch, microbatch, why=str(exc))
        return NextLayout(instantiation=recon.instantiation, start_step=step, base=base.generation, lost=dead,
                          joined=joined, actions=recon.actions)
    if dead:  # only nodes the base does not have (joiners) were lost
        why = f"node(s) {list(dead)} lost before they were built in: generation {base.generation}'s layout"
    else:  # slow is not dead: the same nodes replay the step
        why = "every node answered the roll call: rebuilt with the same nodes"
    return NextLayout(instantiation=old, start_step=step, base=base.generation, lost=dead, actions=(why,))


def _restore(templates: TemplateSet, alive: Sequence[int], dead: tuple[int, ...], checkpoint: Callable[[], int | None],
             global_batch: int, microbatch: int, why: str | None) -> NextLayout:
    """More failures than replicas: every survivor restarts from the newest checkpoint."""
    step = checkpoint()
    if step is None:
        raise NoCheckpointError((f"{why}. " if why else "") + "There is no complete checkpoint of this run to fall "
                                "back to (checkpoint.interval): the run cannot continue")
    inst = fresh_layout(templates, alive, global_batch, microbatch)
    action = (f"restored the checkpoint of step {step}" if step else
              "no checkpoint yet: started the run again from its initial state (step 0)")
    return NextLayout(instantiation=inst, start_step=step, base=None, restored_from=step, lost=dead,
                      actions=(f"{action} on nodes {list(inst.nodes)}",))


def is_replay(base: Base | None, alive: Sequence[int], dead: Sequence[int]) -> bool:
    """Whether the next generation runs on the same nodes as the one that failed: nobody died
    and every node of the base answered (or, with no base, a restored or restarted layout
    tried again). Such failures are not node failures; the controller counts them, doubles
    the timeout each time and gives up after a few (elastic.controller), so a build that
    fails the same way with every node alive cannot loop for ever."""
    return not dead and (base is None or set(base.instantiation.nodes) <= set(alive))


def transfers_between(templates: TemplateSet, base: Instantiation | None, after: Instantiation) -> list[Transfer]:
    """The layer copies that build `after` from the holders of `base` that are in it (none
    when it is built from scratch)."""
    if base is None:
        return []
    return plan_transfers(templates, base, after, set(base.nodes) - set(after.nodes))
