"""Imports flow one way: config <- planning <- runtime <- elastic; monitoring beside them;
data (datasets) and models (adapters onto runtime.model) beside the runtime; testing (fault
injection) low, built by elastic and only called by the runtime through the hook it is given;
launcher (what the launch CLI runs: a node, a local job) on top, imported by no layer."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "oobleck_elastic"
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


def test_config_never_imports_torch():
    """Parsing a job needs no torch (the plan CLI, tools reading a job file); the optimizer's
    name is checked by runtime/supported.py."""
    for path in (PACKAGE / "config").rglob("*.py"):
        assert not any(n == "torch" or n.startswith("torch.") for n in imports_of(path)), path.name
