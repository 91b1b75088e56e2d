"""An agent's calls (the `oobleck` rendezvous handler and its heartbeat): registering its node,
beginning the run, leaving it, and clearing the run's working state when the last node leaves
(Note: [store keys])."""

from __future__ import annotations

from oobleck_elastic.elastic.protocol.keys import RECORDS, key
from oobleck_elastic.elastic.protocol.side import Side
from oobleck_elastic.elastic.records import GenerationRecord

__all__ = ["AgentSide"]


class AgentSide(Side):
    def register(self, info: dict[str, object]) -> int:
        """A new node id (an agent's), with what it says of itself (host, pid, heartbeat)."""
        node = self.store.add(key("next node"), 1) - 1
        self.store.set_json(key("node", node=node), info)
        return node

    def limits(self) -> dict | None:
        return self.store.try_get_json(key("limits"))

    def begin(self, min_nodes: int, max_nodes: int) -> None:
        """The run's limits and generation 0's bare record (its first members), once."""
        self.store.create_json(key("limits"), {"min_nodes": min_nodes, "max_nodes": max_nodes})
        self.store.create_json(key("pointer"), GenerationRecord(generation=0, nodes=tuple(range(min_nodes))).to_json())

    def begun(self) -> bool:
        return self.store.try_get_json(key("pointer")) is not None

    def agent_prefix(self, node: int) -> str:
        """Where torch's agent of `node` keeps its own keys (a PrefixStore of the torch store)."""
        return key("agent", node=node).rstrip("/")

    def leave(self, node: int) -> None:
        self.store.set_json(key("left", node=node), True)

    def has_left(self, node: int) -> bool:
        return self.store.try_get_json(key("left", node=node)) is not None

    def close(self) -> None:
        self.store.set_json(key("closed"), True)

    def closed(self) -> bool:
        return self.store.try_get_json(key("closed")) is not None

    def everyone_left(self) -> bool:
        """Whether every node that registered has left or is marked dead."""
        return all(self.has_left(n) or self.liveness.marked_dead(n) for n in range(self.registered()))

    def forget_working_state(self) -> int:
        """Deletes every key but the run's RECORDS, once no node is left in a finished run."""
        return self.store.delete_keys(k for k in self.store.keys() if not RECORDS.fullmatch(k))
