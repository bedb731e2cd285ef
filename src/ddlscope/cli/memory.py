"""`ddlscope memory MODEL`: memory per rank by category, before launch, from the model's table.

The model is traced once on fake tensors (workloads/model_table.py: nothing
allocated, so an 8B or 70B config prices in seconds) and the torch-free table
is priced per strategy from its traits (predict/model_memory.py).
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from ddlscope.cli.common import JsonOption, UserError, console, wide_when_piped
from ddlscope.memory_estimate import Budget, estimate

GIB = 2**30
MIB = 2**20


def memory_command(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="A workload: torchvision:NAME, timm:NAME, hf:ARCH, "
                                                               "module:PKG.MOD:FACTORY or a built-in name.")],
    strategy: Annotated[Optional[str], typer.Option("--strategy", "-s", help="Strategy name; left out: a table over "
                                                    "every registered strategy.")] = None,
    world_size: Annotated[Optional[int], typer.Option("--world-size", "-n", help="Training ranks (default: the "
                                                      "cluster's GPUs, else 2).")] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", "--batch-size", "-b", help="Global batch, summed over "
                                                 "ranks (default: the workload's batch_size).")] = None,
    cluster: Annotated[Optional[str], typer.Option("--cluster", help="DEVICE:NODESxGPUS from the catalogue (e.g. "
                                                   "h100:4x8) to check the fit against; default: this machine's "
                                                   "memory shared by the ranks.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: section.key=value, e.g. "
                                                      "workload.hidden=4096 (repeatable).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Memory per rank by category (parameters, gradients, optimizer, activations, buffers, communication)."""
    from ddlscope.runtime.config import DEFAULT_STRATEGY, load_experiment, parse_override
    from ddlscope.specs import baseline_strategy

    budget, cluster_ranks = _budget(cluster)
    ranks = _world_size(world_size, cluster_ranks, cluster)
    overrides: dict[str, Any] = {"workload.name": model, "cluster.world_size": ranks}
    if batch is not None:
        overrides["workload.batch_size"] = batch
    for item in set_ or []:
        key, value = parse_override(item)
        if key in ("workload.name", "cluster.world_size", "strategy.name"):
            raise UserError(f"--set {item}: give {key} as {_FLAG_OF[key]}")
        overrides[key] = value
    overrides["strategy.name"] = strategy or (baseline_strategy() if ranks == 1 else DEFAULT_STRATEGY)
    exp = load_experiment(None, overrides)  # every bad input is refused here, one line
    if budget is None:
        budget = _local_budget(ranks + exp.strategy.extra_ranks())
    result = estimate(exp, overrides, budget, all_strategies=strategy is None)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)


_FLAG_OF = {"workload.name": "the MODEL argument", "cluster.world_size": "--world-size", "strategy.name": "--strategy"}


# --------------------------------------------------------------------------- inputs
def _budget(cluster: Optional[str]) -> tuple[Budget | None, int | None]:
    """The catalogue device's memory per GPU and the cluster's GPUs; (None, None) without --cluster."""
    if cluster is None:
        return None, None
    from ddlscope.predict.catalogue import LOCAL, cluster_name, parse_cluster

    if cluster_name(cluster) == LOCAL:  # this machine: its memory needs no calibration
        nodes, ranks = (int(n) for n in cluster.split(":", 1)[1].lower().split("x"))
        if nodes != 1 or ranks < 1:
            raise UserError(f"--cluster {cluster}: {LOCAL} is this machine: use {LOCAL}:1xN with N >= 1")
        return _local_budget(ranks), ranks
    parsed = parse_cluster(cluster)
    device = parsed.device
    return Budget(f"{device.key} ({device.memory_bytes / GIB:.0f} GiB)", device.memory_bytes,
                  device.framework_overhead_bytes), parsed.n_gpus


def _local_budget(ranks: int) -> Budget:
    """This machine's physical memory, shared by the ranks it would start."""
    from ddlscope.predict.catalogue import LOCAL_FRAMEWORK_OVERHEAD_BYTES

    total = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return Budget(f"this machine's memory / {ranks} ranks ({total / GIB:.1f} GiB in all)", total / max(ranks, 1),
                  LOCAL_FRAMEWORK_OVERHEAD_BYTES)


def _world_size(given: Optional[int], cluster_ranks: int | None, cluster: Optional[str]) -> int:
    if given is not None and given < 1:
        raise UserError(f"--world-size = {given}: must be >= 1")
    if given is not None and cluster_ranks is not None and given != cluster_ranks:
        raise UserError(f"--world-size = {given} disagrees with --cluster {cluster} ({cluster_ranks} GPUs); "
                        "give one of them")
    return given or cluster_ranks or 2


# --------------------------------------------------------------------------- printing
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers", "communication")


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"


def _print(result: dict[str, Any]) -> None:
    head = (f"{result['model']}: {result['params']:,} parameters ({_size(result['param_bytes'])}), "
            f"{result['world_size']} ranks, global batch {result['global_batch']}, {result['optimizer']}; "
            f"budget per rank: {result['device']['name']}")
    with wide_when_piped(160) as out:
        out.print(head, markup=False, highlight=False, emoji=False, soft_wrap=True)
        table = Table("strategy", "role", "batch/rank", *CATEGORIES, "total", "fits", title="memory per rank")
        for est in result["estimates"]:
            if "unavailable" in est:
                table.add_row(est["strategy"], "-", "-", *["-"] * len(CATEGORIES), "-", "n/a")
                continue
            for rank in est["ranks"]:
                worker = rank["role"] == "worker"
                verdict = ("fits" if est["fits"] else "does not fit") if worker else ""
                table.add_row(est["strategy"] if worker else "", f"{rank['role']} x{rank['count']}",
                              str(est["per_rank_batch"]) if worker else "",
                              *[_size(rank["bytes"][c]) for c in CATEGORIES], _size(rank["total_bytes"]), verdict)
        out.print(table)
        skipped = [e for e in result["estimates"] if "unavailable" in e]
        for est in skipped:
            out.print(f"n/a {est['strategy']}: {est['unavailable']}", markup=False, highlight=False, emoji=False,
                      soft_wrap=True)
