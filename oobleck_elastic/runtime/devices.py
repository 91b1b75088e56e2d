"""Where a worker computes and how its process groups talk: the device of train.device, the
process-group backend for it, and the teardown of a generation's groups on that backend.

Note: [devices]
    On the CPU every tensor crosses gloo, as before. On CUDA each worker uses
    cuda:LOCAL_RANK and a generation's groups are created with the backend
    "cpu:gloo,cuda:nccl": CUDA tensors (pipeline sends, gradient all-reduces, layer-state
    transfers) go device to device on NCCL, CPU tensors (the step's statistics, the layer
    summaries) on gloo. A dead NCCL peer does not close a socket the way a gloo peer does:
    the survivors' kernels wait until the collective timeout (elastic.collective_timeout_s,
    given to every group). Two settings, both made here before the first group (a value the
    user set is kept), turn that into an error in the worker within the timeout:
    TORCH_NCCL_BLOCKING_WAIT=1 makes every wait() on an NCCL operation (the schedule's sends
    and receives, the gradient all-reduces, the transfers) block the worker until the
    operation is done or its group's timeout has passed, and then raise; without it wait()
    returns at once, the worker blocks later in a CUDA sync of its own, for as long as the
    watchdog takes, and an aborted all-reduce leaves partial sums behind no error, which a
    commit could apply. TORCH_NCCL_ASYNC_ERROR_HANDLING=2 ("clean up only") lets the
    watchdog abort the failed communicator without killing the process (torch's default, 3,
    kills it, and 1 aborts and kills; a survivor must live on to rebuild). Destroying a group
    whose communicator is stuck would wait on it, so a generation on CUDA aborts its
    communicators instead (`abort_groups`) and never waits on the old generation; an abort
    that fails or hangs ends the worker. Every communicator is created while the generation
    is built (eagerly, `device_id` given to init_process_group, then a warm-up in one global
    order: runtime/communicators.py), non-blocking with the collective timeout as its bound
    (TORCH_NCCL_USE_COMM_NONBLOCKING, TORCH_NCCL_NONBLOCKING_TIMEOUT), and after a teardown
    the allocator's cache is emptied so the next generation's NCCL buffers find memory.

    The CUDA path is written but unverified: this project's machines had no GPU (docs/gpus.md:
    Precision and devices).
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.distributed as dist

from oobleck_elastic.errors import ConfigError

__all__ = ["ABORT_FAILED_EXIT", "ABORT_TIMEOUT_S", "resolve_device", "backend_for", "prepare_backend", "abort_groups"]

ABORT_TIMEOUT_S = 30.0  # an abort that takes longer is taken as failed
ABORT_FAILED_EXIT = 86  # this worker's exit status when its communicators could not be aborted

logger = logging.getLogger(__name__)


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """train.device -> this worker's device: cuda:LOCAL_RANK for cuda (and for auto when CUDA
    is available), else the CPU."""
    if setting not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got {setting!r}")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device is cuda but torch sees no CUDA device "
                           f"(torch {torch.__version__}); use train.device=auto or cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"worker with LOCAL_RANK {local_rank} needs cuda:{local_rank} but this machine has "
                           f"{count} GPU(s); start at most {count} workers per node (--nproc-per-node)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """The process-group backend of a generation on `device` (Note: [devices])."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def prepare_backend(device: torch.device, timeout_s: float = 600.0) -> None:
    """Makes NCCL waits blocking and its async error handling "clean up only" before the first
    NCCL communicator exists, so an operation that outlives its group's timeout raises in the
    worker, which lives on (Note: [devices]); communicators are created non-blocking, so a
    creation fails after `timeout_s` (the collective timeout) instead of waiting for ever on a
    dead peer. A value the user set is kept."""
    if device.type == "cuda":
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        # creating a communicator must not wait for ever on a peer that died meanwhile
        os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(max(timeout_s, 1))))


def abort_groups(device: torch.device) -> None:
    """Aborts every communicator of the current default group and its subgroups (CUDA), never
    waiting on a peer that may be dead; an abort that fails or takes over ABORT_TIMEOUT_S ends
    this process (exit status ABORT_FAILED_EXIT): a destroy instead would wait on every
    outstanding kernel. On the CPU nothing is needed (gloo's sockets close when the groups are
    destroyed)."""
    if device.type != "cuda" or not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:  # an older torch: destroy_process_group below still runs
        logger.warning("torch %s has no _abort_process_group; NCCL communicators are destroyed, not aborted",
                       torch.__version__)
        return
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            abort()  # the default group and every subgroup; afterwards no group is initialised
        except BaseException as exc:  # noqa: BLE001 - reported below, from the caller's thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="oobleck-nccl-abort", daemon=True).start()
    if not done.wait(ABORT_TIMEOUT_S) or failure:
        # a destroy would wait on every outstanding kernel, a dead peer's included: this worker
        # ends instead, and its node is lost like any other
        why = f"failed: {failure[0]}" if failure else f"did not return within {ABORT_TIMEOUT_S:.0f} s"
        logger.error("aborting the generation's NCCL communicators %s; this worker exits", why)
        logging.shutdown()
        os._exit(ABORT_FAILED_EXIT)
