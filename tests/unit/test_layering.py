"""Imports flow one way: config <- planning <- runtime <- elastic; monitoring beside them;
data (datasets) and models (adapters onto runtime.model) beside the runtime; testing (fault
injection) low, built by elastic and only called by the runtime through the hook it is given;
launcher (what the launch CLI runs: a node, a local job) on top, imported by no layer."""

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
    """Issue 14, exposure: stores hold JSON, process groups carry tensors, and pipeline stages
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
