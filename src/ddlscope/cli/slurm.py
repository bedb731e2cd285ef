"""`slurm`: write the sbatch script that runs an experiment on a Slurm allocation."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ddlscope.cli.common import DEFAULT_DB, DbOption, UserError, err_console


def slurm(
    config: Annotated[Path, typer.Argument(help="TOML experiment file.")],
    nodes: Annotated[int, typer.Option(help="Nodes to allocate.")],
    procs_per_node: Annotated[int, typer.Option(help="Ranks per node (usually GPUs per node).")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Script path (default: stdout).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override any field: section.key=value.")] = None,
    job_name: Annotated[str, typer.Option(help="Slurm job name.")] = "ddlscope",
    time_limit: Annotated[str, typer.Option("--time", help="Slurm time limit.")] = "01:00:00",
    port: Annotated[int, typer.Option(help="Rendezvous port on the first node.")] = 29500,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Write an sbatch script that runs CONFIG on NODES x PROCS_PER_NODE ranks with srun."""
    from ddlscope.runtime.config import load_experiment, parse_override
    from ddlscope.runtime.slurm import sbatch_script

    if nodes < 1 or procs_per_node < 1:
        raise UserError(f"--nodes {nodes} --procs-per-node {procs_per_node}: both must be >= 1")
    overrides = dict(parse_override(item) for item in set_ or [])
    overrides.update({"cluster.nnodes": nodes, "cluster.world_size": nodes * procs_per_node,
                      "cluster.rdzv_endpoint": f"127.0.0.1:{port}"})  # placeholder host: the script sets the real one
    load_experiment(config, overrides)  # refuse a bad config now, not on the cluster
    script = sbatch_script(config, nodes, procs_per_node, set_ or [], job_name, time_limit, port, db)
    if output:
        output.write_text(script)
        err_console.print(f"wrote {output}; submit with: sbatch {output}")
    else:
        sys.stdout.write(script)
