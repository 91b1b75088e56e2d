"""Layer-state transfer (runtime/transfer.py Note: [transfer wire format]) on real gloo
processes: large tensors sent and received in place, small ones through flat buffers, every
replica bit-identical to its source (an optimizer primed on meta:
tests/unit/test_transfer_unit.py)."""

from __future__ import annotations

import datetime

import torch
from runtime_harness import free_port, spawn_ranks

from examples.gpt.model import GPTConfig, gpt_model
from oobleck_elastic.config import load_config
from oobleck_elastic.planning import Transfer, WorkerRef
from oobleck_elastic.runtime import transfer
from oobleck_elastic.runtime.layers import LayerStore

# d_model 256: a block's weights (256 x 768 ...) go as messages of their own, its norms and
# biases through a flat buffer; the embedding (vocab 64) is all small tensors.
WIDE = GPTConfig(vocab_size=64, seq_len=8, d_model=256, n_heads=4, n_layers=2)


class RankOfNode:
    def rank_of(self, worker) -> int:
        return worker.node


def _transfer_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        layers = LayerStore(gpt_model(WIDE), load_config(None, ["train.optimizer.name=AdamW"]).train,
                            torch.device("cpu"))
        moving = [0, 1, 2]
        if rank == 0:
            torch.manual_seed(1)
            for i in moving:
                state = layers.materialize(i)
                for p in state.params:
                    p.grad = torch.randn_like(p)
                state.optimizer.step()
                state.zero_grad()
        transfers = [Transfer(layer=i, src=WorkerRef(0, 0), dst=WorkerRef(1, 0), bytes=0) for i in moving]
        moved = transfer.run_transfers(transfers, RankOfNode(), WorkerRef(rank, 0), layers, stepped=True,
                                       timeout=datetime.timedelta(seconds=60))
        held = [t.detach() for i in moving for t in layers[i].state_tensors()]
        direct = sum(d for i in moving for d, _ in transfer._messages(layers[i].state_tensors()))
        flat = torch.cat([t.reshape(-1).double() for t in held])
        theirs = flat.clone()
        dist.broadcast(theirs, 0)
        queue.put((rank, moved, direct, bool(torch.equal(flat, theirs)), int(flat.numel())))
        dist.destroy_process_group()
    except BaseException as exc:  # surfaced by the test, not lost in a child
        queue.put((rank, repr(exc)))


def test_layers_arrive_bit_identical_with_large_tensors_in_place_and_small_ones_flattened():
    results = {r[0]: r[1:] for r in spawn_ranks(_transfer_worker, 2, free_port())}
    assert all(len(r) == 4 for r in results.values()), results
    (sent, direct, _, numel), (received, direct_here, equal, _) = results[0], results[1]
    assert equal, "a received replica differs from its source"
    assert sent == received > 0
    assert direct == direct_here >= 8, "the block's large weights and their AdamW state should go in place"
    assert received == 4 * numel, "every float32 of the layers (weights, AdamW state, steps), once"
