"""A generation record as the protocol writes it, for tests of the protocol (on a fake store) and
of what a run leaves in a real one."""

from __future__ import annotations

from runtime_harness import templates_for

from oobleck_elastic.elastic.records import GenerationRecord
from oobleck_elastic.planning import build_instantiation

TEMPLATES = templates_for(6, 6)


def record(generation: int, nodes=((0, 1), (2, 3)), start: int = 0, cause: str = "test") -> GenerationRecord:
    inst = build_instantiation([TEMPLATES.get(len(p)) for p in nodes], nodes, 24, 2)
    return GenerationRecord(generation=generation, nodes=inst.nodes, start_step=start, instantiation=inst,
                            base=generation - 1 if generation else None, cause=cause)
