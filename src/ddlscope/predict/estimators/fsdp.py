"""`fsdp`: parameters gathered per unit for forward and backward, gradients reduce-scattered."""

from __future__ import annotations

from dataclasses import replace

from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, state_tensors
from ddlscope.calibrate.model import (OPS_PER_PARAM_OPTIMIZER, emulated_s, interpolate_linear, machine_probe, message_s,
                                     required, shard_bytes)
from ddlscope.predict.catalogue import Cluster
from ddlscope.specs import ConfigError
from ddlscope.specs.strategies.fsdp import FSDPSpec


def fsdp(workload: pst.Workload, cluster: Cluster, zero_stage: int = 3, jitter_cv: float = 0.0,
         prefetch: bool = True) -> pst.StrategyEstimate:
    """ZeRO / FSDP: parameters gathered before use (stage 3), gradients reduce-scattered, states sharded.

    Stage 3 gathers the weights for forward and again for backward, and
    reduce-scatters gradients (3 collectives of the 16-bit weights per step);
    with prefetch each overlaps the compute of the previous unit, so only
    what exceeds the compute shows.
    """
    if zero_stage not in (1, 2, 3):
        raise ConfigError(f"zero_stage = {zero_stage}: allowed: 1, 2, 3")
    n, g = cluster.n_gpus, cluster.gpus_per_node
    c = pst.compute_s(workload, cluster)
    backward = workload.backward_fraction * c
    forward = c - backward
    units = max(workload.layers, 1)
    weight_bytes = workload.weight_bytes_per_param * workload.params
    # one collective per unit (layer): each pays its own latency
    gather = units * float(coll.all_gather_s(weight_bytes / units, n, min(n, g), cluster.node))
    scatter = units * float(coll.reduce_scatter_s(weight_bytes / units, n, min(n, g), cluster.node))
    if zero_stage == 3:
        comm = 2 * gather + scatter
        if prefetch:
            exposed = max(gather - forward, 0.0) + max(gather + scatter - backward, 0.0) + gather / units
        else:
            exposed = comm
    else:  # stages 1-2: reduce-scatter behind backward, all-gather of updated weights after the step
        comm = scatter + gather
        exposed = max(scatter - backward, 0.0) + gather
    step = c + exposed + pst.straggler_wait_s(c, n, jitter_cv)
    p, wb = workload.params, workload.weight_bytes_per_param
    optimizer = workload.state_bytes_per_param - 2 * wb
    states = {1: wb * p + wb * p + optimizer * p / n, 2: wb * p + (wb + optimizer) * p / n,
              3: workload.state_bytes_per_param * p / n}[zero_stage]
    buffers = 2 * weight_bytes / units if zero_stage == 3 else 0.0  # gathered units in flight
    mem = states + buffers + workload.activation_bytes_per_sample * workload.batch_per_worker
    return pst.StrategyEstimate(f"fsdp-zero{zero_stage}", n, step, c, comm, exposed, mem,
                                n * workload.batch_per_worker, pst.single_samples_per_s(workload, cluster))


