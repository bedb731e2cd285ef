"""`osp`: two-stage synchronisation (PAPERS.md item 16).

After backward the gradient's tensors are split in two. The important ones
(those with the largest mean magnitude in the previous step's averaged
gradient, which every rank holds, so all agree without a message; the first
step sends everything) are all-reduced at once and applied; the rest are
all-reduced in the background, overlapped with the next step's compute.
Meanwhile the worker applies its own local gradient for that part, and when
the average lands it applies the difference (average - local): the
local-gradient-based correction. `fraction` is the share of the gradient's
bytes the first stage may send; 1.0 sends everything at once, DDP's update.
"""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import Field

from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec


@strategy_spec
class OSPSpec(StrategySpec):
    traits = Traits(family="collective", simplicity=6, synchronous=False)
    description = "OSP: the important part of the gradient all-reduced at once, the rest overlapped with the next step"
    advice = "a network where the whole all-reduce exposes more than a step's compute hides"

    name: Literal["osp"] = "osp"
    fraction: float = Field(0.5, gt=0, le=1, description="share of the gradient's bytes all-reduced in the first, "
                                                         "blocking stage (1.0: all of it, DDP's update)")

    def first_stage(self, importance: Sequence[float], sizes: Sequence[int]) -> list[int]:
        """Indices of the tensors sent in the first stage: in order of importance, each that still fits in
        `fraction` of the bytes (a tensor too large is passed over for smaller, less important ones); the most
        important one always goes."""
        order = sorted(range(len(sizes)), key=lambda i: (-importance[i], i))
        budget, chosen, total = self.fraction * sum(sizes), [], 0
        for i in order:
            if not chosen or total + sizes[i] <= budget:
                chosen.append(i)
                total += sizes[i]
        return sorted(chosen)
