"""From a job configuration and a profile to the job's templates and first instantiation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oobleck_elastic.config import PlannerConfig
from oobleck_elastic.errors import PlanningError
from oobleck_elastic.planning.cost import Cluster
from oobleck_elastic.planning.instantiate import Instantiation, instantiate
from oobleck_elastic.planning.profile import ModelProfile
from oobleck_elastic.planning.templates import TemplateSet, plan_templates

__all__ = ["JobPlan", "make_cluster", "plan_job"]


@dataclass(frozen=True, kw_only=True)
class JobPlan:
    templates: TemplateSet
    instantiation: Instantiation


GPU_HEADROOM_BYTES = 2 * 2**30
"""What a GPU keeps beyond the plan's tensors (at least this, or a tenth of its memory): the CUDA
context, NCCL's buffers for every communicator of a generation, cuBLAS workspaces and the
caching allocator's fragmentation. A plan that budgets the whole GPU runs out of memory near
capacity, often inside NCCL's communicator set-up."""


def make_cluster(planner: PlannerConfig, profile: ModelProfile, workers_per_node: int,
                 memory_per_worker: int | None = None) -> Cluster:
    """The Cluster a job plans for. The per-worker memory budget is, in order: the argument, the
    config's planner.memory_per_worker, the profiled device's memory (on the CPU the host's RAM
    shared by the node's workers; a GPU's own less GPU_HEADROOM)."""
    memory = memory_per_worker or planner.memory_per_worker
    if not memory and profile.device_memory_bytes:
        total = profile.device_memory_bytes
        if profile.device == "cpu":
            memory = total // workers_per_node
        elif profile.device.startswith("cuda"):
            memory = total - max(GPU_HEADROOM_BYTES, total // 10)
        else:
            memory = total
    if not memory:
        raise PlanningError("the profile does not say how much memory a worker has; set "
                            "planner.memory_per_worker (e.g. --set planner.memory_per_worker=16GiB)")
    return Cluster(workers_per_node=workers_per_node, memory_per_worker=int(memory),
                   intra_node_bandwidth=planner.intra_node_bandwidth,
                   inter_node_bandwidth=planner.inter_node_bandwidth,
                   link_latency_us=planner.link_latency_us)


def plan_job(profile: ModelProfile, cluster: Cluster, *, nodes: Sequence[int], fault_tolerance: int,
             global_batch: int, microbatch_size: int, wide: bool = False,
             virtual_stages: int = 1) -> JobPlan:
    """Templates for len(nodes) nodes and the fastest instantiation on them."""
    if profile.microbatch_size != microbatch_size:
        raise PlanningError(f"the profile was measured with microbatch size {profile.microbatch_size}, "
                            f"the job uses {microbatch_size}; profile again with the job's size")
    templates = plan_templates(profile, cluster, max_nodes=len(nodes), fault_tolerance=fault_tolerance,
                               total_microbatches=global_batch // microbatch_size, wide=wide,
                               virtual_stages=virtual_stages)
    inst = instantiate(templates, nodes, global_batch, microbatch_size)
    return JobPlan(templates=templates, instantiation=inst)
