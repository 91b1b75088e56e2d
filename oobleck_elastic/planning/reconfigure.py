"""Reconfiguration: the next instantiation after nodes are lost or join, and the transfers.

Every worker computes the same plan from the same inputs (the previous instantiation, the lost
and joined node ids, the templates), so only the membership has to be agreed on.

After failures each pipeline that lost nodes is, in order of preference:
  1. re-instantiated from the template for its remaining node count (if it has one);
  2. helped by borrowing nodes from a pipeline that can shrink and stay above n0;
  3. merged with another pipeline into one whose node count has a template;
  4. failing all three (the job is at its minimum size), its nodes become spares, idle with a
     warning, and training goes on with fewer replicas until nodes join.
Among the candidates of one kind, the one that moves the least layer state wins. Joined nodes
form new pipelines when there are at least n0 of them, otherwise they extend the pipelines
where they move the least state. The batch is split again for the same global batch size.

Note: [transfers]
    A worker keeps the state of every layer it held in the previous generation until the
    transfers are done. A layer a worker needs and did not hold is copied from one surviving
    holder (parameters and optimizer state); holders are chosen largest layer first, each time
    the holder that has been assigned the fewest bytes, so sending is spread across replicas.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from oobleck_elastic.errors import LayersLostError, PlanningError
from oobleck_elastic.planning.instantiate import Instantiation, build_instantiation
from oobleck_elastic.planning.templates import PipelineTemplate, TemplateSet

__all__ = ["WorkerRef", "Transfer", "ReconfigurationPlan", "reconfigure", "layer_holders", "plan_transfers"]


@dataclass(frozen=True, order=True)
class WorkerRef:
    """A worker by node id and local rank."""

    node: int
    local_rank: int


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """Copy `layer`'s state from `src` to `dst` before the new generation trains."""

    layer: int
    src: WorkerRef
    dst: WorkerRef
    bytes: int


@dataclass(frozen=True, kw_only=True)
class ReconfigurationPlan:
    """What changes between two generations."""

    lost: tuple[int, ...]
    joined: tuple[int, ...]
    instantiation: Instantiation
    actions: tuple[str, ...]
    transfers: tuple[Transfer, ...]
    warnings: tuple[str, ...] = ()

    @property
    def bytes_moved(self) -> int:
        return sum(t.bytes for t in self.transfers)


def layer_holders(inst: Instantiation, templates: TemplateSet) -> dict[WorkerRef, tuple[int, ...]]:
    """The layers each worker of an instantiation runs, ascending (one contiguous range, or
    several with interleaved templates)."""
    by_nodes = templates.by_nodes()
    held: dict[WorkerRef, list[int]] = {}
    for p in inst.pipelines:
        for stage in by_nodes[p.template].stages:
            for w in stage.workers:
                held.setdefault(WorkerRef(p.nodes[stage.node], w), []).extend(range(*stage.layers))
    return {ref: tuple(sorted(layers)) for ref, layers in held.items()}


@dataclass
class _Group:
    """A pipeline being formed: its node ids in stage order and where it came from."""

    nodes: list[int]
    origin: str


