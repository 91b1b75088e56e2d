"""The store's keys come from one table (elastic/protocol/keys.py): which keys a run keeps and
which go with their generation are derived from it, and no module writes or reads a key it
spelled itself."""

from __future__ import annotations

import ast
import pathlib

import pytest

from oobleck_elastic.elastic.protocol.keys import KEYS, RECORDS, Lifetime, generation_of, key

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "oobleck_elastic"
STORE_CALLS = {"set_json", "get_json", "try_get_json", "create_json", "add", "delete"}


def test_keys_are_filled_in_from_the_table():
    assert key("generation", generation=3) == "generation/3"
    assert key("rollcall", generation=2, node=5, rank=1) == "rollcall/2/5/1"
    with pytest.raises(KeyError):
        key("no such key")


@pytest.mark.parametrize(("stored", "kept"), [
    ("generation", True), ("generation/12", True), ("recovery/3", True), ("nodes/next", True), ("nodes/4", True),
    ("nodes/4/dead", True), ("nodes/4/left", True), ("checkpoint/40/damaged", True), ("done", True),
    ("nodes/4/ready", False), ("nodes/4/workers", False), ("lease/4", False), ("faults/4", False),
    ("gen3/built", False), ("gen3/step7/decision", False), ("rollcall/3/started", False), ("evaluated/9", False),
    ("gen3/checkpoint8", False), ("agent0/torchelastic/x", False), ("generation/x", False), ("donee", False),
])
def test_the_records_a_run_keeps_are_the_tables_records(stored, kept):
    assert bool(RECORDS.fullmatch(stored)) is kept


@pytest.mark.parametrize(("stored", "generation"), [
    ("gen3/built", 3), ("gen12/step40/ready", 12), ("gen3/rank_0", 3), ("rollcall/7/2/0", 7),
    ("rollcall/7/started", 7),
    ("gen3/checkpoint8", None), ("gen3/final8", None),  # counts go when their checkpoint is published
    ("generation/3", None), ("recovery/3", None), ("lease/3", None), ("agent3/x", None),
])
def test_a_keys_generation_is_derived_from_the_table(stored, generation):
    assert generation_of(stored) == generation


def test_every_key_in_the_table_has_one_name_and_a_lifetime():
    assert len({spec.name for spec in KEYS}) == len(KEYS)
    assert all(isinstance(spec.lifetime, Lifetime) and spec.what for spec in KEYS)


def _spelled_keys(source: str, where: str) -> list[str]:
    """Calls `<...>store.<call>(key, ...)` whose key is a string literal or an f-string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in STORE_CALLS and node.args):
            continue
        owner = node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if name.endswith("store") and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
            found.append(f"{where}:{node.lineno}")
    return found


def test_no_module_spells_a_store_key_itself():
    found = [hit for path in PACKAGE.rglob("*.py") if "stores" not in path.parts
             for hit in _spelled_keys(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert not found, f"build these keys with elastic.protocol.keys.key(): {found}"


def test_the_spelled_key_finder_finds_one():
    assert _spelled_keys('self.store.set_json(f"gen{g}/x", 1)\nstore.add("nodes/next", 1)', "probe") == [
        "probe:1", "probe:2"]
    assert _spelled_keys('self.store.set_json(key("done"), 1)\nnames.add("x")', "probe") == []
