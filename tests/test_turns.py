"""The micro-batches' turns (fast.Turns): under every order the device could run the parts' streams
in, the step completes and the parts compute one at a time; the two kernels do what they say. (On a
GPU a step in turns gives the eager step's logits and moves: test_offload.py's micro-batches test.)"""

import random

import pytest
import torch

import fast
import offload_kernels


def run_step(turns, n, L, rng):
    """One step of n parts over L layers, its operations run in a random order among those ready:
    part p's stream issues its gather of layer i (on the PCIe stream, in recording order: layer by
    layer, part by part), signals, waits for the gather, waits its turn, computes (attention, MLP,
    the next layer's selection). -> the compute intervals {(p, i): (start, end)} in ticks, or None
    if the step deadlocks."""
    count, done_gathers, t = [0] * n, set(), 0
    stream = [
        [(op, i) for i in range(L) for op in ("issue", "gather?", "turn?", "start", "end")]
        for _ in range(n)
    ]
    pcie = [(p, i) for i in range(L) for p in range(n)]
    issued, span = set(), {}
    while any(stream) or pcie:
        ready = []
        if pcie and pcie[0] in issued:
            ready.append("pcie")
        for p in range(n):
            if not stream[p]:
                continue
            op, i = stream[p][0]
            w = turns.after(p, i) if turns else None
            if (op == "gather?" and (p, i) not in done_gathers) or (
                op == "turn?" and w and count[w[0]] < w[1]
            ):
                continue
            ready.append(p)
        if not ready:
            return None
        who, t = rng.choice(ready), t + 1
        if who == "pcie":
            done_gathers.add(pcie.pop(0))
            continue
        op, i = stream[who].pop(0)
        if op == "issue":
            issued.add((who, i))
            count[who] = i + 1  # Turns.issued: right after the gather's launch
        elif op in ("start", "end"):
            span.setdefault((who, i), [0, 0])[op == "end"] = t
    return span


@pytest.mark.parametrize("n, L", [(2, 1), (2, 2), (2, 5), (3, 4)])
def test_turns_never_deadlock_and_computes_never_overlap(n, L):
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on CPU
    turns = fast.Turns(n, L, dev)  # here its schedule only
    rng, overlapped_without = random.Random(0), False
    for _ in range(300):
        span = run_step(turns, n, L, rng)
        assert span is not None, "deadlock"
        order = sorted(span, key=lambda pi: span[pi][0])
        free = [(p, i) for p, i in order if p == 0 or i < L - 1]  # after part 0's last: no waits
        assert free == [(p, i) for i in range(L) for p in range(n) if p == 0 or i < L - 1]
        for a, b in zip(free, free[1:]):
            assert span[a][1] < span[b][0], f"{a} and {b} computed at once"
        loose = run_step(None, n, L, rng)  # the same step without turns does overlap sometimes
        overlapped_without |= any(
            loose[a][0] < loose[b][1] and loose[b][0] < loose[a][1]
            for a in loose
            for b in loose
            if a[0] < b[0]
        )
    assert overlapped_without


def test_turn_kernels():
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter on CPU
    count = torch.tensor([0, 5, 2], dtype=torch.int32, device=dev)
    offload_kernels.turn_issued(count, 0, 3)
    assert count.tolist() == [3, 5, 2]
    offload_kernels.turn_wait(count, 1, 5)  # already there: returns at once
    offload_kernels.turn_wait(count, 2, 7, polls=4)  # never comes: gives up after its polls
    assert count.tolist() == [3, 5, 2]
