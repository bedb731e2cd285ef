"""A pipeline schedule's timeline from its action order: when each rank computes and when it idles.

Torch-free. The formula (p - 1) / (m v) is the bubble of an ideal schedule
(Megatron-LM's, m a multiple of p); a library's actual order can differ
(torch 2.13's interleaved 1F1B groups micro-batches in rounds of
m // p). Given each rank's actions in order (torch's `pipeline_order`, as
`(kind, stage, micro_batch)` with kind F, B (full backward), I (input
gradient) or W (weight gradient)) and how long each takes, this plays the
order out under the data dependencies:

    F(s, i) after F(s - 1, i);   B/I(s, i) after F(s, i) and B/I(s + 1, i);   W(s, i) after I(s, i)

and returns each rank's busy and idle time. A dependency on another stage's
action (an activation received, a gradient received) is ready `transfer_s`
after that action ends (0 by default: sends and receives taking no time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Action = tuple[str, int, int]  # (kind, stage, micro-batch)


@dataclass(frozen=True)
class Timeline:
    busy_s: list[float]  # per rank
    end_s: list[float]  # per rank: when its last action ends

    @property
    def makespan_s(self) -> float:
        return max(self.end_s)

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Idle over busy of one rank, or of the busiest rank (the one that sets the pace)."""
        if rank is None:
            rank = max(range(len(self.busy_s)), key=lambda r: self.busy_s[r])
        return (self.makespan_s - self.busy_s[rank]) / self.busy_s[rank]


def simulate(orders: Sequence[Sequence[Action]], duration_s: Callable[[Action], float], stages: int,
             transfer_s: float = 0.0) -> Timeline:
    """Play each rank's order out, a transfer taking `transfer_s` between stages; raises ValueError on an
    order that deadlocks."""
    done: dict[Action, float] = {}
    clock = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    position = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                action = order[position[rank]]
                ready = _ready_s(action, done, stages, transfer_s)
                if ready is None:
                    break
                start = max(clock[rank], ready)
                took = duration_s(action)
                clock[rank] = done[action] = start + took
                busy[rank] += took
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule's order deadlocks under its data dependencies")
    return Timeline(busy, clock)


def _ready_s(action: Action, done: dict[Action, float], stages: int, transfer_s: float = 0.0) -> float | None:
    """When the action's inputs are ready (another stage's output `transfer_s` after it ends), None while one
    is still to run."""
    kind, stage, mb = action
    if kind == "F":
        needs = [("F", stage - 1, mb)] if stage > 0 else []
    elif kind == "W":
        needs = [("I", stage, mb)]
    else:  # B or I: the stage's own forward, and the gradient from the stage after it
        needs = [("F", stage, mb)]
        if stage < stages - 1:
            needs.append(_backward_of(done, stage + 1, mb))
    times = []
    for need in needs:
        if need not in done:
            return None
        times.append(done[need] + (transfer_s if need[1] != stage else 0.0))
    return max(times, default=0.0)


def _backward_of(done: dict[Action, float], stage: int, mb: int) -> Action:
    """The next stage's input-gradient action: I where the schedule splits backward, else B."""
    return ("I", stage, mb) if ("I", stage, mb) in done else ("B", stage, mb)


def single_stage_orders(schedule: str, ranks: int, micro_batches: int) -> list[list[Action]]:
    """GPipe's and 1F1B's orders (one stage per rank), as torch 2.13 runs them: GPipe every forward
    then every backward; 1F1B min(m, p - r) forwards, then one backward and one forward in turn."""
    orders = []
    for rank in range(ranks):
        forwards = [("F", rank, i) for i in range(micro_batches)]
        backwards = [("B", rank, i) for i in range(micro_batches)]
        if schedule == "gpipe":
            orders.append(forwards + backwards)
            continue
        warmup = min(micro_batches, ranks - rank)
        order = forwards[:warmup]
        for i in range(micro_batches):
            order.append(backwards[i])
            if warmup + i < micro_batches:
                order.append(forwards[warmup + i])
        orders.append(order)
    return orders


def interleaved_orders(schedule: str, ranks: int, micro_batches: int, chunks: int) -> list[list[Action]]:
    """Interleaved 1F1B's and interleaved zero-bubble's orders (`chunks` stages per rank, rank r holding
    stages r, r + p, ...), as torch 2.13 computes them (schedules.py: ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, _get_1f1b_rank_ops), without the empty slots that only align its table.
    Micro-batches go in rounds of m // p; zero-bubble splits each backward into I then, later, W (its first
    stage's I computes nothing: torch runs that stage's whole backward as its W)."""
    zero_bubble = schedule == "zero-bubble"
    rounds = max(1, micro_batches // ranks)
    per_round = micro_batches // rounds
    orders = []
    for rank in range(ranks):
        last_stage_warmup = (chunks - 1) * per_round
        warmup = min(last_stage_warmup + (1 if zero_bubble else 2) * (ranks - 1 - rank), micro_batches * chunks)
        total = chunks * micro_batches  # forwards (and as many backwards)

        def forward_stage(op: int, rank: int = rank) -> int:
            return ((op // per_round) % chunks) * ranks + rank

        def backward_stage(op: int, rank: int = rank, warmup: int = warmup) -> int:
            return (chunks - 1 - ((op - warmup) // per_round) % chunks) * ranks + rank

        orders.append(_one_f_one_b(total, warmup, forward_stage, backward_stage,
                                   split_from=rank if zero_bubble else None))
    return orders


def _one_f_one_b(total: int, warmup: int, forward_stage: Callable[[int], int], backward_stage: Callable[[int], int],
                 split_from: int | None) -> list[Action]:
    """torch's _get_1f1b_rank_ops: `warmup` forwards, then a forward and a backward in turn, then the
    remaining backwards; with `split_from` (zero-bubble) each backward is I, and the W of the oldest pending
    one follows every backward from the split_from-th of the steady phase on, the rest at the end."""
    order: list[Action] = []
    next_mb: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> Action:
        mb = next_mb.get((kind, stage), 0)
        next_mb[kind, stage] = mb + 1
        return (kind, stage, mb)

    backward_ops: list[int] = []
    weights_done = 0
    for op in range(total + warmup):  # warmup forwards, total - warmup steady pairs, warmup cooldown backwards
        if op < total:
            if op < warmup:
                order.append(take("F", forward_stage(op)))
                continue
            order.append(take("F", forward_stage(op)))
        order.append(take("B" if split_from is None else "I", backward_stage(op)))
        backward_ops.append(op)
        if split_from is not None and op - warmup >= split_from:
            order.append(take("W", backward_stage(backward_ops[weights_done])))
            weights_done += 1
    while split_from is not None and weights_done < len(backward_ops):
        order.append(take("W", backward_stage(backward_ops[weights_done])))
        weights_done += 1
    return order
