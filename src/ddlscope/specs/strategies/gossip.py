"""`gossip`: decentralised averaging with neighbours, no server (PAPERS.md item 11, A(DP)^2SGD).

After each local optimizer step a worker sends its parameters to its
neighbours in the topology, receives theirs, and keeps the uniform mean of
its own and theirs (weight 1 / (degree + 1) each). Every topology here is
symmetric and regular, so the mixing matrix is doubly stochastic and the
workers' mean model moves like synchronous SGD's. On the complete graph the
mean over all is global averaging: local SGD with period 1.

`mode = "async"`: a worker never waits for its neighbours' models of the same
step; it mixes in the newest copy of each neighbour's model that arrived since
its last mix (none arrived: that neighbour is left out of this mix), so a
straggler slows only itself.

Differential privacy (`dp_noise_multiplier` > 0), DP-SGD style: each sample's
gradient is clipped to `dp_clip_norm`, Gaussian noise of standard deviation
noise multiplier x clip norm is added to their sum before the local step, so
every model a worker shares is private; the privacy spent is epsilon at
`dp_delta` (specs/privacy.py, Google's dp-accounting).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec

# DP-SGD noise multipliers that mean something: below 0.1 epsilon runs to the thousands (no privacy); past 100
# the noise is a hundred times the clipped gradient (no learning).
MIN_NOISE = 0.1
MAX_NOISE = 100.0

Topology = Literal["ring", "torus", "exponential", "complete"]
Mode = Literal["sync", "async"]


@strategy_spec
class GossipSpec(StrategySpec):
    traits = Traits(family="decentralized", simplicity=7, synchronous=False)
    description = ("gossip: each step average the model with the neighbours in a ring, torus, exponential or complete "
                   "graph; sync or async, optional DP-SGD noise with its epsilon")
    advice = "no central server or global collective: each worker talks to a few neighbours only"

    name: Literal["gossip"] = "gossip"
    topology: Topology = Field("ring", description="ring (2 neighbours), torus (2-D, up to 4), exponential "
                                                   "(ranks at distance 2^k), complete (everybody)")
    mode: Mode = Field("sync", description="sync: every step waits for each neighbour's model of the same step; "
                                           "async: mix in whatever neighbour models have arrived, never wait")
    dp_noise_multiplier: float = Field(0.0, ge=0, le=MAX_NOISE, description="differential privacy: Gaussian noise "
                                       "std over the per-sample clip norm (0: no privacy, no clipping; else 0.1 to 100)")
    dp_clip_norm: float = Field(1.0, gt=0, le=1e6, description="differential privacy: each sample's gradient is clipped to "
                                                       "this L2 norm (used when dp_noise_multiplier > 0)")
    dp_delta: float = Field(1e-5, gt=0, lt=1, description="differential privacy: the delta epsilon is reported at")

    @field_validator("dp_noise_multiplier")
    @classmethod
    def _meaningful_noise(cls, noise: float) -> float:
        if 0 < noise < MIN_NOISE:
            raise ValueError(f"must be 0 (no privacy) or at least {MIN_NOISE:g}, not {noise:g}: below it epsilon "
                             "runs to the thousands, no privacy to speak of")
        return noise

    def check_experiment(self, exp: Any) -> None:
        if exp.cluster.world_size < 2:
            raise ConfigError(f"cluster.world_size = {exp.cluster.world_size}: strategy gossip averages with "
                              "neighbours; it needs at least 2 ranks")

    @property
    def private(self) -> bool:
        """Whether updates are clipped and noised (and epsilon reported)."""
        return self.dp_noise_multiplier > 0

    def neighbours(self, rank: int, world: int) -> list[int]:
        """The ranks `rank` exchanges with, sorted; symmetric (j in i's list iff i in j's) and never itself."""
        if self.topology == "complete":
            peers = set(range(world))
        elif self.topology == "ring":
            peers = {(rank + 1) % world, (rank - 1) % world}
        elif self.topology == "exponential":
            peers = {(rank + sign * 2**k) % world for k in range(max(1, math.ceil(math.log2(world))))
                     for sign in (1, -1) if 2**k < world}
        else:
            rows = torus_rows(world)
            cols = world // rows
            r, c = divmod(rank, cols)
            peers = {((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))}
        return sorted(peers - {rank})


def torus_rows(world: int) -> int:
    """The 2-D torus' rows: the largest divisor of `world` not above its square root (1 row: a ring)."""
    return max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