class _Planner:
    def __init__(self, templates: TemplateSet, previous: Instantiation, lost: set[int]) -> None:
        self.templates = templates
        self.by_nodes = templates.by_nodes()
        self.state = templates.layer_state_bytes
        self.old = {w: set(ls) for w, ls in layer_holders(previous, templates).items() if w.node not in lost}

    def missing(self, template: PipelineTemplate, nodes: Sequence[int]) -> list[tuple[WorkerRef, int, int]]:
        """(worker, layer, bytes) that this pipeline's workers need and do not hold."""
        out: list[tuple[WorkerRef, int, int]] = []
        for stage in template.stages:
            for w in stage.workers:
                ref = WorkerRef(nodes[stage.node], w)
                have = self.old.get(ref, set())
                out.extend((ref, layer, self.state[layer] // len(stage.workers))
                           for layer in range(*stage.layers) if layer not in have)
        return out

    def cost(self, *groups: Sequence[int]) -> int:
        return sum(b for nodes in groups for _, _, b in self.missing(self.by_nodes[len(nodes)], nodes))

    def fits(self, count: int) -> bool:
        return count in self.by_nodes

    def first_layer(self, node: int) -> int | None:
        starts = [min(ls) for w, ls in self.old.items() if w.node == node and ls]
        return min(starts) if starts else None

    def best_order(self, nodes: Sequence[int]) -> list[int]:
        """Nodes in the stage order that moves the least state: nodes with state keep their
        layer order, nodes without state go in as one block wherever it is cheapest."""
        stateful = sorted((n for n in nodes if self.first_layer(n) is not None),
                          key=lambda n: (self.first_layer(n), n))
        fresh = sorted(n for n in nodes if self.first_layer(n) is None)
        orders = [stateful[:i] + fresh + stateful[i:] for i in range(len(stateful) + 1)]
        return min(orders, key=self.cost) if fresh and stateful else stateful + fresh


def _borrow(planner: _Planner, groups: list[_Group], needy: _Group) -> tuple[int, str] | None:
    """Moves nodes from the cheapest donor into `needy`; returns (cost, action) or None."""
    n0 = planner.templates.min_nodes
    best = None
    for k in range(1, n0 + 1):
        if not planner.fits(len(needy.nodes) + k):
            continue
        for idx, donor in enumerate(groups):
            if donor is needy or not planner.fits(len(donor.nodes) - k) or len(donor.nodes) - k < n0:
                continue
            for end in ("tail", "head"):
                taken = donor.nodes[-k:] if end == "tail" else donor.nodes[:k]
                rest = donor.nodes[:-k] if end == "tail" else donor.nodes[k:]
                grown = needy.nodes + taken
                cost = planner.cost(rest, grown)
                if best is None or cost < best[0]:
                    best = (cost, idx, rest, grown, taken)
        if best is not None:
            break
    if best is None:
        return None
    cost, idx, rest, grown, taken = best
    groups[idx].nodes = rest
    needy.nodes = grown
    return cost, f"borrowed node(s) {taken} from pipeline on {rest + taken}"


def _merge(planner: _Planner, groups: list[_Group], needy: _Group) -> str | None:
    best = None
    for other in groups:
        if other is needy or not planner.fits(len(needy.nodes) + len(other.nodes)):
            continue
        for order in (needy.nodes + other.nodes, other.nodes + needy.nodes):
            cost = planner.cost(order)
            if best is None or cost < best[0]:
                best = (cost, other, order)
    if best is None:
        return None
    _, other, order = best
    action = f"merged pipelines on {needy.nodes} and {other.nodes}"
    groups.remove(other)
    needy.nodes = order
    return action


def _after_failures(planner: _Planner, previous: Instantiation,
                    lost: set[int]) -> tuple[list[_Group], list[int], list[str]]:
    groups, needy, actions, spares = [], [], [], []
    n0 = planner.templates.min_nodes
    for i, p in enumerate(previous.pipelines):
        alive = [n for n in p.nodes if n not in lost]
        if not alive:
            actions.append(f"pipeline {i} on {list(p.nodes)} lost every node")
            continue
        group = _Group(alive, f"pipeline {i}")
        groups.append(group)
        if len(alive) == len(p.nodes):
            continue
        if len(alive) >= n0 and planner.fits(len(alive)):
            actions.append(f"pipeline {i}: re-instantiated from the {len(alive)}-node template")
        else:
            needy.append(group)
    for group in needy:
        if group not in groups:
            continue  # already merged into another
        if planner.fits(len(group.nodes)) and len(group.nodes) >= n0:
            continue  # a merge already fixed it
        borrowed = _borrow(planner, groups, group)
        if borrowed is not None:
            actions.append(f"{group.origin}: {borrowed[1]}")
            continue
        merged = _merge(planner, groups, group)
        if merged is None:
            groups.remove(group)
            spares.extend(group.nodes)
            actions.append(f"{group.origin}: node(s) {group.nodes} become spares (no template fits "
                           f"them, none can be lent or merged)")
            continue
        actions.append(f"{group.origin}: {merged}")
    return groups, spares, actions


def _absorb(planner: _Planner, groups: list[_Group], joined: list[int]) -> tuple[list[int], list[str]]:
    """Adds joined nodes (and former spares) to the groups; returns (still spare, actions)."""
    templates = planner.templates
    actions: list[str] = []
    spare: list[int] = []
    if not joined:
        return spare, actions
    sizes = _split_nodes(templates, len(joined))
    start = 0
    for size in sizes:
        nodes = planner.best_order(joined[start:start + size])
        groups.append(_Group(nodes, "joined"))
        actions.append(f"new pipeline on joined node(s) {nodes}")
        start += size
    for node in joined[start:]:
        best = None
        for group in groups:
            if not planner.fits(len(group.nodes) + 1):
                continue
            order = planner.best_order(group.nodes + [node])
            key = (planner.cost(order), len(group.nodes))
            if best is None or key < best[0]:
                best = (key, group, order)
        if best is None:
            spare.append(node)
            actions.append(f"node {node} is a spare: no pipeline can grow by one node")
            continue
        best[1].nodes = best[2]
        actions.append(f"node {node} joined pipeline now on {best[2]}")
    return spare, actions


def _split_nodes(templates: TemplateSet, count: int) -> list[int]:
    """Template sizes summing to as many of `count` nodes as possible, in as few pipelines as
    possible (largest first); the rest are placed one by one or stay spare."""
    sizes = sorted(templates.by_nodes(), reverse=True)
    best: dict[int, list[int]] = {0: []}
    for total in range(1, count + 1):
        options = [best[total - s] + [s] for s in sizes if s <= total and (total - s) in best]
        if options:
            best[total] = min(options, key=lambda o: (len(o), [-x for x in o]))
    return sorted(best[max(best)], reverse=True)


def _transfers(planner: _Planner, groups: Iterable[_Group]) -> list[Transfer]:
    needs = [item for g in groups for item in planner.missing(planner.by_nodes[len(g.nodes)], g.nodes)]
    holders: dict[int, list[WorkerRef]] = {}
    for ref, layers in planner.old.items():
        for layer in layers:
            holders.setdefault(layer, []).append(ref)
    sent: dict[WorkerRef, int] = {}
    out = []
    for dst, layer, nbytes in sorted(needs, key=lambda x: (-x[2], x[1], x[0])):
        src = min(holders[layer], key=lambda w: (sent.get(w, 0), w))
        sent[src] = sent.get(src, 0) + nbytes
        out.append(Transfer(layer=layer, src=src, dst=dst, bytes=nbytes))
    return sorted(out, key=lambda t: (t.dst, t.layer))


def plan_transfers(templates: TemplateSet, before: Instantiation, after: Instantiation,
                   lost: Iterable[int] = ()) -> list[Transfer]:
    """The transfers that take the surviving holders of `before` to the layout of `after`
    (what `reconfigure` returns for the instantiation it chose; Note: [transfers])."""
    planner = _Planner(templates, before, set(lost))
    return _transfers(planner, [_Group(list(p.nodes), "") for p in after.pipelines])


def reconfigure(templates: TemplateSet, previous: Instantiation, *, lost: Iterable[int] = (),
                joined: Iterable[int] = ()) -> ReconfigurationPlan:
    """The next generation's instantiation and transfer plan (see module docstring)."""
    lost_set = set(lost)
    joined_list = sorted(set(joined))
    known = set(previous.nodes)
    if unknown := sorted(lost_set - known):
        raise PlanningError(f"lost node(s) {unknown} are not in the current instantiation {sorted(known)}")
    if again := sorted(set(joined_list) & (known - lost_set)):
        raise PlanningError(f"joining node(s) {again} are already members")
    planner = _Planner(templates, previous, lost_set)
    held = set().union(*planner.old.values())
    if orphans := [i for i in range(len(templates.layer_state_bytes)) if i not in held]:
        raise LayersLostError(orphans)
    groups, spares, actions = _after_failures(planner, previous, lost_set)
    # Spares of the previous generation hold no current state: they join like new nodes.
    waiting = sorted(set(joined_list) | (set(previous.spares) - lost_set))
    if spares and waiting:  # this generation's new spares can team up with the joiners
        waiting = sorted(set(waiting) | set(spares))
        spares = []
    still_spare, absorbed = _absorb(planner, groups, waiting)
    actions += absorbed
    spares += still_spare
    if not groups:
        raise PlanningError(f"no pipeline can be formed from the {len(spares)} live node(s) {spares}")
    warnings = []
    if spares:
        warnings.append(f"node(s) {sorted(spares)} idle as spares until more nodes join")
    if len(groups) < templates.fault_tolerance + 1:
        warnings.append(
            f"only {len(groups)} pipeline(s) for fault_tolerance={templates.fault_tolerance}: "
            f"the next failure may lose layers until nodes join again")
    chosen = [planner.by_nodes[len(g.nodes)] for g in groups]
    inst = build_instantiation(chosen, [g.nodes for g in groups], previous.global_batch_size,
                               previous.microbatch_size, spares)
    return ReconfigurationPlan(lost=tuple(sorted(lost_set)), joined=tuple(joined_list),
                               instantiation=inst, actions=tuple(actions),
                               transfers=tuple(_transfers(planner, groups)), warnings=tuple(warnings))
