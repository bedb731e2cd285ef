"""An sbatch script that starts one `ddlscope run` launcher per node with srun.

Each launcher joins torch's c10d rendezvous on the first node of the
allocation; that node (SLURM_NODEID 0) hosts the rendezvous and owns the
store, and the other nodes' ranks send their rows to it over torch.distributed.
"""

from __future__ import annotations

import shlex
from pathlib import Path

_TEMPLATE = """#!/bin/bash
# Written by `ddlscope slurm`. Starts {config} on {nodes} node(s) x {ppn} rank(s).
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --time={time_limit}
# On GPU nodes, ask for one GPU per rank, e.g.:
##SBATCH --gpus-per-node={ppn}
set -euo pipefail

# The first node of the allocation hosts the rendezvous and the store.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export DDLSCOPE_RDZV_ENDPOINT="$head_node:{port}"

srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '\\
  exec ddlscope run {config_q} --quiet \\
    --nnodes {nodes} --procs-per-node {ppn} --node-rank "$SLURM_NODEID" \\
    --rdzv-endpoint "$DDLSCOPE_RDZV_ENDPOINT" --db {db_q}{sets}'
"""


def sbatch_script(config: Path, nodes: int, procs_per_node: int, sets: list[str], job_name: str,
                  time_limit: str, port: int, db: Path) -> str:
    # #SBATCH lines are read by sbatch, not a shell: a value there must be one plain line (the CLI
    # checks the job name and time in full; this is the last guard for every caller).
    for value in (str(config), job_name, time_limit):
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise ValueError(f"control character in {value!r}: each value must be one line of the script")
    # The whole srun command sits inside single quotes; quote each piece for the inner shell.
    inner = lambda s: shlex.quote(s).replace("'", "'\"'\"'")  # noqa: E731
    set_args = "".join(f" --set {inner(item)}" for item in sets)
    return _TEMPLATE.format(
        config=config, nodes=nodes, ppn=procs_per_node, job_name=job_name, time_limit=time_limit, port=port,
        config_q=inner(str(config.resolve())), db_q=inner(str(db.resolve())), sets=set_args)
