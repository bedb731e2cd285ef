"""Study section: graph-transformer attention, dense vs sparse vs node-parallel sparse, as the graph grows.

Three graph sizes (generated stochastic block models, the `graph-transformer` workload). At each:
    dense      one process, N x N masked attention (memory ~ nodes^2 x heads)
    sparse     one process, attention over the edges (memory ~ edges x width)
    nodepar    `nodepar` in node-parallel mode on 2 ranks: each rank its half of the nodes, the halo
               fetched with an all-to-all per layer
each trained a few steps with the real loop (runtime/loop.py). Reported per rank: the activation bytes
autograd saved at the measured step (saved-tensor hooks, runtime/instrument.py) beside the strategy's
own estimate (specs/strategies/nodepar.py, what `auto` mode decides on), the mean step time (steps
after the first; the slowest rank's for 2 ranks) and the bytes a rank sent per step.

    rows, table = graph_section(quick=True)    # quick: 512, 1024, 2048 nodes; full: 1024, 2048, 4096
    python -m ddlscope.studies.beyond_graph [--full]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ddlscope.studies.text_table import render_rows

GRAPH = {"communities": 8, "degree_in": 8, "degree_out": 2, "features": 16, "hidden": 32, "heads": 2, "layers": 2}
SIZES = {True: (512, 1024, 2048), False: (1024, 2048, 4096)}
STEPS = 4
RANKS = 2
MIB = 2**20
TITLE = "graph transformer: attention memory and step time vs graph size (per rank)"


def experiment_overrides(nodes: int, attention: str, ranks: int) -> dict[str, Any]:
    strategy = {"strategy.name": "single"} if ranks == 1 else {"strategy.name": "nodepar",
                                                                "strategy.mode": "node-parallel"}
    return {"workload.name": "graph-transformer", "workload.nodes": nodes, "workload.attention": attention,
            "workload.steps": STEPS, "workload.batch_size": 128, "workload.eval_batches": 1,
            **{f"workload.{k}": v for k, v in GRAPH.items()}, "cluster.world_size": ranks, "seed": 0, **strategy}


def train_and_measure(overrides: dict[str, Any], rank: int, out_dir: str) -> dict[str, Any]:
    """Train one configuration on this rank with the real loop; its step time, activations and bytes."""
    from ddlscope.runtime.config import load_experiment
    from ddlscope.runtime.loop import train
    from ddlscope.runtime.rows import RowWriter, read_records
    from ddlscope.specs.strategies.nodepar import attention_activation_bytes
    from ddlscope.strategies import RunContext, runtime_class
    from ddlscope.workloads import WORKLOADS

    exp = load_experiment(None, overrides)
    ranks = exp.cluster.world_size
    ctx = RunContext(rank, ranks, rank, 0, torch.device("cpu"), "gloo", exp)
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    path = Path(out_dir) / f"{exp.workload.attention}-{exp.workload.nodes}-{ranks}-{rank}.jsonl"
    writer = RowWriter(path, rank)
    train(task, runtime_class(exp.strategy)(exp.strategy, ctx), ctx, writer)
    writer.close()
    records = list(read_records(path))
    steps = [r for r in records if r.get("kind") == "step"][1:]  # the first pays one-off costs
    memory = next(r["bytes"] for r in records if r.get("kind") == "memory")
    return {"nodes": exp.workload.nodes, "edges": len(task.model.layout.src) if ranks == 1 else None,
            "attention": exp.workload.attention, "ranks": ranks,
            "step_s": statistics.mean(r["step_s"] for r in steps),
            "sent_bytes": statistics.mean(r["bytes_sent"] for r in steps),
            "activations_bytes": memory["activations_peak"],
            "estimate_bytes": attention_activation_bytes(exp.workload, ranks)}


def node_parallel_runs(sizes: tuple[int, ...], out_dir: str) -> list[dict[str, Any]]:
    """One rank of the 2-rank runs: every size in turn on one gloo group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return [train_and_measure(experiment_overrides(n, "sparse", RANKS), dist.get_rank(), out_dir) for n in sizes]
    finally:
        dist.destroy_process_group()


def graph_section(quick: bool = True) -> tuple[list[dict[str, Any]], str]:
    """Measure the three sizes; the table rows (one per size and configuration) and the rendered table."""
    from ddlscope.runtime.launcher import launch_processes

    sizes = SIZES[quick]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each launched rank runs (OMP_NUM_THREADS=1)
    try:
        with tempfile.TemporaryDirectory(prefix="ddlscope-graph-") as out:
            one = [train_and_measure(experiment_overrides(n, a, 1), 0, out) for n in sizes for a in ("dense", "sparse")]
            per_rank = launch_processes(node_parallel_runs, (sizes, out), RANKS, run_id=f"beyond-graph-{os.getpid()}")
    finally:
        torch.set_num_threads(threads)
    edges = {r["nodes"]: r["edges"] for r in one}
    rows = [_row(r, r["attention"], edges[r["nodes"]]) for r in one]
    for i, n in enumerate(sizes):
        ranks = [per_rank[k][i] for k in sorted(per_rank)]
        slowest = max(ranks, key=lambda r: r["step_s"])
        rows.append(_row({**slowest, "activations_bytes": max(r["activations_bytes"] for r in ranks)},
                         f"nodepar x{RANKS}", edges[n]))
    rows.sort(key=lambda r: (r["nodes"], ["dense", "sparse", f"nodepar x{RANKS}"].index(r["attention"])))
    return rows, render_rows(rows, TITLE)


def _row(r: dict[str, Any], label: str, edges: int) -> dict[str, Any]:
    return {"nodes": r["nodes"], "edges": edges, "attention": label,
            "activations MiB": r["activations_bytes"] / MIB, "estimate MiB": r["estimate_bytes"] / MIB,
            "step ms": r["step_s"] * 1e3, "sent KiB/step": r["sent_bytes"] / 1024}


if __name__ == "__main__":
    print(graph_section(quick="--full" not in sys.argv)[1])
