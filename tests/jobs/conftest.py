"""Fixtures this tier's tests take by name: the data.prepare inputs (tests/helpers/hf_fixtures.py,
on the path from tests/conftest.py; a test module that imported them itself would shadow the
import with the argument of the same name), and the tier's warm node starter."""

import os
import shutil
import subprocess
import tempfile

import pytest
from hf_fixtures import texts, tokenizer_dir

from oobleck_elastic.elastic.protocol.waits import wait_until
from oobleck_elastic.launcher import warm_starter

__all__ = ["texts", "tokenizer_dir", "warm_node_starter"]


@pytest.fixture(autouse=True)
def _warm_jobs(warm_node_starter, monkeypatch):
    """Every local job of this tier gets its node starter from the tier's warm starter; a test
    that wants the cold path removes OOBLECK_NODE_STARTER from its job's environment
    (tests/jobs/test_launcher.py does). Tests of other tiers do not see it."""
    monkeypatch.setenv(warm_starter.ENV_VAR, warm_node_starter)


@pytest.fixture(scope="session")
def warm_node_starter():
    """The path of one warm starter (launcher/warm_starter.py) for the session: it imports
    torch once, not once per job."""
    folder = tempfile.mkdtemp(prefix="oobleck-starter-")  # a short path: a socket's is at most 107 bytes
    path = os.path.join(folder, "node-starter.sock")
    proc = subprocess.Popen(warm_starter.command(path), stdin=subprocess.DEVNULL)
    try:
        wait_until("the warm node starter to listen", lambda: os.path.exists(path) or proc.poll() is not None,
                   timeout=120, poll_s=0.05)
        assert proc.poll() is None, f"the warm node starter exited with {proc.returncode}"
        yield path
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)
