"""`slurm`: write the sbatch script that runs an experiment on a Slurm allocation."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ddlscope.cli.common import (DEFAULT_DB, DbOption, UserError, check_output_folder, err_console,
                                 has_control_characters)
from ddlscope.store import atomic_output

# What an #SBATCH line takes as is: a job name of plain characters, and Slurm's time formats
# (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) or UNLIMITED.
JOB_NAME = re.compile(r"^[A-Za-z0-9._+\-@]{1,128}$")
TIME_LIMIT = re.compile(r"^(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|unlimited|infinite)$", re.IGNORECASE)


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
    check_script_values(config, set_ or [], job_name, time_limit, port, db)
    if output is not None:
        check_output_folder(output, "--output")
    overrides = dict(parse_override(item) for item in set_ or [])
    overrides.update({"cluster.nnodes": nodes, "cluster.world_size": nodes * procs_per_node,
                      "cluster.rdzv_endpoint": f"127.0.0.1:{port}"})  # placeholder host: the script sets the real one
    load_experiment(config, overrides)  # refuse a bad config now, not on the cluster
    script = sbatch_script(config, nodes, procs_per_node, set_ or [], job_name, time_limit, port, db)
    if output:
        with atomic_output(output, what="--output") as f:
            f.write(script)
        err_console.print(f"wrote {output}; submit with: sbatch {output}", markup=False, highlight=False)
    else:
        sys.stdout.write(script)


def check_script_values(config: Path, sets: list[str], job_name: str, time_limit: str, port: int, db: Path) -> None:
    """Every value the script repeats: no line breaks or control characters (each would be a script
    line of its own), a plain job name, a Slurm time and a TCP port."""
    for what, value in (("CONFIG", str(config)), ("--db", str(db)), *(("--set", item) for item in sets)):
        if has_control_characters(value):
            raise UserError(f"{what} {value!r}: holds a line break or control character; remove it")
    if not JOB_NAME.match(job_name):
        raise UserError(f"--job-name {job_name!r}: use 1-128 letters, digits and . _ + - @ (no spaces or line breaks)")
    if not TIME_LIMIT.match(time_limit):
        raise UserError(f"--time {time_limit!r}: expected a Slurm time: MINUTES, HH:MM:SS, D-HH:MM:SS or UNLIMITED")
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port}: must be a TCP port, 1 to 65535")
