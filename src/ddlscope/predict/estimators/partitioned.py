"""`partitioned`: a part of the model per GPU, each trained on its own loss; activations go forward only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (
    ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, forward_share, state_tensors)
from ddlscope.predict.estimators.pipeline import gpt_layer_flops
from ddlscope.specs.strategies.partitioned import PartitionedSpec, even_cuts
from ddlscope.specs.strategies.pipeline import stage_ranges

# A part's forward as a share of its forward + backward (backward ~ 2 forwards).
FORWARD_SHARE = 1 / 3


def chain_wait_fraction(parts: int) -> float:
    """Idle over compute of a step: part k starts when part k - 1's forward has arrived, and every rank
    waits for the last part's loss (shared each step), so a step lasts (parts - 1) forwards longer than
    a part's own forward + backward."""
    return (parts - 1) * FORWARD_SHARE


@ESTIMATORS.register(PartitionedSpec)
class PartitionedEstimator(Estimator):
    """One part per GPU, the layers split evenly, every GPU on the whole global batch: a part computes
    1/p of the model on it, what a data-parallel worker computes on its 1/p of the batch (the case's
    compute_s); the forward chain adds (p - 1) part forwards of waiting."""

    def cluster(self, spec: PartitionedSpec, case: ClusterCase) -> pst.StrategyEstimate:
        p, w = case.cluster.n_gpus, case.workload
        compute_s = pst.compute_s(w, case.cluster) * case.stragglers
        idle_s = compute_s * chain_wait_fraction(p)
        step_s = compute_s + idle_s
        memory, _ = self.cluster_memory(spec, case)
        return pst.StrategyEstimate("partitioned", p, step_s, compute_s, 0.0, idle_s, memory, w.batch_per_worker * p,
                                    pst.single_samples_per_s(w, case.cluster),
                                    notes=["partitioned: each part trains on its own synthetic-target loss, not the "
                                           "end-to-end model (accuracy differs); activation sends not priced"])

    def cluster_memory(self, spec: PartitionedSpec, case: ClusterCase) -> tuple[float, float | None]:
        # 1/p of the model's states; its activations for the whole global batch, which is what a
        # data-parallel worker's activation_bytes (the whole model on 1/p of the batch) amounts to
        return case.replicated_state_bytes / case.cluster.n_gpus + case.activation_bytes, None

    def local_compute_share(self, spec: PartitionedSpec, case: LocalCase) -> float:
        """A rank computes its part only, on the whole batch: the mean part's forward + backward over the whole
        model's (1/p where the layers' sizes are unknown; less where the parts skip their inputs' gradients)."""
        parts = part_times(spec, case)
        return sum(f + b for f, b in parts) / len(parts) / sum(whole_kernels_s(case))

    def local_optimizer_bytes(self, spec: PartitionedSpec, case: LocalCase) -> float:
        return case.param_bytes / case.world

    def local_memory(self, spec: PartitionedSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        mine = int(case.param_bytes / case.world)
        return {"worker": {"parameters": mine, "gradients": mine, "optimizer": mine * state_tensors(case)}}

    def local_comm(self, spec: PartitionedSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """The chain's wait: a step lasts until the last rank's backward ends (every rank then shares the last
        part's loss), and what of that the mean rank does not compute it waits (`chain_step_s`)."""
        share = self.local_compute_share(spec, case)
        stretch = step.stretch / share if share > 0 else 1.0
        step_s = chain_step_s(part_times(spec, case), stretch)
        idle_s = max(step_s - (step.forward_s + step.backward_s), 0.0)
        return LocalComm(idle_s, notes=[f"partitioned: the forward chain's wait {idle_s * 1e3:.2f} ms: part k starts "
                                        f"when part k - 1's forward arrives; each part's backward skips its input's "
                                        f"gradient; the activation sends are not priced"])


# The digits' images and classes (workloads/digits.py, which imports torch: not imported here).
DIGITS_PIXELS, DIGITS_CLASSES = 64, 10


@dataclass(frozen=True)
class LayerCosts:
    """The model's layer sequence (what the runtime cuts into parts) as FLOPs a sample or token."""

    forward: list[float]  # each layer's forward
    input_grad: list[float]  # what its backward spends on its input's gradient (none where no grad is needed)
    with_params: list[int]  # the layers with parameters, where even cuts fall
    output_elements: list[float]  # each layer's output a sample (what a part's local loss passes over)


def layer_costs(workload: dict[str, Any]) -> LayerCosts | None:
    """From the workload's config: mlp-digits' Linear / ReLU sequence (a Linear's input gradient is one more
    matmul the size of its forward; ReLU's FLOPs none); a GPT's embedding, blocks and head (a part there starts
    with a norm or the embedding: its input gradient is memory-bound, left out); None for other workloads."""
    if workload.get("name") == "mlp-digits":
        try:
            hidden, layers = int(workload["hidden"]), int(workload["layers"])
        except (KeyError, TypeError, ValueError):
            return None
        widths = [DIGITS_PIXELS, *[hidden] * layers, DIGITS_CLASSES]
        linears = [2.0 * a * b for a, b in zip(widths, widths[1:])]
        forward = [f for linear in linears[:-1] for f in (linear, 0.0)] + [linears[-1]]
        outputs = [float(w) for w in widths[1:-1] for _ in range(2)] + [float(DIGITS_CLASSES)]
        return LayerCosts(forward, list(forward), list(range(0, len(forward), 2)), outputs)
    flops = gpt_layer_flops(workload)
    if flops is None:
        return None
    token = float(workload["seq_len"]) * float(workload["hidden"])  # a block's output a sample (the head's unused)
    return LayerCosts(flops, [0.0] * len(flops), list(range(len(flops))), [token] * len(flops))


def whole_kernels_s(case: LocalCase) -> tuple[float, float]:
    """The whole model's forward and backward alone (the facts' kernels, else the FLOPs' split of alone_s)."""
    kernels = case.facts.get("kernels")
    if kernels:
        return float(kernels["forward_s"]), float(kernels["backward_s"])
    forward_s = case.alone_s * forward_share(case.facts)
    return forward_s, case.alone_s - forward_s


def part_times(spec: PartitionedSpec, case: LocalCase) -> list[tuple[float, float]]:
    """Each part's forward and backward (with its own loss) alone, as shares of the whole model's kernels.

    Forward: the part's layers' share of the forward FLOPs. Backward: a part's input is the previous part's
    detached output (or the data), so its backward computes every layer's weight gradient and every input
    gradient but its first layer's; the whole model's skips only the first layer's. On mlp-digits x2 (64 ->
    512 -> 512 -> 512 -> 10, cut before the third Linear) the parts' backwards sum to 0.76 of the whole's (0.80
    timed in one process, each part on a detached input): the second part's first Linear is most of its FLOPs.
    Equal parts, no local loss priced, where the layers' sizes are unknown."""
    forward_s, backward_s = whole_kernels_s(case)
    costs, parts = layer_costs(case.workload), case.world
    if costs is None or (not spec.partition and len(costs.with_params) < parts):
        return [(forward_s / parts, backward_s / parts)] * parts
    cuts = list(spec.partition) or even_cuts(costs.with_params, parts)
    ranges = stage_ranges(cuts, len(costs.forward))
    whole_f = sum(costs.forward)
    whole_b = 2 * whole_f - costs.input_grad[0]
    batch = float(case.facts["per_rank_batch"])
    # A part's own loss runs after its output is sent on: it delays no other part, so it counts with the
    # part's backward. The last part's loss is the task's, which the kernels timed.
    return [(forward_s * sum(costs.forward[lo:hi]) / whole_f,
             backward_s * (2 * sum(costs.forward[lo:hi]) - costs.input_grad[lo]) / whole_b
             + (local_loss_s(case, batch * costs.output_elements[hi - 1]) if hi < len(costs.forward) else 0.0))
            for lo, hi in ranges]


# A part's local loss (strategies/partitioned.py local_loss) a step, in fp32 elements read and written per
# output element: forward, the targets gathered by label (2), the difference (3), squared (2), its mean (1);
# backward, the difference again (3) and scaled (2). Timed on mlp-digits 512x3 (part 0, 256 x 512 outputs, load
# ~5): 0.26 ms in forward and 0.17 in backward; priced 0.39 ms at the 17.6 GB/s of a quiet calibration.
LOCAL_LOSS_PASSES, LOCAL_LOSS_OPS = 13, 9


def local_loss_s(case: LocalCase, elements: float) -> float:
    """A part's mean squared error against its synthetic target over `elements` outputs, forward and backward:
    memory-bound passes at the calibrated bandwidth plus each op's overhead."""
    return LOCAL_LOSS_PASSES * 4 * elements / case.memory_bandwidth_bytes_per_s + LOCAL_LOSS_OPS * case.op_s


def chain_step_s(parts: list[tuple[float, float]], stretch: float) -> float:
    """A step of the chain: part k's forward starts when part k - 1's has ended and its output arrived, its
    backward follows its forward, and the step ends with the last backward to end (the last part's loss is
    shared with every rank). The first part's forward runs while every other rank waits for it, alone (at
    its kernels' speed); the rest run beside other ranks' work (at the side-by-side `stretch`)."""
    first_forward_s, first_backward_s = parts[0]
    forward_end_s, ends_s = first_forward_s, [first_forward_s + first_backward_s * stretch]
    for forward_s, backward_s in parts[1:]:
        forward_end_s += forward_s * stretch
        ends_s.append(forward_end_s + backward_s * stretch)
    return max(ends_s)
