"""The run as one worker lives it, as an explicit state machine: which state it is in, and for
each event (a generation built, a step done, a failure, a record proposed) the next state and
the one action to take. It decides; it does nothing itself: elastic/run.py carries out the
actions and reports their outcome as the next event. So every transition is a pure function
that tests drive without processes (tests/unit/test_controller.py).

    JOINING ──Admitted──▶ BUILDING ──Built──▶ TRAINING ──StepDone / EvalDone──▶ TRAINING
       │                   ▲   │                  │ └──StepDone(joiners)──▶ BUILDING (Grow)
       │                   │   └──BuildFailed──┐  └──StepFailed──┐
       │                   └────Proposed───── RECOVERING ◀──────┘
       └──RunOver──▶ DONE ◀──Finished (after Finish: the last step, or a stop) / Fenced (from any state)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from oobleck_elastic.elastic.records import GenerationRecord
from oobleck_elastic.errors import RunFailed

__all__ = ["State", "Controller", "GiveUp", "IllegalTransition",
           "Started", "Admitted", "RunOver", "Built", "BuildFailed", "StepDone", "StepFailed", "EvalDone",
           "Proposed", "Finished", "FencedOut",
           "Join", "Build", "Train", "Evaluate", "Finish", "Recover", "Grow", "Exit"]

MAX_REPLAYS_WITHOUT_LOSS = 3


class State(enum.Enum):
    JOINING = "joining"
    BUILDING = "building"
    TRAINING = "training"
    RECOVERING = "recovering"
    DONE = "done"


class GiveUp(RunFailed):
    """A step keeps failing with every node alive: not a node failure (a bug, out of memory)."""


class IllegalTransition(AssertionError):
    """An event that cannot happen in the state the run is in (a bug in the executor)."""


# --- events: what happened --------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    """The worker has its plan; `member`: its node is in the first generation's record."""

    member: bool
    record: GenerationRecord | None = None


@dataclass(frozen=True)
class Admitted:
    record: GenerationRecord


@dataclass(frozen=True)
class RunOver:
    """The run finished before this node was admitted."""


@dataclass(frozen=True)
class Built:
    record: GenerationRecord


@dataclass(frozen=True)
class BuildFailed:
    cause: str
    error: str = ""
    """The whole error (its traceback, as text: a failure holds no frame)."""


@dataclass(frozen=True)
class StepDone:
    step: int
    joiners: tuple[int, ...] = ()
    stop: bool = False


@dataclass(frozen=True)
class EvalDone:
    step: int


@dataclass(frozen=True)
class StepFailed:
    """A step, an evaluation or the final checkpoint failed (a collective broke, or the step
    was aborted by another worker)."""

    cause: str
    error: str = ""


@dataclass(frozen=True)
class Proposed:
    """The record that won the compare-and-set for the next generation. `replay`: no node was
    lost or joined (the same nodes replay the step)."""

    record: GenerationRecord
    replay: bool = False


@dataclass(frozen=True)
class Finished:
    """The checkpoint of the step the run ended at is published and the end recorded: the run
    is over."""


@dataclass(frozen=True)
class FencedOut:
    reason: str


# --- actions: what to do next -----------------------------------------------------------------

@dataclass(frozen=True)
class Join:
    """Report ready and wait to be admitted."""


@dataclass(frozen=True)
class Build:
    record: GenerationRecord
    timeout_factor: int = 1
    """The collective timeout's multiple: each replay with every node alive doubles it."""


@dataclass(frozen=True)
class Train:
    step: int


@dataclass(frozen=True)
class Evaluate:
    step: int


@dataclass(frozen=True)
class Finish:
    """End the run: write the checkpoint of the step reached, check that it is published and
    record the end (collectives: they may fail, and are then done again in the next
    generation). `stopped`: the run stops on request before its last step."""

    stopped: bool = False


@dataclass(frozen=True)
class Recover:
    cause: str


@dataclass(frozen=True)
class Grow:
    joiners: tuple[int, ...]


@dataclass(frozen=True)
class Exit:
    reason: str  # "done", "stopped", "fenced", "run over"


