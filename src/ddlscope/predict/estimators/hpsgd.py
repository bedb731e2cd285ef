"""`hpsgd`: one all-reduce of the flat gradient per step, hidden behind the next `staleness` steps' compute.

Cluster scale and here alike: what of the all-reduce exceeds `staleness`
steps of compute is exposed (all of it at staleness 0: the flat all-reduce
starts after backward, unlike DDP's buckets); every step still meets the
slowest worker. Memory: staleness + 1 flat gradients in flight.
"""

from __future__ import annotations

from ddlscope.calibrate.model import message_s
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.predict.estimators.localsgd import (
    extra_copies_bytes, local_model_all_reduce_s, local_sync_wait_s, straggler_bound)
from ddlscope.specs.strategies.hpsgd import HPSGDSpec


def hidden_exposed_s(all_reduce_s: float, hiding_compute_s: float) -> float:
    return max(all_reduce_s - hiding_compute_s, 0.0)


def synchronising_estimate(name: str, case: ClusterCase, compute_s: float, comm_s: float, exposed_s: float,
                           memory_bytes: float) -> pst.StrategyEstimate:
    """A step of compute plus exposed communication, every worker met each step (the slowest sets the pace)."""
    w, n = case.workload, case.cluster.n_gpus
    step_s = compute_s + exposed_s
    est = pst.StrategyEstimate(name, n, step_s, compute_s, comm_s, exposed_s, memory_bytes, n * w.batch_per_worker,
                               w.batch_per_worker / compute_s)
    return straggler_bound(est, case)


@ESTIMATORS.register(HPSGDSpec)
class HPSGDEstimator(Estimator):
    def cluster(self, spec: HPSGDSpec, case: ClusterCase) -> pst.StrategyEstimate:
        w, cluster = case.workload, case.cluster
        n, g = cluster.n_gpus, cluster.gpus_per_node
        c = pst.compute_s(w, cluster)
        all_reduce_s = float(coll.all_reduce_s(w.params * w.grad_bytes_per_param, n, min(n, g), cluster.node))
        exposed_s = hidden_exposed_s(all_reduce_s, spec.staleness * c)
        est = synchronising_estimate(spec.name, case, c, all_reduce_s, exposed_s, self.cluster_memory(spec, case)[0])
        est.mean_staleness_steps = float(spec.staleness)
        return est

    def cluster_memory(self, spec: HPSGDSpec, case: ClusterCase) -> tuple[float, float | None]:
        return (case.replicated_state_bytes + case.activation_bytes
                + extra_copies_bytes(case, spec.staleness + 1), None)

    def local_compute_extra_s(self, spec: HPSGDSpec, case: LocalCase) -> tuple[float, list[str]]:
        """The all-reduce launched after a step moves its real bytes on gloo's thread: what of it the rank
        does not wait out in that step's synchronize (the emulated link's wait for the average due then is a
        sleep it runs inside of) runs while the next step computes, on the ranks' own cores where none is
        spare, and comes out of that compute (its calibrated time, as CoCoD's average in flight does)."""
        if spec.staleness < 1 or case.world < 2 or case.world + case.servers < case.cores:
            return 0.0, []
        transfer_s = message_s(case.profile, "all_reduce", case.param_bytes, case.world, None)
        compute_s = case.alone_s * case.side_by_side_stretch()
        waited_s = hidden_exposed_s(message_s(case.profile, "all_reduce", case.param_bytes, case.world, case.link),
                                    spec.staleness * compute_s)
        extra_s = max(transfer_s - waited_s, 0.0)
        if extra_s <= 0:
            return 0.0, []
        return extra_s, [f"hpsgd: the all-reduce in flight moves its bytes on the ranks' cores while they compute "
                         f"({extra_s * 1e3:.2f} ms a step of compute)"]

    def local_comm(self, spec: HPSGDSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        all_reduce_s, copies_s = local_model_all_reduce_s(case, step)  # gradients: as many bytes as the model
        exposed_s = hidden_exposed_s(all_reduce_s, spec.staleness * (step.forward_s + step.backward_s))
        comm = LocalComm(exposed_s + copies_s + local_sync_wait_s(case), holds_sync_wait=True)
        comm.notes.append(f"hpsgd: gradient all-reduce {all_reduce_s * 1e3:.2f} ms, {exposed_s * 1e3:.2f} ms of it "
                          f"not hidden behind {spec.staleness} step(s) of compute")
        return comm
