"""Checkpoints: what a stopped job resumes from, the fallback when more nodes fail than the
replicas cover, and the final state. identity.py: what a checkpoint belongs to; layout.py: where
it lives on disk (Note: [checkpoint format]); writer.py and background_writer.py: writing and
publishing it; manifest.py: which one to load (Note: [checkpoint manifest], Note: [newest
checkpoint]); restore.py and dcp_reader.py: loading it."""

import warnings

from oobleck_elastic.runtime.checkpoint.background_writer import BackgroundWriter
from oobleck_elastic.runtime.checkpoint.identity import (
    CheckpointId,
    CheckpointUnreadable,
    checkpoint_id,
    job_digest,
    job_key,
    plain,
)
from oobleck_elastic.runtime.checkpoint.layout import remove_partials
from oobleck_elastic.runtime.checkpoint.manifest import (
    check_dir,
    checkpoints,
    find_resume,
    identity,
    latest_checkpoint,
    published,
    read_manifest,
)
from oobleck_elastic.runtime.checkpoint.restore import load_model_state, restore_layers
from oobleck_elastic.runtime.checkpoint.writer import host_copy, mark_complete, save_layers

__all__ = ["CheckpointId", "CheckpointUnreadable", "checkpoint_id", "job_key", "job_digest", "plain", "save_layers",
           "mark_complete", "checkpoints", "latest_checkpoint", "published", "identity", "check_dir", "find_resume",
           "remove_partials", "read_manifest", "load_model_state", "restore_layers", "host_copy", "BackgroundWriter"]


# Each layer's owner saves and loads alone (no_dist): DCP says it assumes so, at every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
