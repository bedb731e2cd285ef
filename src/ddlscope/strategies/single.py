"""`single`: one process, no communication. The baseline for speedups."""

from __future__ import annotations

from ddlscope.specs.strategies.single import SingleSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.base import Strategy


@RUNTIMES.register(SingleSpec)
class Single(Strategy):
    """Nothing to distribute: the base class's step as it is."""
