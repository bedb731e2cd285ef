"""The runtime's training loop on local gloo ranks, for the multi-process tests.

`spawn_runs` starts `world` processes once and runs several experiments one after another in one process
group: rank 0 saves each run's full state dict as NAME.pt, every rank its rows as NAME-RANK.json.
"""

from __future__ import annotations

import gc
import json
import os
import socket
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddlscope.runtime.config import load_experiment
from ddlscope.runtime.loop import train
from ddlscope.runtime.rows import RowWriter, read_records
from ddlscope.strategies import runtime_class
from ddlscope.strategies.base import RunContext, Strategy
from ddlscope.workloads import WORKLOADS

# Called with the strategy and the rank before training (e.g. to zero one part's loss); module-level, so
# that it reaches spawned processes.
Adjust = Optional[Callable[[Strategy, int], None]]
Run = tuple[str, dict, Adjust]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rank(overrides: dict, rank: int, world: int, rows: Path, adjust: Adjust = None, *,
               whole_model: bool = True) -> tuple[dict, list[dict]]:
    """One run of the loop on this rank: the full state dict (collective; with `whole_model=False`, this
    rank's own copy instead, unwrapped from DDP: local SGD's ranks differ between averages) and this
    rank's rows."""
    exp = load_experiment(None, overrides)
    ctx = RunContext(rank, world, rank, 0, torch.device("cpu"), "gloo", exp)
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    strategy = runtime_class(exp.strategy)(exp.strategy, ctx)
    if adjust is not None:
        adjust(strategy, rank)
    writer = RowWriter(rows, rank)
    result = train(task, strategy, ctx, writer)
    writer.close()
    if whole_model:
        return strategy.full_state_dict(result.model), list(read_records(rows))
    module = getattr(result.model, "module", result.model)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, list(read_records(rows))


def _worker(rank: int, port: int, out: str, world: int, runs: list[Run]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    done = False
    try:
        for name, overrides, adjust in runs:
            state, records = train_rank(overrides, rank, world, Path(out) / f"{name}-{rank}.jsonl", adjust)
            if rank == 0:
                torch.save(state, Path(out) / f"{name}.pt")
            (Path(out) / f"{name}-{rank}.json").write_text(json.dumps(records))
        done = True
    finally:
        gc.collect()  # as runtime/worker.py does: free the runs' stages and reducers while the group is alive
        dist.destroy_process_group()
    if done:
        # Every output is written and closed. Leave without the interpreter's teardown: after a series of
        # pipeline runs it aborted a rank here once ("terminate called without an active exception", a
        # C++ thread of torch's still joinable), failing every test of the module after the work was done.
        os._exit(0)


def spawn_runs(out: Path, world: int, runs: list[Run]) -> None:
    mp.start_processes(_worker, args=(free_port(), str(out), world, runs), nprocs=world, join=True,
                       start_method="spawn")


def records(rows: list[dict], kind: str) -> list[dict]:
    return [r for r in rows if r.get("kind") == kind]
