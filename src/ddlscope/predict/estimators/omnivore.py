"""`omnivore`: a group all-reduce, then the group leader's push and pull, asynchronous across groups.

Cluster scale: a group's cycle is its slowest member's compute + the
gradient all-reduce inside the group + the leader's exchange with the
servers (alone: one push and one pull) + the model's broadcast inside the
group (priced as the all-gather of its shards, what a pipelined broadcast
moves). The groups cycle on their own; the servers cap the update rate at
`groups` concurrent exchanges, as ps-async's do with `workers`. A step is the
time for every group to push once.

This machine: the group's all-reduce and broadcast from the calibrated gloo
table (or the emulated link, if slower), two flat copies each, and the
parameter-server part as ps-async's (ps-sync's for one group) with `groups`
clients: the leaders.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ddlscope.calibrate.model import message_s
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, LocalCase, LocalComm, LocalStep, split_slowdowns
from ddlscope.predict.estimators.ps import PSAsyncEstimator, PSEstimator, PSSyncEstimator, ps_exchange_s
from ddlscope.specs.strategies.omnivore import OmnivoreSpec, group_members
from ddlscope.specs.strategies.ps import PSAsyncSpec, PSSyncSpec


def groups_on(spec: OmnivoreSpec, gpus: int) -> int:
    """The spec's groups on a cluster of `gpus`: the largest divisor of it not above `groups`."""
    return max(k for k in range(1, min(spec.groups, gpus) + 1) if gpus % k == 0)


def group_exchange_s(case: ClusterCase, size: int) -> tuple[float, float]:
    """(the gradient all-reduce, the model broadcast) inside a group of `size` GPUs on the case's cluster."""
    if size == 1:
        return 0.0, 0.0
    w, cluster = case.workload, case.cluster
    per_node = min(size, cluster.gpus_per_node)
    grad_bytes = w.params * w.grad_bytes_per_param
    all_reduce = float(coll.all_reduce_s(grad_bytes, size, per_node, cluster.node))
    broadcast = float(coll.all_gather_s(grad_bytes / size, size, per_node, cluster.node))
    return all_reduce, broadcast


def omnivore_estimate(spec: OmnivoreSpec, case: ClusterCase, memory_bytes: float) -> pst.StrategyEstimate:
    w, n = case.workload, case.cluster.n_gpus
    k = groups_on(spec, n)
    size = n // k
    slowdowns = split_slowdowns(spec, case) or [1.0] * n
    c_each = pst.compute_s(w, case.cluster) * np.asarray(slowdowns, dtype=float)
    c_group = np.array([c_each[members].max() for members in group_members(n, k)])
    all_reduce, broadcast = group_exchange_s(case, size)
    alone = ps_exchange_s(w, case.cluster, case.server, 1)
    cycles = c_group + all_reduce + alone + broadcast
    capacity = k / ps_exchange_s(w, case.cluster, case.server, k, updates=k)  # group pushes a second
    rate = min(float(np.sum(1.0 / cycles)), capacity)
    step = k / rate  # every group pushes once
    comm = all_reduce + alone + broadcast
    est = pst.StrategyEstimate(spec.name, n, step, float(c_each.mean()), comm, max(step - float(c_each.mean()), 0.0),
                               memory_bytes, k * size * w.batch_per_worker,  # every group pushes once a step
                               pst.single_samples_per_s(w, case.cluster),
                               mean_staleness_steps=max(float(rate * np.mean(cycles) - 1.0), 0.0))
    est.notes.append(f"omnivore: {k} group(s) of {size}: all-reduce {all_reduce * 1e3:.2f} ms and broadcast "
                     f"{broadcast * 1e3:.2f} ms inside a group, the leader's push and pull {alone * 1e3:.2f} ms")
    if rate >= capacity:
        est.notes.append("server-bound: the servers' links or CPUs cap the groups' update rate")
    return est


@ESTIMATORS.register(OmnivoreSpec)
class OmnivoreEstimator(PSEstimator):
    mode = "async"

    def cluster(self, spec: OmnivoreSpec, case: ClusterCase) -> pst.StrategyEstimate:  # type: ignore[override]
        return omnivore_estimate(spec, case, self.cluster_memory(spec, case)[0])

    def cluster_memory(self, spec: OmnivoreSpec, case: ClusterCase) -> tuple[float, float | None]:  # type: ignore[override]
        worker, server = super().cluster_memory(spec, case)
        # + the flat gradient the group averages and the flat model the leader broadcasts
        return worker + 2 * case.workload.params * case.weight_bytes_per_param, server

    def local_compute_extra_s(self, spec: OmnivoreSpec, case: LocalCase) -> tuple[float, list[str]]:  # type: ignore[override]
        """While a group computes, the servers serve the other groups' leaders: ps-async's loss of compute
        with the k leaders as its workers (none for one group, which runs as ps-sync)."""
        if spec.groups == 1:
            return 0.0, []
        return PSAsyncEstimator().local_compute_extra_s(PSAsyncSpec(servers=spec.servers),
                                                        replace(case, world=spec.groups))

    def local_comm(self, spec: OmnivoreSpec, case: LocalCase, step: LocalStep) -> LocalComm:  # type: ignore[override]
        """A group's step, all of it blocking (strategies/omnivore.py): the gradient all-reduce inside the
        group, the leader's push and pull (the members wait in the broadcast meanwhile), the model's
        broadcast. Across groups nothing blocks: one group's exchange with the servers runs while another
        averages or broadcasts, so the leaders (ps-async's clients, with the group's collectives in their
        cycle) are staggered and queue at the servers only when these are saturated, not behind every
        other leader as equal ps-async workers do."""
        k = spec.groups
        size = case.world // k
        group_s = 0.0
        if size > 1:
            all_reduce_s = message_s(case.profile, "all_reduce", case.param_bytes, size, case.link)
            broadcast_s = message_s(case.profile, "broadcast", case.param_bytes, size, case.link)
            copies_s = 2 * 2 * case.param_bytes / case.memory_bandwidth_bytes_per_s * step.stretch
            group_s = all_reduce_s + broadcast_s + copies_s
        # The servers hear from the k leaders: ps-async's round with k clients (ps-sync's for one group).
        leaders = replace(case, world=k)
        if k == 1:
            comm = PSSyncEstimator().local_comm(PSSyncSpec(servers=spec.servers), leaders, step)
        else:
            comm = PSAsyncEstimator().local_comm(PSAsyncSpec(servers=spec.servers), leaders, step,
                                                 between_pushes_s=group_s, staggered=size > 1)
        if size > 1:
            comm.comm_s += group_s
            comm.notes.append(f"omnivore: inside a group of {size}, the gradient all-reduce {all_reduce_s * 1e3:.2f} ms "
                              f"and the model broadcast {broadcast_s * 1e3:.2f} ms; the {k} leaders reach the "
                              f"servers apart, queueing only where these are saturated")
        return comm
