"""What the package relies on in torch that torch does not promise: each private name or
behaviour it touches, one test each, so an upgrade of torch that moves one fails here first,
by name, instead of somewhere in a job.

  torch.distributed.elastic.rendezvous.utils._parse_rendezvous_config    launcher/node.py, local_job.py
  torch.distributed.elastic.rendezvous.utils._matches_machine_hostname    elastic/rendezvous.py
  torch.distributed.distributed_c10d._world.group_count                   runtime/generation.py
  PipelineStage.backward_maybe_with_nosync(backward_type, kwargs, last_backward)  runtime/generation.py
  torch.serialization._get_layout, torch.distributed.checkpoint's metadata classes
      (_MEM_FORMAT_ENCODING, _StorageInfo) in DCP's .metadata pickle     runtime/checkpoint/dcp_reader.py
  local_elastic_agent.start_processes, called by LocalElasticAgent._start_workers, and
      SubprocessContext's handlers (.proc, .close)                         elastic/agent.py,
                                                                           launcher/forked_workers.py
      (the workers it starts: tests/multiproc/test_forked_workers.py)
"""

from __future__ import annotations

import inspect

import torch


def test_parse_rendezvous_config_reads_torchruns_rdzv_conf():
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    assert _parse_rendezvous_config("store=etcd,heartbeat_interval=0.2") == {"store": "etcd",
                                                                              "heartbeat_interval": "0.2"}
    assert _parse_rendezvous_config("") == {}


def test_matches_machine_hostname_knows_this_machine():
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    assert _matches_machine_hostname("localhost") and _matches_machine_hostname("127.0.0.1")
    assert not _matches_machine_hostname("198.18.0.250")


def test_group_count_is_the_counter_new_groups_are_named_by():
    from torch.distributed import distributed_c10d

    assert isinstance(distributed_c10d._world.group_count, int)
    assert "group_count" in inspect.getsource(distributed_c10d._process_group_name)


def test_pipeline_stage_backward_hook_has_the_overridden_signature():
    from torch.distributed.pipelining import PipelineStage

    params = inspect.signature(PipelineStage.backward_maybe_with_nosync).parameters
    assert list(params)[:4] == ["self", "backward_type", "bwd_kwargs", "last_backward"]
    # the schedules call it through the stage, once per backward, with last_backward on the last
    from torch.distributed.pipelining import stage

    assert "last_backward=" in inspect.getsource(stage._PipelineStageBase.backward_one_chunk)


def test_dcp_metadata_pickle_names_what_the_safe_reader_allows():
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    assert torch.serialization._get_layout("torch.strided") is torch.strided
    assert {e.name for e in _MEM_FORMAT_ENCODING} >= {"TORCH_CONTIGUOUS_FORMAT"}
    assert {f for f in _StorageInfo.__dataclass_fields__} >= {"relative_path", "offset", "length"}


def test_the_agent_starts_workers_through_its_modules_start_processes():
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    assert callable(local_elastic_agent.start_processes)
    assert "start_processes(" in inspect.getsource(local_elastic_agent.LocalElasticAgent._start_workers)
    close = inspect.getsource(SubprocessContext._close)
    assert "handler.proc.poll()" in close and "handler.close(" in close and "handler.proc.wait(" in close
    assert "self.subprocess_handlers" in inspect.getsource(SubprocessContext.pids)
