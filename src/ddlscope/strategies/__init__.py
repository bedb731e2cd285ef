"""Strategies: how a model is trained across ranks, one registry."""

from ddlscope.registry import Registry
from ddlscope.strategies.base import RunContext, Strategy
from ddlscope.strategies.comm import CommRecorder, CommStats

STRATEGIES: Registry[type[Strategy]] = Registry("strategy")

# Importing a module registers its strategies.
from ddlscope.strategies import ddp, fsdp, ps, single  # noqa: E402,F401

__all__ = ["STRATEGIES", "CommRecorder", "CommStats", "RunContext", "Strategy"]
