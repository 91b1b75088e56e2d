"""Imports flow one way: config <- planning <- runtime <- elastic; monitoring beside them;
data (datasets) and models (adapters onto runtime.model) beside the runtime; testing (fault
injection) low, built by elastic and only called by the runtime through the hook it is given;
launcher (what the launch CLI runs: a node, a local job) on top, imported by no layer; the
entry points (the top-level modules `python -m` runs) above everything, imported by no layer.
No two modules import each other, directly or round a longer circle."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "oobleck_elastic"
# what each layer may import from the package (besides itself and errors)
ALLOWED = {
    "config": set(),
    "planning": {"config"},
    "monitoring": {"config", "planning"},
    "runtime": {"config", "planning", "monitoring"},
    "data": {"config"},
    "models": {"config", "runtime"},
    "elastic": {"config", "planning", "monitoring", "runtime", "testing"},
    "testing": {"config"},
    "launcher": {"config", "planning", "monitoring", "runtime", "elastic", "testing"},
    "simulation": {"config", "planning", "monitoring"},  # monitoring.metrics: the metrics log it fits
}


def imports_of(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_lower_layers(layer):
    for path in (PACKAGE / layer).rglob("*.py"):
        for name in imports_of(path):
            if name.startswith("oobleck_elastic."):
                target = name.split(".")[1]
                assert target in ALLOWED[layer] | {layer, "errors"}, f"{path.name} imports {name}"


# the top-level modules: the package's face (errors, the user-facing names), then the entry points
TOP_LEVEL = {"errors": set(), "__init__": {"config"}}
ENTRY_POINTS = {"chaos", "export", "launch", "plan", "simulate", "train"}


def test_top_level_modules_import_downwards():
    """errors imports nothing of the package and `import oobleck_elastic` only config; an entry
    point may use any layer and another entry point, and no layer imports an entry point."""
    found = {path.stem for path in PACKAGE.glob("*.py")}
    assert found == set(TOP_LEVEL) | ENTRY_POINTS, f"a new top-level module: place it here, {found}"
    for stem, allowed in TOP_LEVEL.items():
        for name in imports_of(PACKAGE / f"{stem}.py"):
            if name.startswith("oobleck_elastic."):
                assert name.split(".")[1] in allowed | {"errors"}, f"{stem}.py imports {name}"
    for path in PACKAGE.rglob("*.py"):
        if path.parent == PACKAGE:
            continue
        for name in imports_of(path):
            parts = name.split(".")
            assert not (parts[0] == "oobleck_elastic" and len(parts) > 1 and parts[1] in ENTRY_POINTS), (
                f"{path.relative_to(PACKAGE)} imports the entry point {name}")


def _module_graph() -> dict[str, set[str]]:
    """Each module of the package (dotted name) and the package modules it imports anywhere in
    its text, a function's own imports included: a lazy import still ties two modules."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in modules.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)  # a submodule imported by name
        graph[module] = {name for name in names if name in modules and name != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == node:
                        break
                if len(part) > 1:
                    circles.append(sorted(part))
    return circles


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_two_modules_import_each_other():
    assert _circles(_module_graph()) == []


def test_planning_never_imports_torch():
    for path in (PACKAGE / "planning").rglob("*.py"):
        assert not any(n == "torch" or n.startswith("torch.") for n in imports_of(path)), path.name


def test_simulation_never_imports_torch():
    """The trace simulator runs on the planner alone: sizing a job needs no torch."""
    for path in (PACKAGE / "simulation").rglob("*.py"):
        assert not any(n == "torch" or n.startswith("torch.") for n in imports_of(path)), path.name


def test_config_never_imports_torch():
    """Parsing a job needs no torch (the plan CLI, tools reading a job file); the optimizer's
    name is checked by runtime/supported.py."""
    for path in (PACKAGE / "config").rglob("*.py"):
        assert not any(n == "torch" or n.startswith("torch.") for n in imports_of(path)), path.name


# torch.distributed calls that pickle what they send and unpickle what they receive
PICKLING_COLLECTIVES = {"send_object_list", "recv_object_list", "broadcast_object_list", "all_gather_object",
                        "gather_object", "scatter_object_list"}


def test_nothing_that_crosses_the_network_is_unpickled():
    """Exposure: stores hold JSON, process groups carry tensors, and pipeline stages
    get static shapes (runtime.generation Note: [static stage shapes]); no module unpickles what
    a peer sent. DCP's metadata file (a pickle torch writes, read back from the checkpoint
    directory by the job itself) and `torch.load(..., weights_only=True)` are local files."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            owner = getattr(node.func.value, "id", "") if isinstance(node.func, ast.Attribute) else ""
            if name in PICKLING_COLLECTIVES or (owner == "pickle" and name in {"load", "loads"}):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}")
            if name == "load" and owner == "torch" and not any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} torch.load without weights_only=True")
    assert not found, found
