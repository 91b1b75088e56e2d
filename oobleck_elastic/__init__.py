"""oobleck_elastic: pipeline-parallel training that survives node failures without restarts.

User-facing entry points:
    python -m oobleck_elastic.launch   torchrun's flags plus --oobleck-*, the oobleck agent
    python -m oobleck_elastic.plan     dry-run the planner
    python -m oobleck_elastic.simulate replay a failure trace at any scale, beside the baselines
    python -m oobleck_elastic.train    train the job's model (model.hf / model.factory) on its data
    python -m oobleck_elastic.export   the latest checkpoint in the model's own format
    python -m oobleck_elastic.data.prepare   tokenize text into a token file
    oobleck_elastic.models.hf_model / sequential_model               Hugging Face and torch models
    oobleck_elastic.elastic.worker.run_worker(model, dataset, cfg)   in a training script
    oobleck_elastic.runtime.model.ModelSpec / LayerSpec               the model interface
Importing the package itself loads neither torch nor any process group.
"""

from oobleck_elastic.config import JobConfig, load_config
from oobleck_elastic.errors import ConfigError, LayersLostError, OobleckError, PlanningError

__all__ = ["JobConfig", "load_config", "OobleckError", "ConfigError", "PlanningError", "LayersLostError"]
