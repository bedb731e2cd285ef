"""`ddp`: bucketed all-reduce overlapped with backward."""

from __future__ import annotations

import math

from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, split_slowdowns
from ddlscope.calibrate.model import emulated_s, interpolate_linear, machine_probe, message_s, required
from ddlscope.specs.strategies.ddp import DDPSpec


@ESTIMATORS.register(DDPSpec)
class DDPEstimator(Estimator):
    def cluster(self, spec: DDPSpec, case: ClusterCase) -> pst.StrategyEstimate:
        return pst.ddp(case.workload, case.cluster, bucket_mb=spec.bucket_mb,
                       slowdowns=split_slowdowns(spec, case))  # batch_split: specs/strategies/batching.py

    def cluster_memory(self, spec: DDPSpec, case: ClusterCase) -> tuple[float, float | None]:
        return case.replicated_state_bytes + 2 * spec.bucket_mb * 2**20 + case.activation_bytes, None

    def local_comm(self, spec: DDPSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """The calibrated DDP cost at this model size (hooks, bucket copies, its all-reduces on this
        machine), or, where an emulated link is slower, the smallest model's cost + the link's time for
        each bucket's all-reduce. Without a DDP probe: the all-reduces from the collective table.

        The probe times whole synchronised steps at this world size on these cores, so it holds the
        ranks' wait for each other and their turn-taking for a core.
        """
        # ddlscope passes bucket_cap_mb explicitly, so torch does not use its 1 MiB first bucket.
        param_bytes = case.param_bytes
        buckets = max(1, math.ceil(param_bytes / (spec.bucket_mb * 2**20)))
        probe = machine_probe(case.profile, "ddp", case.world)
        if not probe:
            return LocalComm(buckets * message_s(case.profile, "all_reduce", param_bytes / buckets, case.world,
                                                 case.link))
        overhead_s = required(probe.overhead_s, "ddp overhead_s")
        machine_s = interpolate_linear(required(probe.model_bytes, "ddp model_bytes"), overhead_s, param_bytes)
        if case.link is not None:
            machine_s = max(machine_s, float(overhead_s[0])
                            + buckets * emulated_s(case.link, "all_reduce", param_bytes / buckets, case.world))
        return LocalComm(machine_s, holds_sync_wait=True, holds_turn_taking=True)