class Controller:
    """One worker's state machine. `steps`: the run's length; `eval_interval`: evaluate after
    every that many steps (0: never)."""

    def __init__(self, steps: int, eval_interval: int = 0, max_replays: int = MAX_REPLAYS_WITHOUT_LOSS) -> None:
        self.steps, self.eval_interval, self.max_replays = steps, eval_interval, max_replays
        self.state = State.JOINING
        self.completed = 0  # steps this worker has applied
        self.stopping = False  # a stop was committed: the run ends at the step it reached
        self.evaluated: int | None = None  # the step after which this worker last evaluated
        self.replays: dict[int, int] = {}  # step -> replays after failures in which no node was lost
        self.last_cause: str | None = None  # the last failure, in a line
        self.last_error: str | None = None  # the whole error of the last failure, for GiveUp
        self.history: list[tuple[State, str, State]] = []  # (from, event, to), for logs and tests

    def handle(self, event: object) -> object:
        """The action for `event` in the current state; moves to the next state."""
        before = self.state
        action = self._transition(event)
        self.history.append((before, type(event).__name__, self.state))
        return action

    def _transition(self, event: object) -> object:
        state = self.state
        if isinstance(event, FencedOut):
            return self._to(State.DONE, Exit("fenced"))
        if state is State.JOINING:
            if isinstance(event, Started):
                if not event.member:
                    return Join()
                assert event.record is not None, "a member starts with the first generation's record"
                return self._to(State.BUILDING, Build(event.record))
            if isinstance(event, Admitted):
                return self._to(State.BUILDING, Build(event.record))
            if isinstance(event, RunOver):
                return self._to(State.DONE, Exit("run over"))
        elif state is State.BUILDING:
            if isinstance(event, Built):
                self.completed = event.record.start_step
                # from the record every member adopted, so all of them decide alike
                self.evaluated = self.completed if event.record.evaluated else None
                self.stopping = self.stopping or event.record.stopping
                return self._to(State.TRAINING, self._next_work())
            if isinstance(event, BuildFailed):
                return self._recover(event.cause, event.error)
            if isinstance(event, Proposed):  # a grow's record
                return self._build(event.record)
        elif state is State.TRAINING:
            if isinstance(event, StepDone):
                return self._step_done(event)
            if isinstance(event, EvalDone):
                self.evaluated = event.step
                return self._next_work()
            if isinstance(event, StepFailed):
                return self._recover(event.cause, event.error)
            if isinstance(event, Finished):
                return self._to(State.DONE, Exit("stopped" if self.stopping else "done"))
        elif state is State.RECOVERING:
            if isinstance(event, Proposed):
                if event.replay:
                    self._count_replay(event.record.start_step)
                return self._build(event.record)
        raise IllegalTransition(f"{type(event).__name__} cannot happen while {state.value}")

    def _to(self, state: State, action: object) -> object:
        self.state = state
        return action

    def _next_work(self) -> object:
        done, interval = self.completed, self.eval_interval
        if self.stopping:
            return Finish(stopped=True)
        if interval and done > 0 and done % interval == 0 and self.evaluated != done:
            return Evaluate(done)
        if done < self.steps:
            return Train(done)
        return Finish()

    def _step_done(self, event: StepDone) -> object:
        if event.step != self.completed:
            raise IllegalTransition(f"step {event.step} done, but step {self.completed} was the one to train")
        self.completed = event.step + 1
        if event.stop and self.completed < self.steps:  # the run ends here, as at its last step
            self.stopping = True
            return Finish(stopped=True)
        if event.joiners:
            return self._to(State.BUILDING, Grow(event.joiners))
        return self._next_work()

    def _recover(self, cause: str, error: str) -> object:
        self.last_cause, self.last_error = cause, error or cause
        return self._to(State.RECOVERING, Recover(cause))

    def _build(self, record: GenerationRecord) -> object:
        return self._to(State.BUILDING, Build(record, 2 ** self.replays.get(record.start_step, 0)))

    def _count_replay(self, step: int) -> None:
        """A step that keeps failing with every node alive is not a node failure: it ends the
        run after a few replays instead of looping. Slow is not dead: each replay doubles the
        collective timeout first (`Build.timeout_factor`)."""
        self.replays[step] = self.replays.get(step, 0) + 1
        if self.replays[step] > self.max_replays:
            raise GiveUp(f"step {step} failed {self.replays[step]} times with every node alive, so it is not a "
                         f"node failure: {self.last_cause}\nThe last failure, whole:\n{self.last_error}")
