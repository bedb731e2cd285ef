"""`dbs`: DDP whose batch split follows each worker's measured throughput (PAPERS.md item 3).

Each step a worker adds its compute (forward + backward, less the exposed
communication the loop's accounting finds: the wait for slower workers is
not its own compute) and its samples. At every re-split step (each epoch, or
every `resplit_every_steps`) the workers all-gather their throughput and all
compute the same new split from it (specs/strategies/batching.py:
split_batch); the gradient weighting of strategies/batching.py keeps the
update exact. With equal speeds the split stays equal and this is `ddp`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ddlscope.specs.strategies.batching import split_batch
from ddlscope.specs.strategies.dbs import DBSSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.base import Batch, RunContext, StepTimer
from ddlscope.strategies.comm import CommStats
from ddlscope.strategies.ddp import DDP


@RUNTIMES.register(DBSSpec)
class DBS(DDP):
    spec: DBSSpec

    def __init__(self, spec: DBSSpec, ctx: RunContext):
        super().__init__(spec, ctx)
        self.global_batch = ctx.experiment.workload.batch_size
        if self.batch_sizes is None:  # the first split: equal unless batch_split says otherwise
            self.batch_sizes = split_batch(self.global_batch, [1.0] * ctx.workers)
        self._compute_s = 0.0  # since the last split: this worker's forward + backward compute
        self._samples = 0
        self._timer: Any = None

    def current_split(self, step: int, dataset_len: int) -> list[int] | None:
        period = self.spec.resplit_every_steps or max(1, dataset_len // self.global_batch)
        if step > 0 and step % period == 0:
            self._resplit()
        return self.batch_sizes

    def _resplit(self) -> None:
        """All workers share their throughput and take the same new split; a worker that measured
        nothing (a restart right at a split step) keeps everyone on the old one."""
        mine = torch.tensor([self._samples / self._compute_s if self._compute_s > 0 else 0.0], dtype=torch.float64)
        rates = [torch.zeros(1, dtype=torch.float64) for _ in range(self.ctx.workers)]
        pending = self.comm.launched(mine.numel() * mine.element_size(), "all_gather")
        dist.all_gather(rates, mine)
        self.comm.completed(pending)
        speeds = [float(r) for r in rates]
        if all(math.isfinite(s) and s > 0 for s in speeds):
            self.batch_sizes = split_batch(self.global_batch, speeds)
        self._compute_s, self._samples = 0.0, 0

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        self._timer = timer  # its phases are read once the step's communication is accounted
        return super().train_step(batch, timer)

    def comm_stats(self, backward_end_s: float) -> CommStats:
        stats = super().comm_stats(backward_end_s)
        if self._timer is not None and self.batch_sizes is not None:
            seconds = self._timer.seconds
            self._compute_s += (seconds["forward"] + seconds["backward"]
                                - stats.exposed_in_forward_s - stats.exposed_in_backward_s)
            self._samples += self.batch_sizes[self.ctx.rank]
            self._timer = None
        return stats

    def checkpoint_state(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes or []), "compute_s": self._compute_s, "samples": self._samples}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.batch_sizes = [int(b) for b in state["batch_sizes"]] or self.batch_sizes
        self._compute_s, self._samples = float(state["compute_s"]), int(state["samples"])
