"""Studies: named sets of experiments with their own analysis and report, one registry."""

from ddlscope.specs.registry import Registry
from ddlscope.studies.base import Cell, CellResult, Findings, Study

STUDIES: Registry[type[Study]] = Registry("study")

# Importing a module registers its studies.
from ddlscope.studies import beyond, dataparallel, modelparallel, paper  # noqa: E402,F401

__all__ = ["STUDIES", "Cell", "CellResult", "Findings", "Study"]
