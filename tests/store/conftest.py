"""The store tier's shared fixture: the rendezvous, run in the test process, sets the agent's
environment for its workers (OOBLECK_STORE, OOBLECK_RUN_ID, ...); each test gets the process's
environment back as it was, so no later test takes itself for a worker of that run."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def environment_restored():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
