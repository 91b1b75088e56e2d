"""An optimizer primed on meta holds the state a real first step makes (runtime/layers.py Note:
[priming on meta]), for each optimizer a transferred layer may carry (the transfers themselves:
tests/multiproc/test_transfer.py)."""

from __future__ import annotations

import pytest
import torch

from oobleck_elastic.config import load_config
from oobleck_elastic.runtime.layers import LayerState


@pytest.mark.parametrize("name", ["AdamW", "SGD", "RMSprop", "NAdam", "Adagrad", "ASGD"])
def test_an_optimizer_primed_on_meta_holds_what_a_real_first_step_makes(name):
    extra = ["train.optimizer.momentum=0.9"] if name == "SGD" else []
    train = load_config(None, [f"train.optimizer.name={name}", *extra]).train
    primed = LayerState(torch.nn.Linear(8, 4), train)
    primed.prime_optimizer()  # ASGD reads .item() in its step: it falls back to a real step
    stepped = LayerState(torch.nn.Linear(8, 4), train)
    for p in stepped.params:
        p.grad = torch.zeros_like(p)
    stepped.optimizer.step()

    def layout(state):
        return [(k, tuple(v.shape), v.dtype, v.device) if torch.is_tensor(v) else (k, v)
                for p in state.params for k, v in sorted(state.optimizer.state[p].items())]
    assert layout(primed) == layout(stepped)
    assert [p.grad for p in primed.params] == [None, None]
