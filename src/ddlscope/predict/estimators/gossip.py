"""`gossip`: a step's compute, then one model-sized message to and from each neighbour.

A worker's messages share its link, so they take degree x one message.
Synchronous: every step meets the neighbours (a straggler holds its
neighbours, and through them, a step later, everybody: the estimate holds
everybody to it at once), and the exchange is exposed. Asynchronous: a worker
waits for nobody; its messages leave while its next step computes (one in
flight per neighbour), so only what exceeds a step's compute shows, each
worker steps at its own pace (the total rate is the sum of the workers'
rates, as for ps-async) and no synchronisation wait is added.

Differential privacy (per-sample clipping, strategies/gossip.py): one more
forward and backward per step (the plain forward for the loss, then the
per-sample pass: about 4/3 of a step's compute, forward being a third of it)
and the per-sample gradients (batch x parameters) in memory. Memory: the flat
model sent and one received per neighbour.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ddlscope.calibrate.model import message_s
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.predict.estimators.hpsgd import synchronising_estimate
from ddlscope.predict.estimators.localsgd import extra_copies_bytes, local_sync_wait_s
from ddlscope.specs.strategies.gossip import GossipSpec

# A private step: the plain forward (1/3 of a step's compute) plus the per-sample forward and backward (1).
PRIVATE_COMPUTE_FACTOR = 4.0 / 3.0


def degree(spec: GossipSpec, workers: int) -> int:
    return len(spec.neighbours(0, workers))  # every topology here is regular


@ESTIMATORS.register(GossipSpec)
class GossipEstimator(Estimator):
    def cluster(self, spec: GossipSpec, case: ClusterCase) -> pst.StrategyEstimate:
        w, cluster = case.workload, case.cluster
        n = cluster.n_gpus
        message_bytes = w.params * w.weight_bytes_per_param
        # Neighbours outside the node are the slower links; rings and tori have some, so price them there.
        comm_s = degree(spec, n) * float(coll.p2p_s(message_bytes, cluster.nodes > 1, cluster.node))
        compute_s = pst.compute_s(w, cluster) * (PRIVATE_COMPUTE_FACTOR if spec.private else 1.0)
        memory = self.cluster_memory(spec, case)[0]
        if spec.mode == "async":
            est = asynchronous_estimate(spec.name, case, compute_s, comm_s, memory)
        else:
            est = synchronising_estimate(spec.name, case, compute_s, comm_s, comm_s, memory)
        if spec.private:
            est = replace(est, notes=est.notes + [
                f"differential privacy: per-sample clipping costs x{PRIVATE_COMPUTE_FACTOR:.2f} compute"])
        return est

    def cluster_memory(self, spec: GossipSpec, case: ClusterCase) -> tuple[float, float | None]:
        copies = 1 + degree(spec, case.cluster.n_gpus)
        if spec.private:  # the per-sample gradients, one model's worth per sample
            copies += case.workload.batch_per_worker
        return case.replicated_state_bytes + case.activation_bytes + extra_copies_bytes(case, copies), None

    def local_compute_factor(self, spec: GossipSpec, case: LocalCase) -> float:
        # Where predict-run timed the strategy's own backward (the per-sample pass), the kernels hold it.
        timed = (case.facts.get("kernels") or {}).get("strategy_backward")
        return PRIVATE_COMPUTE_FACTOR if spec.private and not timed else 1.0

    def local_comm(self, spec: GossipSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        peers = degree(spec, case.world)
        exchange_s = peers * message_s(case.profile, "p2p", case.param_bytes, 2, case.link)
        copies_s = (2 + peers) * case.param_bytes / case.memory_bandwidth_bytes_per_s * step.stretch
        if spec.mode == "async":
            # Sent while the next step computes, received by a thread; nobody meets anybody: no sync wait.
            exposed_s = max(0.0, exchange_s - (step.forward_s + step.backward_s))
            comm = LocalComm(exposed_s + copies_s, holds_sync_wait=True)
        else:
            comm = LocalComm(exchange_s + copies_s + meeting_wait_s(case), holds_sync_wait=True)
        comm.notes.append(f"gossip ({spec.mode}): {peers} neighbour(s) on a {spec.topology}, "
                          f"{exchange_s * 1e3:.2f} ms of messages")
        return comm


def meeting_wait_s(case: LocalCase) -> float:
    """A synchronous gossip step's wait at its exchange: the ranks meet their neighbours every step (a
    send and a receive each way, waited for), so the mean rank waits for the slower one as a synchronous
    step does, at least the kernels' side-by-side spread where they were timed (a private step's
    per-sample pass varies by 5-10% from step to step: 4.9-13.7 ms, measured 12-32 ms waiting), and
    at least the calibrated wait of ranks meeting (local.py takes the larger of the two likewise)."""
    return max(local_sync_wait_s(case), case.kernel_slowest_wait_s)


def asynchronous_estimate(name: str, case: ClusterCase, compute_s: float, comm_s: float,
                          memory_bytes: float) -> pst.StrategyEstimate:
    """Every worker at its own pace: its compute, plus whatever of its messages its compute does not hide.
    Staleness: the steps a worker takes per step of the slowest, beyond one (0 when all keep pace)."""
    w, n = case.workload, case.cluster.n_gpus
    slowdowns = np.asarray(case.slowdowns, dtype=float) if case.slowdowns else np.ones(n)
    computes = compute_s * slowdowns
    cycles = computes + np.maximum(comm_s - computes, 0.0)
    rate = float(np.sum(1.0 / cycles))  # steps per second, all workers together
    step_s = n / rate  # the mean time for every worker to take one step
    est = pst.StrategyEstimate(name, n, step_s, float(computes.mean()), comm_s,
                               float(np.mean(cycles - computes)), memory_bytes, n * w.batch_per_worker,
                               w.batch_per_worker / compute_s,
                               mean_staleness_steps=float(np.mean(cycles.max() / cycles - 1.0)))
    if len(set(slowdowns.tolist())) > 1:
        est.notes.append(f"asynchronous: a {slowdowns.max():g}x slower worker slows only itself")
    return est
