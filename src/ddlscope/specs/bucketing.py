"""MG-WFBP (PAPERS.md item 12): merge layer gradients into all-reduce buckets so backward hides the most.

Torch-free arithmetic in specs/ (like wire.py) because two layers read it: the DDP runtime
(strategies/ddp.py) applies the plan, the predictor and `ddlscope buckets` price it.

The model is the paper's. Layers are taken in the order backward produces
their gradients (the last layer first). Layer i's gradient is ready when
backward has run layers 0..i: r_i = t_0 + ... + t_i. A bucket of layers
s..e is all-reduced as one message, launched when its last layer is ready
(r_e), taking alpha + beta * bytes (the alpha-beta model of the all-reduce:
`beta` in seconds per byte), one message after the other on the link. The
step waits from the end of backward, r_last, to the end of the last bucket's
all-reduce: that difference is the exposed communication.

Merging trades one alpha per bucket saved against starting later. The paper
merges greedily layer by layer; its objective (finish time of the last
all-reduce) is solved here exactly by dynamic programming over contiguous
buckets, O(L^2): F(e), the earliest the buckets covering layers 0..e can have
finished, is min over s of max(r_e, F(s-1)) + alpha + beta * bytes(s..e).
That is optimal because the finish time of a bucket only grows with the
finish time of the ones before it, so every prefix should end as early as it
can. A brute force over all 2^(L-1) contiguous splits checks it in the tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass(frozen=True)
class Layer:
    """One layer's gradient in backward order: its backward compute time and its gradient bytes."""

    name: str
    backward_s: float
    grad_bytes: int


@dataclass(frozen=True)
class AlphaBeta:
    """One all-reduce of `b` payload bytes takes alpha_s + b * beta_s_per_byte."""

    alpha_s: float
    beta_s_per_byte: float

    def message_s(self, payload_bytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * payload_bytes


@dataclass(frozen=True)
class BucketPlan:
    """Buckets as (first, last) layer indices in backward order, with the model's timeline."""

    layers: tuple[Layer, ...]
    buckets: tuple[tuple[int, int], ...]
    backward_s: float  # end of backward: the last layer's gradient is ready
    finish_s: float  # the last all-reduce completes
    name: str = ""

    @property
    def exposed_s(self) -> float:
        """Communication the step waits for after backward."""
        return self.finish_s - self.backward_s

    def bucket_bytes(self) -> list[int]:
        return [sum(layer.grad_bytes for layer in self.layers[s:e + 1]) for s, e in self.buckets]


def ready_times_s(layers: Sequence[Layer]) -> list[float]:
    """When each layer's gradient is ready: backward runs the layers one after the other."""
    ready, now = [], 0.0
    for layer in layers:
        now += layer.backward_s
        ready.append(now)
    return ready


def simulate(layers: Sequence[Layer], buckets: Sequence[tuple[int, int]], link: AlphaBeta, name: str = "") -> BucketPlan:
    """The timeline of a given split: each bucket launched when its last layer is ready, one after the other."""
    _check(layers, link)
    ready = ready_times_s(layers)
    free = 0.0
    for s, e in buckets:
        free = max(ready[e], free) + link.message_s(sum(layer.grad_bytes for layer in layers[s:e + 1]))
    return BucketPlan(tuple(layers), tuple(buckets), ready[-1] if ready else 0.0, max(free, ready[-1] if ready else 0.0),
                      name)


def optimal_plan(layers: Sequence[Layer], link: AlphaBeta) -> BucketPlan:
    """MG-WFBP's optimal merge: the contiguous split whose last all-reduce finishes first (see the module)."""
    _check(layers, link)
    ready = ready_times_s(layers)
    prefix = [0]
    for layer in layers:
        prefix.append(prefix[-1] + layer.grad_bytes)
    finish = [0.0] * (len(layers) + 1)  # finish[e + 1]: best finish of buckets covering layers 0..e
    start_of = [0] * (len(layers) + 1)
    for e in range(len(layers)):
        best, best_start = math.inf, 0
        for s in range(e + 1):
            # ties: the later start (fewer layers in the last bucket), so equal plans come out the same way
            t = max(ready[e], finish[s]) + link.message_s(prefix[e + 1] - prefix[s])
            if t <= best:
                best, best_start = t, s
        finish[e + 1], start_of[e + 1] = best, best_start
    buckets: list[tuple[int, int]] = []
    end = len(layers)
    while end > 0:
        buckets.append((start_of[end], end - 1))
        end = start_of[end]
    return simulate(layers, buckets[::-1], link, "mgwfbp")


def per_layer_plan(layers: Sequence[Layer], link: AlphaBeta) -> BucketPlan:
    """WFBP: one all-reduce per layer, as soon as its gradient is ready."""
    return simulate(layers, [(i, i) for i in range(len(layers))], link, "per_layer")


def size_plan(layers: Sequence[Layer], link: AlphaBeta, bucket_bytes: float) -> BucketPlan:
    """DDP's rule at layer granularity: close a bucket once it holds at least `bucket_bytes`."""
    buckets, start, filled = [], 0, 0
    for i, layer in enumerate(layers):
        filled += layer.grad_bytes
        if filled >= bucket_bytes:
            buckets.append((start, i))
            start, filled = i + 1, 0
    if start < len(layers):
        buckets.append((start, len(layers) - 1))
    return simulate(layers, buckets, link, f"size {bucket_bytes / 2**20:g} MiB")


def _check(layers: Sequence[Layer], link: AlphaBeta) -> None:
    if link.alpha_s < 0 or link.beta_s_per_byte < 0:
        raise ValueError(f"alpha_s = {link.alpha_s}, beta = {link.beta_s_per_byte}: must be >= 0")
    for layer in layers:
        if layer.backward_s < 0 or layer.grad_bytes < 0:
            raise ValueError(f"layer {layer.name!r}: backward_s and grad_bytes must be >= 0")


PLAN_EVENT = "bucket_plan"  # the run's event holding the plan DDP used (plan_to_json)


def plan_to_json(plan: BucketPlan, link: AlphaBeta) -> str:
    return json.dumps({"name": plan.name, "layers": [asdict(layer) for layer in plan.layers],
                       "buckets": plan.buckets, "backward_s": plan.backward_s, "finish_s": plan.finish_s,
                       "link": asdict(link)})


def plan_from_json(text: str) -> tuple[BucketPlan, AlphaBeta]:
    raw = json.loads(text)
    plan = BucketPlan(tuple(Layer(**layer) for layer in raw["layers"]),
                      tuple((int(s), int(e)) for s, e in raw["buckets"]), raw["backward_s"], raw["finish_s"],
                      raw["name"])
    return plan, AlphaBeta(**raw["link"])
