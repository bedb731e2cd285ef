"""Specs, torch-free: the experiment (workload, strategy, cluster) and every strategy's knobs and traits.

The bottom layer with the store: pydantic models only, so predict, advise,
analysis and report can read a strategy's traits without importing torch.
Importing this package registers every strategy spec (specs/strategies/).
"""

from ddlscope.specs.base import ConfigError, Spec, describe_validation_error, remember_spec_class
from ddlscope.specs.experiment import (
    NETWORK_PROFILES, TARGET_COMPUTE_EFFICIENCY, ClusterSpec, Experiment, Fault, NetworkProfile, NetworkSpec, Preemption,
    WorkloadSpec, check_consistency, run_name_problem)
from ddlscope.specs.registry import import_submodules
from ddlscope.specs.strategy import (
    STRATEGY_SPECS, Family, StrategySpec, Traits, baseline_strategy, is_baseline, strategy_spec, strategy_specs,
    traits_of)

import_submodules("ddlscope.specs.strategies")

__all__ = ["NETWORK_PROFILES", "STRATEGY_SPECS", "TARGET_COMPUTE_EFFICIENCY", "ClusterSpec", "ConfigError",
           "Experiment", "Family", "Fault", "NetworkProfile", "NetworkSpec", "Preemption", "Spec", "StrategySpec", "Traits",
           "WorkloadSpec", "baseline_strategy", "check_consistency", "describe_validation_error", "is_baseline",
           "remember_spec_class", "run_name_problem", "strategy_spec", "strategy_specs", "traits_of"]
