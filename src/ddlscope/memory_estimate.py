"""Memory per rank by category for an experiment, from the model's table: what `ddlscope memory`
prints and `ddlscope predict --json` repeats for a model source.

The model is traced once on fake tensors (workloads/model_table.py: nothing allocated) and the
torch-free table is priced per strategy from its traits (predict/model_memory.py). At advise's
level: it composes the workload's trace with predict's pricing, importing torch only inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddlscope.specs import ConfigError


@dataclass(frozen=True)
class Budget:
    """Memory one rank may use: the device's, less what the framework holds before the model."""

    name: str
    memory_bytes: float
    framework_overhead_bytes: float


def estimate(exp: Any, overrides: dict[str, Any], budget: Budget, all_strategies: bool) -> dict[str, Any]:
    """`ddlscope memory`'s result for the experiment: the model's figures and, per strategy (the
    experiment's, or every registered one), one rank's bytes by category and whether they fit."""
    from ddlscope.runtime.config import experiment_from_dict
    from ddlscope.specs import strategy_specs

    tables: dict[tuple[int, str | None], Any] = {}
    if not all_strategies:
        estimates = [_priced(exp, tables, budget)]
    else:
        estimates = []
        for cls in strategy_specs():
            name = cls.registered_name
            try:
                candidate = experiment_from_dict(_nested({**overrides, "strategy.name": name}), check_workload=False)
            except ConfigError as exc:
                estimates.append({"strategy": name, "unavailable": str(exc)})
                continue
            estimates.append(_priced(candidate, tables, budget))
    table = next(iter(tables.values()))
    return {
        "model": exp.workload.name,
        "params": table.param_count,
        "param_bytes": table.param_bytes,
        "buffer_bytes": table.buffer_bytes,
        "forward_flops_per_sample": table.forward_flops / table.traced_batch,
        "activation_bytes_per_sample": table.activation_bytes_per_sample(),
        "activation_bytes_per_sample_recompute": table.activation_bytes_per_sample(recompute=True),
        "layers": len(table.layers),
        "units": len(table.units),
        "world_size": exp.cluster.world_size,
        "global_batch": exp.workload.batch_size,
        "optimizer": exp.workload.optimizer,
        "device": {"name": budget.name, "memory_bytes": budget.memory_bytes,
                   "framework_overhead_bytes": budget.framework_overhead_bytes},
        "estimates": estimates,
    }


def _nested(overrides: dict[str, Any]) -> dict[str, Any]:
    from ddlscope.runtime.config import set_dotted

    raw: dict[str, Any] = {}
    for dotted, value in overrides.items():
        set_dotted(raw, dotted, value)
    return raw


def _priced(exp: Any, tables: dict[tuple[int, str | None], Any], budget: Budget) -> dict[str, Any]:
    from ddlscope.predict.model_memory import MemoryQuery, fits, price

    batch = exp.per_rank_batch()
    table = _table(exp, batch, tables)
    query = MemoryQuery(traits=exp.strategy.traits, world_size=exp.cluster.world_size,
                        global_batch=exp.workload.batch_size, extra_ranks=exp.strategy.extra_ranks(),
                        optimizer=exp.workload.optimizer, momentum=getattr(exp.workload, "momentum", 0.0),
                        recompute=getattr(exp.workload, "recompute", "none") == "full")
    ranks = price(table, query)
    worker = ranks[0]
    return {
        "strategy": exp.strategy.name,
        "per_rank_batch": batch,
        "ranks": [{"role": r.role, "count": exp.cluster.world_size if r.role == "worker" else query.extra_ranks,
                   "bytes": r.bytes, "transient_bytes": r.transient_bytes, "total_bytes": r.total_bytes}
                  for r in ranks],
        "recompute": query.recompute,
        "total_bytes": worker.total_bytes,
        "fits": fits(worker, budget.memory_bytes, budget.framework_overhead_bytes),
    }


def _table(exp: Any, batch: int, tables: dict[tuple[int, str | None], Any]) -> Any:
    """The model table at `batch` samples, traced once per batch and wrap-unit rule."""

    from ddlscope.strategies.units import wrap_units
    from ddlscope.workloads.model_table import table_of_workload

    wrap_class = getattr(exp.strategy, "wrap_class", None)
    key = (batch, wrap_class)
    if key not in tables:
        try:
            tables[key] = table_of_workload(exp.workload, max(batch, 1), exp.seed,
                                            units_of=lambda m: wrap_units(m, wrap_class))
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 (the user's model raised: one line, not a traceback)
            first = (str(exc).strip() or type(exc).__name__).splitlines()[0][:200]
            raise ConfigError(f"workload.name = {exp.workload.name!r}: one forward of {batch} samples could not be "
                              f"traced: {first}") from None
    return tables[key]