@ESTIMATORS.register(FSDPSpec)
class FSDPEstimator(Estimator):
    def cluster(self, spec: FSDPSpec, case: ClusterCase) -> pst.StrategyEstimate:
        # the slowest worker sets every synchronous step: FSDP's collectives hide behind its longer compute
        slowest = replace(case.workload, achieved_fraction=case.workload.achieved_fraction / case.stragglers)
        return fsdp(slowest, case.cluster, 3)

    def cluster_memory(self, spec: FSDPSpec, case: ClusterCase) -> tuple[float, float | None]:
        units = case.workload.layers
        gathered = 2 * case.weight_bytes_per_param * case.workload.params / units  # the unit in use and the next
        return case.replicated_state_bytes / case.cluster.n_gpus + gathered + case.activation_bytes, None

    def communication_buffer_bytes(self, spec: FSDPSpec, param_bytes: float, largest_unit_bytes: float) -> float:
        return 2 * largest_unit_bytes  # the unit in use and the prefetched one, gathered

    def transformer_layout(self, spec: FSDPSpec, workers: int) -> dict[str, object] | None:
        # ZeRO-3 gathers parameters again for backward: FSDP's reshard_after_forward
        return {"dp": workers, "zero": 3} if spec.reshard_after_forward else None

    def local_optimizer_bytes(self, spec: FSDPSpec, case: LocalCase) -> float:
        return shard_bytes(case.facts, case.world)

    def local_optimizer_tensor_s(self, spec: FSDPSpec, case: LocalCase) -> float:
        """The calibrated per-tensor step on DTensor shards (every op through DTensor's dispatch), scaled
        from plain SGD to the run's optimizer as the plain-tensor figure is; that figure where the
        calibration predates the probe."""
        probe = machine_probe(case.profile, "fsdp", case.world)
        if probe is None or probe.optimizer_tensor_s is None:
            return case.per_tensor_s
        return float(probe.optimizer_tensor_s) * OPS_PER_PARAM_OPTIMIZER[case.optimizer_kind] / 2

    def local_memory(self, spec: FSDPSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        shard = shard_bytes(case.facts, case.world)  # dim-0 shards padded to ceil(dim0 / world)
        return {"worker": {"parameters": shard, "gradients": shard, "optimizer": state_tensors(case) * shard}}

    def local_comm(self, spec: FSDPSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """Per unit: the calibrated FSDP cost at its size (hooks, copies, its collectives on this
        machine), or, where an emulated link is slower, the smallest unit's cost + the link's time for
        its all-gathers and reduce-scatter. The probe times whole synchronised steps, as DDP's does."""
        units = [u for u in case.facts["fsdp_units"] if u > 0]
        if spec.wrap == "model":
            units = [int(case.param_bytes)]
        probe = machine_probe(case.profile, "fsdp", case.world)
        comm = LocalComm(holds_sync_wait=probe is not None)
        if probe is None:
            comm.notes.append("fsdp: the calibration has no FSDP per-unit probe (rerun ddlscope calibrate)")
        world, link = case.world, case.link
        for i, unit in enumerate(units):
            gathers = 1 if (i == len(units) - 1 and len(units) > 1) or not spec.reshard_after_forward else 2
            if probe is None:
                comm.comm_s += (gathers * message_s(case.profile, "all_gather", unit / world, world, link)
                                + message_s(case.profile, "reduce_scatter", unit, world, link))
                continue
            unit_s = required(probe.unit_overhead_s, "fsdp unit_overhead_s")
            machine_s = interpolate_linear(required(probe.unit_bytes, "fsdp unit_bytes"), unit_s, unit)
            if link is not None:
                link_s = (gathers * emulated_s(link, "all_gather", unit / world, world)
                          + emulated_s(link, "reduce_scatter", unit, world))
                # the emulated link waits out its own time; the machine's fixed cost (the smallest unit's) remains
                machine_s = max(machine_s, float(unit_s[0]) + link_s)
            comm.comm_s += machine_s
        tensor_s = unit_tensors_s(case, units, probe)
        if tensor_s:
            comm.comm_s += tensor_s
            comm.notes.append(f"fsdp: {extra_unit_tensors(case, units)} parameter tensors in units beyond the probe's "
                              f"2 per unit, {tensor_s * 1e3:.2f} ms")
        return comm


def extra_unit_tensors(case: LocalCase, units: list[int]) -> int:
    """Parameter tensors the units hold beyond the probe's 2 per unit (a Linear's weight and bias): the
    model's tensors less 2 per unit (the facts give tensors for the whole model, not per unit)."""
    return max(len(case.facts["param_numel"]) - 2 * len(units), 0)


def unit_tensors_s(case: LocalCase, units: list[int], probe: object) -> float:
    """FSDP2's per-tensor cost (hooks, copy-in and copy-out per parameter) for the tensors beyond the probe's
    per-unit two, at the calibrated `unit_tensor_s`; 0 for a calibration before that figure."""
    per_tensor_s = getattr(probe, "unit_tensor_s", None)
    return 0.0 if per_tensor_s is None else float(per_tensor_s) * extra_unit_tensors(case, units)
