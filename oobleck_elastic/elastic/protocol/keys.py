"""Every key a run writes in its membership store, in one table: what it holds, who writes it,
and how long it lives. Every other module builds its keys with `key()`; which keys survive the
run (`RECORDS`) and which go with their generation are derived from the table.

Note: [store keys]
    A run's records stay in the store after it ends (Lifetime.RECORD: the generation records,
    the recoveries, the end record, each node's registration and its end); everything else is
    working state and goes. Generation g's keys (`gen<g>/`: its steps, its build count and
    torch's process-group bootstrap; `rollcall/<g>/`) are deleted by generation g+k's rank 0
    after its first commit: every member has built g+k by then, so nobody still in the run reads
    them, and a stale member of g that wakes up finds no commit to join (a fresh `ready` count
    cannot reach g's world size without the others) and is fenced. A checkpoint's count of
    written layers (Lifetime.COUNT) goes when the checkpoint is published (a background write
    may still add to it after its generation ended; a count left by a failure goes at the end).
    What the agents use (Lifetime.RUN: leases, readiness, torch's agent bookkeeping) goes when
    the last node leaves a finished run.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["KEYS", "KeySpec", "Lifetime", "RECORDS", "generation_of", "key"]


class Lifetime(enum.Enum):
    RECORD = "record"
    """Kept after the run ends: what happened, for people and for a resume."""
    GENERATION = "generation"
    """One generation's working state: deleted once a later generation has committed a step."""
    COUNT = "count"
    """A checkpoint's count of written layers: deleted when the checkpoint is published."""
    RUN = "run"
    """The run's working state: deleted when the last node leaves a finished run."""


@dataclass(frozen=True)
class KeySpec:
    name: str
    template: str
    """The key, with its fields in braces (`generation/{generation}`); a template ending in `/`
    is a prefix that others (torch) write under."""
    lifetime: Lifetime
    what: str

    def pattern(self) -> str:
        """A regular expression matching the keys of this template (every field a number)."""
        text = re.sub(r"\\\{\w+\\\}", r"\\d+", re.escape(self.template))
        return text + ".*" if self.template.endswith("/") else text


R, G, C, W = Lifetime.RECORD, Lifetime.GENERATION, Lifetime.COUNT, Lifetime.RUN
KEYS = (
    # the job
    KeySpec("job", "job", R, "the job's description; a node with another one is refused"),
    KeySpec("instance", "instance", R, "this start of the run: a random id and when it began"),
    KeySpec("limits", "limits", R, "--nnodes MIN:MAX, written with the first generation"),
    KeySpec("profile", "profile", R, "the model's profile, measured once by the first worker"),
    KeySpec("failed", "failed", R, "the first fatal error: joiners stop waiting, the launcher says why"),
    KeySpec("start_error", "start_error", R, "why generation 0 cannot be written (its checkpoint)"),
    KeySpec("stop", "stop", R, "a stop was requested; the next commit carries it"),
    KeySpec("closed", "closed", R, "the rendezvous is closed"),
    # generations
    KeySpec("pointer", "generation", R, "the newest generation record (a hint that may lag)"),
    KeySpec("generation", "generation/{generation}", R, "generation g's record, written once by compare-and-set"),
    KeySpec("built", "gen{generation}/built", G, "how many workers built generation g"),
    KeySpec("ready", "gen{generation}/step{step}/ready", G, "how many workers finished a step's collectives"),
    KeySpec("decision", "gen{generation}/step{step}/decision", G, "the one decision on a step"),
    KeySpec("torch", "gen{generation}/", G, "torch's process-group bootstrap (runtime/generation.py's PrefixStore)"),
    KeySpec("rollcall started", "rollcall/{generation}/started", G, "a member began a recovery from g"),
    KeySpec("rollcall", "rollcall/{generation}/{node}/{rank}", G, "a worker checked in after a failure"),
    KeySpec("reach report", "rollcall/{generation}/reach/{node}/{rank}", G,
            "the members a worker could not reach on the data network (Note: [gray failures])"),
    KeySpec("evaluated", "evaluated/{step}", W, "the evaluation after a step is done"),
    # checkpoints
    KeySpec("checkpoint written", "gen{generation}/checkpoint{step}", C, "layers of a checkpoint written"),
    KeySpec("final written", "gen{generation}/final{step}", C, "layers of a final checkpoint written"),
    KeySpec("damaged", "checkpoint/{step}/damaged", R, "a publication of a checkpoint failed its checksum"),
    # nodes
    KeySpec("next node", "nodes/next", R, "the number of nodes registered (the next node id)"),
    KeySpec("node", "nodes/{node}", R, "what a node says of itself (host, pid, heartbeat)"),
    KeySpec("dead", "nodes/{node}/dead", R, "a node is dead, and on what evidence (final)"),
    KeySpec("left", "nodes/{node}/left", R, "a node's agent left the run"),
    KeySpec("node workers", "nodes/{node}/workers", W, "a joining node's number of workers"),
    KeySpec("node ready", "nodes/{node}/ready", W, "how many of a joining node's workers are ready"),
    KeySpec("lease", "lease/{node}", W, "a node's heartbeat: the beat and its agent's wall time"),
    KeySpec("responder", "reach/{node}/{rank}", W, "where a worker answers probes on the data network"),
    KeySpec("fault", "faults/{node}", W, "a fault injector's kill of the node (when it struck)"),
    KeySpec("agent", "agent{node}/", W, "torch's agent bookkeeping (rendezvous.py's PrefixStore)"),
    # what the reporting worker mirrors for the launcher
    KeySpec("progress", "progress", R, "the last committed step's figures"),
    KeySpec("recovery", "recovery/{generation}", R, "the recovery that made generation g"),
    KeySpec("resumed", "resumed", R, "the checkpoint the run resumed from"),
    KeySpec("done", "done", R, "the run's end: its steps, and whether it stopped on request"),
)
del R, G, C, W
_BY_NAME = {spec.name: spec for spec in KEYS}
assert len(_BY_NAME) == len(KEYS), "two keys with one name"


def key(name: str, **fields: int | str) -> str:
    """The key `name` of the table with its fields filled in: `key("generation", generation=3)`."""
    return _BY_NAME[name].template.format(**fields)


def _matcher(lifetime: Lifetime) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{spec.pattern()})" for spec in KEYS if spec.lifetime is lifetime))


RECORDS = _matcher(Lifetime.RECORD)
"""The keys a run leaves behind (`RECORDS.fullmatch(key)`; docs/launching.md, "etcd keys")."""
_COUNTS = _matcher(Lifetime.COUNT)
# where each generation's working keys live: `gen<g>/`, `rollcall/<g>/`
_SCOPES = sorted({spec.template.partition("{generation}")[0] for spec in KEYS if spec.lifetime is Lifetime.GENERATION})
_GENERATION = re.compile("(?:" + "|".join(map(re.escape, _SCOPES)) + r")(\d+)/")


def generation_of(stored: str) -> int | None:
    """The generation whose working state `stored` is (Lifetime.GENERATION), or None: records,
    counts and the run's working keys belong to no generation."""
    if _COUNTS.fullmatch(stored) or RECORDS.fullmatch(stored):
        return None
    m = _GENERATION.match(stored)
    return None if m is None else int(m.group(1))
