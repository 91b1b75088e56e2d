"""A step that keeps failing with every node alive is a bug, not a node failure: after a few
replays the run ends with the whole error, not only its first line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oobleck_elastic.config import load_config
from oobleck_elastic.elastic.worker import MAX_REPLAYS_WITHOUT_LOSS, run_worker
from oobleck_elastic.errors import OobleckError
from oobleck_elastic.models.sequential import sequential_model


class BreaksOnStep2(nn.Module):
    """Raises a two-line RuntimeError (a shape bug, say) on the samples of step 2 (8..11: the
    first input column is the sample's index), however often the step is replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(((x[:, 0] >= 8) & (x[:, 0] < 12)).any()):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\nthe detail on the second line")
        return self.fc(x)


class Data:
    def __len__(self) -> int:
        return 16

    def batch(self, indices):
        x = torch.zeros(len(indices), 4)
        x[:, 0] = torch.tensor(indices, dtype=torch.float32)
        return x, torch.ones(len(indices), 4)


def test_a_step_that_fails_with_every_node_alive_ends_the_run_with_the_whole_error(tmp_path):
    spec = sequential_model([BreaksOnStep2()], loss=nn.functional.mse_loss,
                            sample_batch=lambda b: (torch.zeros(b, 4), torch.zeros(b, 4)))
    cfg = load_config(None, ["train.global_batch_size=4", "train.microbatch_size=2", "train.steps=5",
                             "data.shuffle=false", f"monitoring.metrics_path={tmp_path / 'm.jsonl'}",
                             f"monitoring.tensorboard_dir={tmp_path / 'tb'}", f"checkpoint.dir={tmp_path / 'ck'}",
                             f"planner.profile_dir={tmp_path / 'profiles'}", "planner.profile_iterations=1"])
    with pytest.raises(OobleckError) as info:
        run_worker(spec, Data(), cfg)
    text = str(info.value)
    assert f"step 2 failed {MAX_REPLAYS_WITHOUT_LOSS + 1} times with every node alive" in text
    assert "the detail on the second line" in text and "Traceback" in text, text
