"""What crosses the membership store, as frozen values with one versioned JSON encoding each:
generation records, step decisions, dead marks. Everything read from the store is parsed here
and checked before anything acts on it (docs/recovery.md, "Trust model"); the store's keys and
calls are elastic/protocol/'s."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from oobleck_elastic.errors import OobleckError, PlanningError
from oobleck_elastic.planning import Instantiation, TemplateSet, check_instantiation
from oobleck_elastic.planning.recovery import NextLayout
from oobleck_elastic.planning.values import from_jsonable, to_jsonable

__all__ = ["RecordError", "Resumed", "GenerationRecord", "Outcome", "StepDecision", "DeadMark", "VERSION"]

VERSION = 1


class RecordError(OobleckError):
    """A record in the membership store that this job could not have written."""


def _refuse(what: str, exc: Exception) -> RecordError:
    return RecordError(f"{what} in the membership store is not one this job wrote ({exc}); only the job's own "
                       "nodes may write to its store (docs/recovery.md, Trust model)")


def _ints(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise ValueError(f"{name} {value!r} is not a list of node ids")
    return tuple(value)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a job's first generation continues from."""

    run_id: str
    step: int


@dataclass(frozen=True, kw_only=True)
class GenerationRecord:
    """One generation: its members and layout, the step it starts at, and where its layers come
    from (its `base` generation in memory, a checkpoint, or nothing: a fresh start). The
    rendezvous writes a bare record of generation 0 (`instantiation` None): its members only."""

    generation: int
    nodes: tuple[int, ...]
    start_step: int = 0
    base: int | None = None
    instantiation: Instantiation | None = None
    restored_from: int | None = None
    resumed: Resumed | None = None
    cause: str | None = None
    lost: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    actions: tuple[str, ...] = field(default=())
    evaluated: bool = False
    """The evaluation after start_step was recorded before the proposal: not run again. In the
    record, so every member decides alike."""
    stopping: bool = False
    """A stop was requested before the proposal: the generation writes the checkpoint of its
    start step and ends the run (Note: [stop on request] in elastic/agent.py), joiners too."""

    @classmethod
    def next(cls, generation: int, layout: NextLayout, cause: str | None) -> GenerationRecord:
        inst = layout.instantiation
        return cls(generation=generation, nodes=inst.nodes, start_step=layout.start_step, base=layout.base,
                   instantiation=inst, restored_from=layout.restored_from, cause=cause, lost=layout.lost,
                   joined=layout.joined, actions=layout.actions)

    @property
    def planned(self) -> bool:
        return self.instantiation is not None

    def to_json(self) -> dict[str, Any]:
        out = {"version": VERSION, "generation": self.generation, "nodes": list(self.nodes),
               "start_step": self.start_step}
        if self.planned:
            out.update(base=self.base, instantiation=to_jsonable(self.instantiation),
                       restored_from=self.restored_from, cause=self.cause, lost=list(self.lost),
                       joined=list(self.joined), actions=list(self.actions), evaluated=self.evaluated,
                       stopping=self.stopping)
            if self.resumed is not None:
                out["resumed"] = {"run_id": self.resumed.run_id, "step": self.resumed.step}
        return out

    @classmethod
    def from_json(cls, data: Any) -> GenerationRecord:
        """The record, structurally checked (`check` tests it against the job)."""
        what = f"generation record {data.get('generation')!r}" if isinstance(data, dict) else "a generation record"
        try:
            if not isinstance(data, dict):
                raise ValueError("it is not an object")
            version = data.get("version", VERSION)
            if version != VERSION:
                raise ValueError(f"version {version!r}, this build reads version {VERSION}")
            g, start = data["generation"], data["start_step"]
            if not (isinstance(g, int) and g >= 0 and isinstance(start, int) and start >= 0):
                raise ValueError(f"generation {g!r} / start step {start!r} are not counts")
            nodes = _ints(data["nodes"], "nodes")
            if "instantiation" not in data:  # only the rendezvous's bare record of generation 0
                if g != 0 or start != 0 or set(data) - {"version", "generation", "nodes", "start_step"}:
                    raise ValueError("it has no instantiation")
                return cls(generation=g, nodes=nodes, start_step=start)
            base, restored = data["base"], data.get("restored_from")
            if base is not None and not (isinstance(base, int) and 0 <= base < g):
                raise ValueError(f"base {base!r} is not an earlier generation")
            if restored is not None and restored != start:
                raise ValueError(f"it restores step {restored!r} but starts at step {start}")
            inst = from_jsonable(Instantiation, data["instantiation"])
            if sorted(nodes) != list(inst.nodes):
                raise ValueError(f"its nodes {list(nodes)} are not its instantiation's {list(inst.nodes)}")
            resumed = data.get("resumed")
            return cls(generation=g, nodes=nodes, start_step=start, base=base, instantiation=inst,
                       restored_from=restored, cause=str(data.get("cause")),
                       lost=_ints(data.get("lost", []), "lost"), joined=_ints(data.get("joined", []), "joined"),
                       actions=tuple(str(a) for a in data.get("actions", [])),
                       evaluated=bool(data.get("evaluated", False)), stopping=bool(data.get("stopping", False)),
                       resumed=Resumed(str(resumed["run_id"]), int(resumed["step"])) if resumed else None)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _refuse(what, exc) from exc

    def check(self, templates: TemplateSet, *, global_batch: int, microbatch: int, steps: int) -> GenerationRecord:
        """Itself, once its layout is one this job could have planned; else RecordError."""
        try:
            if self.instantiation is None:
                raise ValueError("it has no instantiation")
            if not 0 <= self.start_step <= steps:
                raise ValueError(f"start step {self.start_step} is outside the run's 0..{steps}")
            check_instantiation(self.instantiation, templates, global_batch, microbatch)
        except (ValueError, PlanningError) as exc:
            raise _refuse(f"generation record {self.generation}", exc) from exc
        return self


class Outcome(enum.Enum):
    COMMIT = "commit"
    ABORT = "abort"


@dataclass(frozen=True)
class StepDecision:
    """The one decision on a step (Note: [step transaction]): commit (with the joiners admitted
    after it and whether the run stops after it) or abort."""

    outcome: Outcome
    join: tuple[int, ...] = ()
    stop: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "outcome": self.outcome.value, "join": list(self.join), "stop": self.stop}

    @classmethod
    def from_json(cls, data: Any) -> StepDecision:
        try:
            if data.get("version", VERSION) != VERSION:
                raise ValueError(f"version {data.get('version')!r}, this build reads version {VERSION}")
            return cls(Outcome(data["outcome"]), _ints(data.get("join", []), "join"), bool(data.get("stop")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _refuse("a step decision", exc) from exc


@dataclass(frozen=True)
class DeadMark:
    """A node taken for dead, by whom and why (its agent, the launcher, a missed roll call)."""

    why: str
    at: float

    def to_json(self) -> dict[str, Any]:
        return {"why": self.why, "at": self.at}
