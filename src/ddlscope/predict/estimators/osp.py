"""`osp`: the first stage's all-reduce exposed, the second hidden behind the next step's compute.

Both stages pay their own latency; the second shows only where it outlasts a
step of compute. Every step meets the slowest worker (the first stage is
blocking). Memory: a copy of the gradient (the local stand-in) and the
second stage's buffer.
"""

from __future__ import annotations

from ddlscope.calibrate.model import message_s
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.predict.estimators.hpsgd import hidden_exposed_s, synchronising_estimate
from ddlscope.predict.estimators.localsgd import extra_copies_bytes, local_sync_wait_s
from ddlscope.specs.strategies.osp import OSPSpec


@ESTIMATORS.register(OSPSpec)
class OSPEstimator(Estimator):
    def cluster(self, spec: OSPSpec, case: ClusterCase) -> pst.StrategyEstimate:
        w, cluster = case.workload, case.cluster
        n, g = cluster.n_gpus, cluster.gpus_per_node
        grad_bytes = w.params * w.grad_bytes_per_param
        first_s, second_s = (float(coll.all_reduce_s(share * grad_bytes, n, min(n, g), cluster.node))
                             for share in (spec.fraction, 1.0 - spec.fraction))
        c = pst.compute_s(w, cluster)
        exposed_s = first_s + (hidden_exposed_s(second_s, c) if spec.fraction < 1 else 0.0)
        return synchronising_estimate(spec.name, case, c, first_s + second_s, exposed_s,
                                      self.cluster_memory(spec, case)[0])

    def cluster_memory(self, spec: OSPSpec, case: ClusterCase) -> tuple[float, float | None]:
        return case.replicated_state_bytes + case.activation_bytes + extra_copies_bytes(case, 2.0), None

    def local_comm(self, spec: OSPSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        first_s, second_s = (message_s(case.profile, "all_reduce", share * case.param_bytes, case.world, case.link)
                             for share in (spec.fraction, 1.0 - spec.fraction))
        hidden_behind_s = step.forward_s + step.backward_s
        exposed_s = first_s + (hidden_exposed_s(second_s, hidden_behind_s) if spec.fraction < 1 else 0.0)
        copies_s = 4 * case.param_bytes / case.memory_bandwidth_bytes_per_s * step.stretch  # clone, cat, split, add
        comm = LocalComm(exposed_s + copies_s + local_sync_wait_s(case), holds_sync_wait=True)
        comm.notes.append(f"osp: first stage {first_s * 1e3:.2f} ms, second {second_s * 1e3:.2f} ms behind "
                          f"{hidden_behind_s * 1e3:.2f} ms of compute")
        return comm
