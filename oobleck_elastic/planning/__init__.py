"""Pure-Python planning: profiles, the cost model, templates, instantiation, reconfiguration.

Imports no torch and starts no processes, so every worker can compute the same plan and dry
runs work anywhere.
"""

from oobleck_elastic.planning.cost import Cluster, iteration_ms
from oobleck_elastic.planning.instantiate import (
    Instantiation,
    PipelinePlan,
    build_instantiation,
    check_instantiation,
    fresh_layout,
    instantiate,
    split_batch,
)
from oobleck_elastic.planning.profile import LayerProfile, ModelProfile, synthetic_gpt
from oobleck_elastic.planning.reconfigure import (
    ReconfigurationPlan,
    Transfer,
    WorkerRef,
    layer_holders,
    plan_transfers,
    reconfigure,
)
from oobleck_elastic.planning.simulate import simulate_1f1b
from oobleck_elastic.planning.templates import (
    PipelineTemplate,
    StagePlan,
    TemplateSet,
    plan_template,
    plan_templates,
    template_from_bounds,
)
from oobleck_elastic.planning.values import dumps, from_jsonable, loads, to_jsonable

__all__ = [
    "Cluster", "Instantiation", "LayerProfile", "ModelProfile", "PipelinePlan", "PipelineTemplate",
    "ReconfigurationPlan", "StagePlan", "TemplateSet", "Transfer", "WorkerRef", "build_instantiation",
    "check_instantiation", "dumps", "fresh_layout", "from_jsonable", "instantiate", "iteration_ms",
    "layer_holders", "loads", "plan_template", "plan_templates", "plan_transfers", "reconfigure", "simulate_1f1b",
    "split_batch", "synthetic_gpt", "template_from_bounds", "to_jsonable",
]
