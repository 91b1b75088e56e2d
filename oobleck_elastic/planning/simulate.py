"""Discrete-event simulation of torch's Schedule1F1B, to check the cost model against.

Each stage runs its operations in the order torch's `Schedule1F1B._step_microbatches` does
(stage k of S warms up with min(M, S - k) forwards, then alternates one backward and one
forward, then drains the backwards). An operation starts when its stage is free and its input
has arrived: a forward needs the previous stage's forward of the same microbatch plus one
transfer; a backward needs the next stage's backward plus one transfer. Transfers overlap
compute (the cost model's assumption). The result is the exact makespan of that schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["one_f_one_b_order", "simulate_1f1b"]


def one_f_one_b_order(stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """("F" | "B", microbatch) in the order torch's Schedule1F1B runs them on `stage`."""
    warmup = min(microbatches, num_stages - stage)
    ops = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < microbatches:
        ops.append(("B", backward))
        backward += 1
        if forward < microbatches:
            ops.append(("F", forward))
            forward += 1
    return ops


def simulate_1f1b(forward_ms: Sequence[float], backward_ms: Sequence[float],
                  send_ms: Sequence[float], microbatches: int) -> float:
    """Makespan of one 1F1B iteration (ms)."""
    num_stages = len(forward_ms)
    orders = [one_f_one_b_order(k, num_stages, microbatches) for k in range(num_stages)]
    done_f: dict[tuple[int, int], float] = {}
    done_b: dict[tuple[int, int], float] = {}
    free = [0.0] * num_stages
    position = [0] * num_stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for k in range(num_stages):
            while position[k] < len(orders[k]):
                kind, i = orders[k][position[k]]
                if kind == "F":
                    if k > 0 and (k - 1, i) not in done_f:
                        break
                    ready = 0.0 if k == 0 else done_f[(k - 1, i)] + send_ms[k - 1]
                    start = max(free[k], ready)
                    done_f[(k, i)] = free[k] = start + forward_ms[k]
                else:
                    if k < num_stages - 1 and (k + 1, i) not in done_b:
                        break
                    ready = done_f[(k, i)] if k == num_stages - 1 else done_b[(k + 1, i)] + send_ms[k]
                    start = max(free[k], ready)
                    done_b[(k, i)] = free[k] = start + backward_ms[k]
                position[k] += 1
                remaining -= 1
                progressed = True
        assert progressed, "1F1B order deadlocked: the simulated order is inconsistent"
    return max(free)
