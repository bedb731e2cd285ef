"""`dbs`: DDP whose batch split follows each worker's measured throughput."""

from __future__ import annotations

from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase
from ddlscope.predict.estimators.ddp import DDPEstimator, ddp
from ddlscope.specs.strategies.batching import step_slowdowns
from ddlscope.specs.strategies.dbs import DBSSpec


@ESTIMATORS.register(DBSSpec)
class DBSEstimator(DDPEstimator):
    """DDP's all-reduce; the compute of a split that has converged to the speeds (1 / slowdown): every
    worker takes workers / sum(1 / slowdown) of a homogeneous step. The first epoch, on the first
    split, and the per-split all-gather of one number per worker are left out. On this machine its
    communication is DDP's (the inherited local_comm)."""

    def cluster(self, spec: DBSSpec, case: ClusterCase) -> pst.StrategyEstimate:
        slowdowns = list(case.slowdowns) if case.slowdowns else None
        balanced = step_slowdowns(slowdowns, [1.0 / s for s in slowdowns]) if slowdowns else None
        return ddp(case.workload, case.cluster, bucket_mb=spec.bucket_mb, slowdowns=balanced, name="dbs")

    def cluster_notes(self, spec: DBSSpec, case: ClusterCase) -> list[str]:
        if not case.slowdowns or len(set(case.slowdowns)) == 1:
            return []
        return ["batches re-split by measured throughput: the straggler takes a smaller share of each step"]
