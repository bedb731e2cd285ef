"""A pipeline partition for an experiment: profile its layers here, search (predict/partition.py), compare.

The layers are profiled once, on one micro-batch (runtime/profiler.py:profile_layers); a larger or
smaller micro-batch scales their times and activations in proportion (parameters stay), which is
how the largest micro-batch under a memory limit is found without profiling each size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from ddlscope.predict.partition import Layer, Plan, partition, pipeline_step_s, plan_of_cuts
from ddlscope.calibrate.layer_profile import rank_threads, workload_batch
from ddlscope.runtime.profiler import optimizer_states_per_param, profile_layers
from ddlscope.specs import ConfigError, Experiment
from ddlscope.specs.strategies.pipeline import equal_block_cuts

MAX_MICRO_BATCH = 4096


@dataclass(frozen=True)
class PartitionReport:
    stages: int
    micro_batches: int
    micro_batch: int  # samples
    schedule: str
    memory_limit_bytes: float
    layers: list[Layer]
    balanced: Plan | None  # the exact search's plan, None when nothing fits
    equal: Plan  # equal blocks per stage, no recompute
    largest_micro_batch: dict[str, int]  # balanced, balanced+recompute, equal -> samples (0: none fits)

    def predicted_step_s(self, plan: Plan) -> float:
        return pipeline_step_s([s.time_s for s in plan.stages], self.micro_batches, 1, self.schedule)

    def to_dict(self) -> dict[str, Any]:
        def plan_dict(plan: Plan | None) -> dict[str, Any] | None:
            if plan is None:
                return None
            return {"cuts": plan.cuts, "recompute": [i for i, s in enumerate(plan.stages) if s.recompute],
                    "slowest_stage_s": plan.slowest_s, "fullest_stage_bytes": plan.fullest_bytes,
                    "predicted_step_s": self.predicted_step_s(plan),
                    "stages": [{"layers": [s.start, s.stop], "recompute": s.recompute, "time_s": s.time_s,
                                "memory_bytes": s.memory_bytes} for s in plan.stages]}

        return {"stages": self.stages, "micro_batches": self.micro_batches, "micro_batch": self.micro_batch,
                "schedule": self.schedule, "memory_limit_bytes": self.memory_limit_bytes,
                "layers": [asdict(l) for l in self.layers],
                "balanced": plan_dict(self.balanced), "equal": plan_dict(self.equal),
                "largest_micro_batch": self.largest_micro_batch}


def layer_costs(exp: Experiment, micro_batch: int) -> list[Layer]:
    """The experiment's model, layer by layer, on one micro-batch of its training data (the threads a
    rank runs with): the task and batch as `calibrate --model` builds them (calibrate/layer_profile.py)."""
    task, x, y = workload_batch(exp, micro_batch)
    if not hasattr(task.model, "pipeline_layers"):
        raise ConfigError(f"workload.name = {exp.workload.name!r}: its model does not split into pipeline layers; "
                          "use a GPT workload (gpt-char, gpt-synthetic)")
    with rank_threads(exp.cluster.threads_per_rank):
        profiled = profile_layers(task.model, task.loss_fn, x, y)
    return [Layer(p.forward_s, p.backward_s, p.param_bytes, p.activation_bytes, p.input_bytes, p.name) for p in profiled]


def state_bytes_per_param_byte(exp: Experiment) -> float:
    """Weights + gradients + optimizer state, per weight byte."""
    spec = exp.workload
    return 2.0 + optimizer_states_per_param(spec.optimizer, spec.momentum)


def scaled(layers: list[Layer], factor: float) -> list[Layer]:
    """The layers on a micro-batch `factor` times as large: time and activations in proportion."""
    return [replace(l, forward_s=l.forward_s * factor, backward_s=l.backward_s * factor,
                    activation_bytes=l.activation_bytes * factor, input_bytes=l.input_bytes * factor) for l in layers]


def largest_micro_batch(layers: list[Layer], micro_batch: int, stages: int, micro_batches: int, limit_bytes: float,
                        schedule: str, state_factor: float, cuts: list[int] | None = None,
                        allow_recompute: bool = False) -> int:
    """The largest micro-batch (samples) whose plan fits `limit_bytes` on every stage: the exact search's,
    or the fixed `cuts` (no recompute). Memory grows with the micro-batch, so a bisection finds it."""
    def fits(b: int) -> bool:
        at_b = scaled(layers, b / micro_batch)
        if cuts is not None:
            return plan_of_cuts(at_b, cuts, micro_batches, schedule, None, state_factor).fullest_bytes <= limit_bytes
        return partition(at_b, stages, micro_batches, limit_bytes, schedule, allow_recompute, state_factor) is not None

    low, high = 0, MAX_MICRO_BATCH  # fits(low) holds (0 samples: no activations) or nothing fits at all
    if not fits(1):
        return 0
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def partition_report(exp: Experiment, stages: int, memory_limit_bytes: float, micro_batches: int, schedule: str,
                     allow_recompute: bool = True) -> PartitionReport:
    """Profile, search, and price the equal-layer partition beside it."""
    layers_count = getattr(exp.workload, "layers", None)
    if not isinstance(layers_count, int):
        raise ConfigError(f"workload.name = {exp.workload.name!r}: its model does not split into pipeline layers; "
                          "use a GPT workload (gpt-char, gpt-synthetic)")
    if stages > layers_count:
        raise ConfigError(f"--stages {stages}: more stages than the model's {layers_count} blocks "
                          "(the equal-layer partition gives every stage a block)")
    if exp.workload.batch_size % micro_batches:
        raise ConfigError(f"workload.batch_size = {exp.workload.batch_size}: must be divisible by "
                          f"--micro-batches {micro_batches}")
    micro_batch = exp.workload.batch_size // micro_batches
    layers = layer_costs(exp, micro_batch)
    factor = state_bytes_per_param_byte(exp)
    equal_cuts = equal_block_cuts(layers_count, stages)
    largest = {
        "balanced": largest_micro_batch(layers, micro_batch, stages, micro_batches, memory_limit_bytes, schedule, factor),
        "balanced+recompute": largest_micro_batch(layers, micro_batch, stages, micro_batches, memory_limit_bytes,
                                                  schedule, factor, allow_recompute=True) if allow_recompute else 0,
        "equal": largest_micro_batch(layers, micro_batch, stages, micro_batches, memory_limit_bytes, schedule, factor,
                                     cuts=equal_cuts),
    }
    return PartitionReport(
        stages=stages, micro_batches=micro_batches, micro_batch=micro_batch, schedule=schedule,
        memory_limit_bytes=memory_limit_bytes, layers=layers,
        balanced=partition(layers, stages, micro_batches, memory_limit_bytes, schedule, allow_recompute, factor),
        equal=plan_of_cuts(layers, equal_cuts, micro_batches, schedule, None, factor), largest_micro_batch=largest)
