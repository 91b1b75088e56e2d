"""Discrete-event simulation of torch's Schedule1F1B, to check the cost model against.

Each stage runs the actions of torch's `Schedule1F1B._step_microbatches` in its order: stage k
of S warms up with min(M, S - k) forwards, then alternates one backward and one forward, then
drains the backwards; around each compute it posts a batch of sends and receives and waits for
it, as torch does (a forward's send is fused with the next backward's receive, a backward's
send with the next forward's receive, and the warm-up and drain sends are waited one step
later). A message is a rendezvous, as on gloo (and NCCL beyond its small eager sizes): it
completes `send_ms` after both its sender and its receiver have posted it. A stage waiting on
a batch resumes when all its messages are complete. The result is the exact makespan of that
schedule under those rules.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["one_f_one_b_actions", "one_f_one_b_order", "simulate_1f1b"]

Message = tuple[str, int, int]
"""("act" | "grad", boundary k (between stages k and k + 1), microbatch)."""


def one_f_one_b_actions(stage: int, num_stages: int, microbatches: int) -> list[tuple]:
    """torch's Schedule1F1B on `stage`, as ("post", messages), ("wait", messages) and
    ("F" | "B", microbatch) actions; each message is (kind, boundary, microbatch)."""
    k, last = stage, num_stages - 1

    def fwd_recv(i): return [("act", k - 1, i)] if k > 0 else []
    def fwd_send(i): return [("act", k, i)] if k < last else []
    def bwd_recv(j): return [("grad", k, j)] if k < last else []
    def bwd_send(j): return [("grad", k - 1, j)] if k > 0 else []

    actions: list[tuple] = []

    def exchange(messages):
        if messages:
            actions.extend([("post", messages), ("wait", messages)])

    warmup = min(microbatches, num_stages - k)
    forward = backward = 0
    send_work: list[Message] = []
    fwd_sends: list[Message] = []
    for _ in range(warmup):
        exchange(fwd_recv(forward))
        actions.append(("F", forward))
        if send_work:
            actions.append(("wait", send_work))
        send_work = []
        fwd_sends = fwd_send(forward)
        if forward != warmup - 1 and fwd_sends:
            actions.append(("post", fwd_sends))
            send_work = fwd_sends
        forward += 1
    while True:
        exchange(fwd_sends + bwd_recv(backward))
        actions.append(("B", backward))
        bwd_sends = bwd_send(backward)
        backward += 1
        if forward == microbatches:
            break
        exchange(bwd_sends + fwd_recv(forward))
        actions.append(("F", forward))
        fwd_sends = fwd_send(forward)
        forward += 1
    send_work = bwd_sends
    if send_work:
        actions.append(("post", send_work))
    while backward < microbatches:
        exchange(bwd_recv(backward))
        actions.append(("B", backward))
        if send_work:
            actions.append(("wait", send_work))
        send_work = bwd_send(backward)
        if send_work:
            actions.append(("post", send_work))
        backward += 1
    if send_work:
        actions.append(("wait", send_work))
    return actions


def one_f_one_b_order(stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """("F" | "B", microbatch) in the order torch's Schedule1F1B runs them on `stage`."""
    return [a for a in one_f_one_b_actions(stage, num_stages, microbatches) if a[0] in ("F", "B")]


def simulate_1f1b(forward_ms: Sequence[float], backward_ms: Sequence[float],
                  send_ms: Sequence[float], microbatches: int) -> float:
    """Makespan of one 1F1B iteration (ms); send_ms[k]: one message across boundary k."""
    num_stages = len(forward_ms)
    actions = [one_f_one_b_actions(k, num_stages, microbatches) for k in range(num_stages)]
    posted: dict[Message, list[float]] = {}
    clock = [0.0] * num_stages
    position = [0] * num_stages
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for k in range(num_stages):
            while position[k] < len(actions[k]):
                kind, arg = actions[k][position[k]]
                if kind == "post":
                    for message in arg:
                        posted.setdefault(message, []).append(clock[k])
                elif kind == "wait":
                    if any(len(posted.get(m, ())) < 2 for m in arg):
                        break
                    clock[k] = max(clock[k], *(max(posted[m]) + send_ms[m[1]] for m in arg))
                else:
                    clock[k] += forward_ms[k] if kind == "F" else backward_ms[k]
                position[k] += 1
                remaining -= 1
                progressed = True
        assert progressed, "1F1B actions deadlocked: the simulated order is inconsistent"
    return max(clock)
