"""`dbs`: DDP whose batch split follows each worker's measured throughput (PAPERS.md item 3).

Each step a worker records its compute (forward + backward, less the
exposed communication the loop's accounting finds: the wait for slower
workers is not its own compute), leaving out its first two steps (one-off
costs). At every re-split step (each epoch, or every
`resplit_every_steps`) each worker models its step's compute as overhead +
per-sample time x batch, taking the median step since the last split (a
scheduler hiccup or a collection pause in one step must not move the split:
on a sub-millisecond step one such step triples the mean), all-gather those
two numbers, and all compute the
same split that gives every worker the same time
(specs/strategies/batching.py: balanced_split). Until a worker has measured
two batch sizes at least 10% apart its overhead is taken as 0, which is
DBS's rule: batches in proportion to measured throughput. The overhead term
keeps a slow worker's share from collapsing where a smaller batch does not
make it proportionally faster. The gradient weighting of
strategies/batching.py keeps the update exact; with equal speeds the split
stays (about) equal, and the update is `ddp`'s whatever the split.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
import torch.distributed as dist

from ddlscope.specs.strategies.batching import balanced_split, split_batch
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
        self._step_compute_s: list[float] = []  # since the last split: this worker's forward + backward
        self._earlier: tuple[int, float] | None = None  # (batch, median compute s) of an earlier, different batch
        self._timer: Any = None
        self._warm_up = 2  # this process's first steps pay one-off costs (DDP's buckets, lazy init): not speed

    def current_split(self, step: int, dataset_len: int) -> list[int] | None:
        period = self.spec.resplit_every_steps or max(1, dataset_len // self.global_batch)
        if step > 0 and step % period == 0:
            self._resplit()
        return self.batch_sizes

    def _time_model(self) -> tuple[float, float]:
        """(overhead s, s per sample) of this worker's step compute; (0, 0) when nothing was measured."""
        assert self.batch_sizes is not None
        step_s = self._typical_step_s()
        if step_s <= 0:
            return 0.0, 0.0
        batch = self.batch_sizes[self.ctx.rank]
        if self._earlier is not None and abs(batch - self._earlier[0]) >= 0.1 * max(batch, self._earlier[0]):
            per_sample_s = (step_s - self._earlier[1]) / (batch - self._earlier[0])
            overhead_s = step_s - per_sample_s * batch
            if per_sample_s > 0 and overhead_s >= 0:
                return overhead_s, per_sample_s
        return 0.0, step_s / batch

    def _typical_step_s(self) -> float:
        """The median compute of the steps measured since the last split; 0 when none were."""
        return statistics.median(self._step_compute_s) if self._step_compute_s else 0.0

    def _resplit(self) -> None:
        """All workers share their time models and take the same new split; a worker that measured
        nothing (a restart right at a split step) keeps everyone on the old one."""
        assert self.batch_sizes is not None
        mine = torch.tensor(self._time_model(), dtype=torch.float64)
        models = [torch.zeros(2, dtype=torch.float64) for _ in range(self.ctx.workers)]
        pending = self.comm.launched(mine.numel() * mine.element_size(), "all_gather")
        dist.all_gather(models, mine)
        self.comm.completed(pending)
        overhead_s, per_sample_s = [float(m[0]) for m in models], [float(m[1]) for m in models]
        current = self.batch_sizes[self.ctx.rank], self._typical_step_s()
        if all(math.isfinite(c) and c > 0 for c in per_sample_s):
            self.batch_sizes = balanced_split(self.global_batch, overhead_s, per_sample_s)
            if self.batch_sizes[self.ctx.rank] != current[0] and self._step_compute_s:
                self._earlier = current  # the fit needs two batch sizes: keep the one being left
        self._step_compute_s = []

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        self._timer = timer  # its phases are read once the step's communication is accounted
        return super().train_step(batch, timer)

    def comm_stats(self, backward_end_s: float) -> CommStats:
        stats = super().comm_stats(backward_end_s)
        if self._timer is not None and self._warm_up:
            self._warm_up -= 1
        elif self._timer is not None:
            seconds = self._timer.seconds
            self._step_compute_s.append(seconds["forward"] + seconds["backward"]
                                        - stats.exposed_in_forward_s - stats.exposed_in_backward_s)
            self._timer = None
        return stats

    def checkpoint_state(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes or []), "step_compute_s": list(self._step_compute_s),
                "earlier": list(self._earlier) if self._earlier else None}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.batch_sizes = [int(b) for b in state["batch_sizes"]] or self.batch_sizes
        self._step_compute_s = [float(s) for s in state["step_compute_s"]]
        self._earlier = (int(state["earlier"][0]), float(state["earlier"][1])) if state["earlier"] else None
