"""A step's error that is this worker's own device, not a peer (elastic/run.py device_error):
out of memory fails the run with one line naming planner.memory_per_worker, instead of being
replayed as a peer's failure until the run gives up; a CUDA error ends the worker; anything
else (gloo's errors when a peer dies) is still a peer's failure."""

from __future__ import annotations

import torch

from oobleck_elastic.config import load_config
from oobleck_elastic.elastic.step_errors import DeviceFailed, device_error
from oobleck_elastic.errors import RunFailed


def test_out_of_memory_fails_the_run_naming_the_memory_setting():
    cfg = load_config(None, ["planner.memory_per_worker=2GB"])
    error = device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"), cfg, 7)
    assert isinstance(error, RunFailed)
    message = str(error)
    assert "\n" not in message and "step 7" in message and "Tried to allocate 2.00 GiB" in message
    assert f"planner.memory_per_worker={cfg.planner.memory_per_worker}" in message


def test_a_cuda_error_ends_the_worker_and_a_peers_failure_is_recovered():
    cfg = load_config(None, [])
    assert isinstance(device_error(torch.AcceleratorError("CUDA error: an illegal memory access"), cfg, 3),
                      DeviceFailed)
    assert device_error(RuntimeError("[gloo] Connection closed by peer"), cfg, 3) is None
