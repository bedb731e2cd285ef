"""Workloads: models + datasets + metrics, one registry."""

from ddlscope.specs.registry import Registry
from ddlscope.workloads.base import Dataset, EvalResult, Task, TensorDataset, Workload

WORKLOADS: Registry[type[Workload]] = Registry("workload")

# Importing a module registers its workloads.
from ddlscope.workloads import digits, graph, text, vision  # noqa: E402,F401

__all__ = ["WORKLOADS", "Dataset", "EvalResult", "Task", "TensorDataset", "Workload"]
