"""Shared fixtures, and the tiers: each folder under tests/ is one tier (docs/testing.md, "Tiers").

unit       no process, no socket, no process group, no store: seconds
store      a real store in this process (the embedded TCPStore, or an etcd server used as a store)
multiproc  gloo process groups and spawned ranks, without the launcher
jobs       whole local jobs: the launcher, torchrun, training scripts and their CLIs
gpu        CUDA (skipped, with the reason, where torch sees no GPU)

Helpers the tests import by name (`from jobs import ...`) live in tests/helpers/, put on the
path here, before anything imports them.
"""

from __future__ import annotations

import pathlib
import random
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "helpers"))

from etcd_server import etcd_server, make_tls  # noqa: E402
from jobs import failure_free, failure_free_40, warm_node_starter  # noqa: E402,F401 (fixtures: the references, the warm starter)

SLOW_TIERS = ("multiproc", "jobs", "gpu")  # what the `slow` marker means: processes are started
# Each test's budget, per tier (a hang guard, and what keeps the suite from creeping back: the
# longest job test takes ~45 s on 2 cores); gpu keeps pyproject's 300 s (never measured).
BUDGET_S = {"unit": 60, "store": 60, "multiproc": 120, "jobs": 150}


def tier(item: pytest.Item) -> str | None:
    """The tier folder a test lives in (None outside tests/<tier>/)."""
    try:
        return item.path.relative_to(TESTS).parts[0]
    except ValueError:
        return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        where = tier(item)
        if where in BUDGET_S:
            # appended: a test's own @pytest.mark.timeout, if it has one, still wins
            item.add_marker(pytest.mark.timeout(BUDGET_S[where]), append=True)
        if where in SLOW_TIERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


@pytest.fixture(scope="module")
def etcd_port():
    """A real etcd server (v2 API on), one per test module that asks for it."""
    with etcd_server() as port:
        yield port


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A throwaway CA and the server and client certificates it signed, one per module."""
    return make_tls(str(tmp_path_factory.mktemp("tls")))


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """The CPU tiers run on the CPU even on a machine with GPUs: train.device defaults to auto
    (CUDA when available), so every test not marked `gpu` hides the GPUs from the processes
    it starts (they inherit the environment). Tests marked `gpu` see them."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
