"""The launcher's reads of a local job's run: what the reporting worker mirrors for it (the last
step's figures, each recovery, a resume), beside what every side reads (the generations, the
run's failure and end, the nodes)."""

from __future__ import annotations

from oobleck_elastic.elastic.protocol.keys import key
from oobleck_elastic.elastic.protocol.side import Side

__all__ = ["LauncherSide"]


class LauncherSide(Side):
    def progress(self) -> dict | None:
        return self.store.try_get_json(key("progress"))

    def recovery(self, generation: int) -> dict | None:
        return self.store.try_get_json(key("recovery", generation=generation))

    def resumed(self) -> dict | None:
        return self.store.try_get_json(key("resumed"))
