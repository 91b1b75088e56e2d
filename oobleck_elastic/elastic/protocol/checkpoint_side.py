"""A run's checkpoint bookkeeping on the store (elastic/run_checkpoints.py's): how many layers of a
checkpoint are written, which publications were found damaged, which checkpoint the newest
generation restores, and a start that cannot resume."""

from __future__ import annotations

import re

from oobleck_elastic.elastic.protocol.keys import KEYS, key
from oobleck_elastic.elastic.protocol.side import Side

__all__ = ["CheckpointSide"]

_DAMAGED = re.compile(next(spec.pattern() for spec in KEYS if spec.name == "damaged").replace(r"\d+", r"(\d+)"))


class CheckpointSide(Side):
    @staticmethod
    def _written_key(generation: int, step: int, final: bool) -> str:
        # a final write of a step counts apart from its interval write in the same generation:
        # one may follow the other (a stop at a checkpoint interval whose write failed)
        return key("final written" if final else "checkpoint written", generation=generation, step=step)

    def checkpoint_written(self, generation: int, step: int, layers: int, final: bool = False) -> int:
        """Counts `layers` more layers of the checkpoint after `step` written; returns the total."""
        return self.store.add(self._written_key(generation, step, final), layers)

    def checkpoint_published(self, generation: int, step: int, final: bool = False) -> None:
        """The checkpoint after `step` is complete: its count can go (Note: [store keys])."""
        self.store.delete(self._written_key(generation, step, final))

    def mark_damaged(self, step: int, publication: str, why: str) -> None:
        """That publication of the checkpoint of `step` (runtime.checkpoint.identity) failed its
        checksum: no fallback takes it again, though the step may be published anew (runtime/
        checkpoint.py Note: [newest checkpoint])."""
        self.store.set_json(key("damaged", step=step), {"publication": publication, "why": why,
                                                        "at": self.clocks.wall()})

    def damaged(self) -> dict[int, str]:
        """step -> the publication of its checkpoint found damaged."""
        out = {}
        for stored in self.store.keys():
            if (m := _DAMAGED.fullmatch(stored)) and (mark := self.store.try_get_json(stored)):
                out[int(m.group(1))] = str(mark.get("publication"))
        return out

    def restoring(self) -> set[int]:
        """The checkpoint step the newest generation restores, if it restores one: `keep` must
        not retire it while its members load it."""
        if self.try_pointer() is None:
            return set()
        record = self.current(10.0)
        return {record.restored_from} if record.restored_from else set()

    def refuse_start(self, error: str) -> None:
        """Generation 0 cannot be written (its checkpoint cannot be resumed): every worker fails
        with the same line."""
        self.store.set_json(key("start_error"), {"error": error})
