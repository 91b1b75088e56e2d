"""The run's protocol on the membership store: the only package that knows its keys (keys.py's
table) and calls. Each audience has its side: a worker's (`WorkerSide`: the job, generations,
the step transaction, the roll call, joiners), its checkpoints' (`CheckpointSide`), an agent's
(`AgentSide`: registration, the run's beginning and end), the launcher's (`LauncherSide`);
`Side` is what they all read, `Liveness` whether a node is alive. Every wait goes through
`wait_until`. Values are elastic/records.py's.
"""

from oobleck_elastic.elastic.protocol.agent_side import AgentSide
from oobleck_elastic.elastic.protocol.checkpoint_side import CheckpointSide
from oobleck_elastic.elastic.protocol.keys import RECORDS, key
from oobleck_elastic.elastic.protocol.launcher_side import LauncherSide
from oobleck_elastic.elastic.protocol.liveness import Liveness
from oobleck_elastic.elastic.protocol.side import Side
from oobleck_elastic.elastic.protocol.waits import Clocks, WaitTimeout, wait_until
from oobleck_elastic.elastic.protocol.worker_side import Fenced, StepAborted, WorkerSide

__all__ = ["AgentSide", "CheckpointSide", "Clocks", "Fenced", "LauncherSide", "Liveness", "RECORDS", "Side",
           "StepAborted", "WaitTimeout", "WorkerSide", "key", "wait_until"]
