"""`tp`: Megatron-LM tensor parallelism within a node: compute split t ways, two all-reduces of the
activations per block forward and two backward."""

from __future__ import annotations

import math
from typing import Any

from ddlscope.calibrate.model import machine_probe, message_s, required
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (
    ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, gpt_sizes, state_tensors)
from ddlscope.specs.strategies.tp import TPSpec


@ESTIMATORS.register(TPSpec)
class TPEstimator(Estimator):
    """Every GPU computes 1/t of each layer on the whole global batch: a data-parallel worker's
    compute, as for the pipeline. The all-reduces move the block's output activations; their size
    per sample is taken as the case's activation bytes per sample over 34 per layer (Korthikanti's
    s h b bytes unit), a rough stand-in the cluster case has no better figure for."""

    def cluster(self, spec: TPSpec, case: ClusterCase) -> pst.StrategyEstimate:
        w = case.workload
        t = spec.tp_degree(case.cluster.n_gpus)
        compute_s = pst.compute_s(w, case.cluster) * case.stragglers
        global_batch = w.batch_per_worker * case.cluster.n_gpus
        # a tp group's batch (1/dp of the global one) crosses its all-reduces
        activation_bytes = w.activation_bytes_per_sample * global_batch / spec.dp / max(w.layers, 1) / 34 * 2
        per_all_reduce = float(coll.all_reduce_s(activation_bytes, t, min(t, case.cluster.gpus_per_node),
                                                 case.cluster.node))
        comm_s = 4 * max(w.layers, 1) * per_all_reduce
        step_s = compute_s + comm_s
        memory, _ = self.cluster_memory(spec, case)
        return pst.StrategyEstimate("tp", case.cluster.n_gpus, step_s, compute_s, comm_s, comm_s, memory, global_batch,
                                    pst.single_samples_per_s(w, case.cluster),
                                    notes=["tensor-parallel all-reduces not overlapped (Megatron-LM)"])

    def cluster_notes(self, spec: TPSpec, case: ClusterCase) -> list[str]:
        if spec.tp_degree(case.cluster.n_gpus) > case.cluster.gpus_per_node:
            return [f"tensor parallel over {spec.tp_degree(case.cluster.n_gpus)} GPUs crosses nodes: not modelled (Megatron-LM keeps "
                    "it within a node; combine with data or pipeline parallelism, `ddlscope plan`)"]
        return []

    def cluster_memory(self, spec: TPSpec, case: ClusterCase) -> tuple[float, float | None]:
        t = spec.tp_degree(case.cluster.n_gpus)
        if t > case.cluster.gpus_per_node:
            return math.inf, None  # see cluster_notes
        # activations: a worker's batch is 1/(dp t) of the global one; TP keeps about (10 + 24/t)/34 of
        # its group's batch (1/dp of the global one) per rank (Korthikanti et al. 2022), i.e. t (10 + 24/t)/34
        # of a worker's; FSDP over dp shards the states dp ways more
        return case.replicated_state_bytes / case.cluster.n_gpus + case.activation_bytes * t * (10 + 24 / t) / 34, None

    def local_compute_stretch(self, spec: TPSpec, case: LocalCase) -> float | None:
        """1/t of the blocks' compute on the whole batch (the rest replicated is counted whole: an
        overestimate for a model whose embeddings and head weigh much)."""
        return case.side_by_side_stretch() / case.world

    def local_optimizer_bytes(self, spec: TPSpec, case: LocalCase) -> float:
        return _rank_param_bytes(spec, case)

    def local_memory(self, spec: TPSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        mine = int(_rank_param_bytes(spec, case))
        return {"worker": {"parameters": mine, "gradients": mine, "optimizer": mine * state_tensors(case)}}

    def local_compute_extra_s(self, spec: TPSpec, case: LocalCase) -> tuple[float, list[str]]:
        """Inside each block's forward and backward: the all-reduces of its activations (the probe's traced
        count, each of ratio x batch x seq x hidden fp32 elements, from the calibrated gloo table at the tp
        degree) and DTensor's dispatch of every op on a shard (the traced op count x the probe's per-op
        cost, timed with every rank stepping the block at once). A calibration without the [tp] probe: Megatron's four
        all-reduces of the block's activations, no dispatch (noted)."""
        sizes = gpt_sizes(case.workload)
        if sizes is None:
            return 0.0, ["tp: the workload's layers, hidden and seq_len are not in its config: the activation "
                         "all-reduces and DTensor's dispatch are not priced"]
        layers, activation_elements = sizes
        t = spec.tp_degree(case.world)
        probe = machine_probe(case.profile, "tp", t)
        all_reduces = MEGATRON_BLOCK_ALL_REDUCES if probe is None else int(required(probe.block_all_reduces,
                                                                                    "tp.block_all_reduces"))
        ratio = 1.0 if probe is None else float(required(probe.all_reduce_activation_ratio,
                                                           "tp.all_reduce_activation_ratio"))
        payload_bytes = ratio * activation_elements / spec.dp * 4
        all_reduce_s = message_s(case.profile, "all_reduce", payload_bytes, t, case.link)
        # Not stretched: the probe times the block on every rank at once, as the run's ranks step, so its
        # per-op cost holds their contention for the cores already.
        dispatch_s = 0.0 if probe is None else (int(required(probe.block_dispatch_ops, "tp.block_dispatch_ops"))
                                                 * dispatch_op_at_s(probe, activation_elements / spec.dp))
        notes = [f"tp: per block {all_reduces} all-reduces of {payload_bytes / 1e3:.0f} kB ({all_reduce_s * 1e3:.2f} ms "
                 f"each) and DTensor's dispatch {dispatch_s * 1e3:.2f} ms, {layers} blocks"]
        if probe is None:
            notes.append("tp: no [tp] probe in the calibration (re-run `ddlscope calibrate`): DTensor's dispatch "
                         "is not priced, Megatron's 4 all-reduces per block are")
        return layers * (all_reduces * all_reduce_s + dispatch_s), notes

    def local_comm(self, spec: TPSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """The all-reduces happen inside the blocks' forward and backward (local_compute_extra_s)."""
        return LocalComm(0.0)


# Megatron-LM's layout: the attention's and the MLP's row-parallel outputs in forward, the column-parallel
# inputs' gradients in backward (what the probe's trace of torch's plan counts too).
MEGATRON_BLOCK_ALL_REDUCES = 4


def _rank_param_bytes(spec: TPSpec, case: LocalCase) -> float:
    """The blocks (the facts' FSDP units) split t ways, the rest (embeddings, final norm, head: the root)
    whole, then everything dp ways by FSDP; the blocks' norms and rowwise biases, replicated by tp, are
    left in the split (small)."""
    units = case.facts["fsdp_units"]
    return (sum(units[:-1]) / spec.tp_degree(case.world) + units[-1]) / spec.dp


def dispatch_op_at_s(probe: Any, activation_elements: float) -> float:
    """DTensor's cost per op of a block whose activations hold `activation_elements` (batch x seq x hidden):
    through the probe's two block sizes, linear in the elements' logarithm (measured at 2 ranks: 77, 211 and
    262 us an op at 1e3, 3e4 and 1.3e5 elements: slower than in proportion), never below the smaller block's
    cost; the one figure of a calibration from before the two sizes."""
    single = float(required(probe.dispatch_op_s, "tp.dispatch_op_s"))
    costs, sizes = probe.dispatch_op_s_by_size, probe.activation_elements
    if not costs or not sizes or len(costs) < 2 or not 0 < sizes[0] < sizes[1]:
        return single
    slope = (costs[1] - costs[0]) / math.log(sizes[1] / sizes[0])
    return max(costs[0] + slope * math.log(max(activation_elements, 1.0) / sizes[0]), costs[0])
