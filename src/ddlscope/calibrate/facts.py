"""`workload_facts`: the torch side of `ddlscope predict-run`, one rank's step as the local predictor reads it."""

from __future__ import annotations

import copy
import json
import statistics
import time
from typing import Any, Callable

# Steps timed by the kernel benchmark (after the warm-up ones): enough for a stable median of a step
# that takes milliseconds, few enough that predict-run stays a second or two per run.
KERNEL_WARMUP_STEPS, KERNEL_TIMED_STEPS = 3, 9


def workload_facts(experiment_config: dict[str, Any], *, time_kernels: bool = False) -> dict[str, Any]:
    """FLOPs, op counts and parameter bytes of one rank's training step (forward + backward), from
    the step profiler (runtime/profiler.py) with its op-counting pass: a small model's CPU step is
    mostly per-op overhead, not FLOPs. With `time_kernels`, also the step's own kernels timed alone
    in this process (`kernel_times`)."""
    from ddlscope.runtime.config import experiment_from_dict
    from ddlscope.runtime.profiler import profile_task
    from ddlscope.strategies import runtime_class
    from ddlscope.workloads import WORKLOADS

    exp = experiment_from_dict(json.loads(json.dumps(experiment_config)))
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    per_rank = exp.per_rank_batch()
    step = profile_task(task, per_rank, count_ops=True)
    assert step.ops is not None
    kernels = kernel_times(task, exp.workload, per_rank, exp.cluster.threads_per_rank,
                           runtime_class(exp.strategy).kernel_backward(exp.strategy)) if time_kernels else None
    return {
        "flops": step.flops,
        "ops": step.ops.ops,
        "gemm_flops": [mm.flops for mm in step.ops.matmuls if not mm.conv],  # per matmul (forward + backward)
        "gemm_size": [mm.effective_size for mm in step.ops.matmuls if not mm.conv],  # effective size (m k n)^(1/3)
        # each convolution's implicit GEMMs (the step profiler's im2col view), and the output channels
        # per group of each, which sets the rate a CPU convolution kernel reaches (calibrate/probes.py)
        "conv_flops": [mm.flops for mm in step.ops.matmuls if mm.conv],
        "conv_channels": [mm.n for mm in step.ops.matmuls if mm.conv],
        "conv_size": [mm.effective_size for mm in step.ops.matmuls if mm.conv],
        "other_op_bytes": step.ops.other_op_bytes,  # bytes moved by the step's non-matmul ops
        "param_numel": list(step.param_numel),
        "param_dim0": list(step.param_dim0),
        "param_bytes": step.param_bytes,
        # per FSDP unit, then the root's own parameters; 4 bytes a parameter (fp32), as always counted here
        "fsdp_units": [4 * numel for numel in (*step.unit_param_numel, step.root_param_numel)],
        "optimizer": exp.workload.optimizer,
        "momentum": exp.workload.momentum,
        "per_rank_batch": per_rank,
        **({"kernels": kernels} if kernels else {}),
    }


def facts_key(experiment_config: dict[str, Any]) -> str:
    """What `workload_facts` of a run depends on: its workload and per-rank batch, and its strategy
    where the strategy times a gradient pass of its own (Strategy.kernel_backward). Runs with equal
    keys share facts (benchmarks/predict_local.py times each key's kernels once)."""
    from ddlscope.runtime.config import experiment_from_dict
    from ddlscope.strategies import runtime_class

    exp = experiment_from_dict(json.loads(json.dumps(experiment_config)))
    own_backward = runtime_class(exp.strategy).kernel_backward(exp.strategy) is not None
    return json.dumps([experiment_config["workload"], exp.per_rank_batch(),
                       experiment_config["strategy"] if own_backward else None], sort_keys=True)


def kernel_times(task: Any, workload: Any, per_rank: int, threads: int,
                 backward: Callable[[Any, Any, Any, Any], None] | None = None) -> dict[str, Any]:
    """Median time of one rank's batch read, forward (with the loss), backward and optimizer step (with
    zero_grad; the workload's optimizer over the whole model), alone in this process with the rank's
    intra-op threads: the workload's own kernels benchmarked on this machine. `backward`: the
    strategy's own gradient pass where it replaces `loss.backward()` (Strategy.kernel_backward: a
    private step's per-sample gradients), timed as the backward.

    A one-device profile is what trace-driven predictors start from (Daydream, Zhu et al. 2020); here
    it stands in for the FLOP model where CPU kernels run far from their FLOP or byte rates: a
    convolution's weight gradient, max-pooling with indices and group norm run several times slower
    than the convolution probe's and the copy rate predict (docs/calibrate.md). The distributed part
    (contention between ranks, turn-taking for cores, communication) stays the model's."""
    import torch

    from ddlscope.runtime.loop import make_optimizer

    model = copy.deepcopy(task.model).train()  # the task's own model stays untouched
    optimizer = make_optimizer(model, workload)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    ids = torch.arange(per_rank)
    read_s, forward_s, backward_s, optimizer_s = [], [], [], []
    try:
        for i in range(KERNEL_WARMUP_STEPS + KERNEL_TIMED_STEPS):
            t0 = time.perf_counter()
            x, y = task.train.get(ids % len(task.train))
            t1 = time.perf_counter()
            loss = task.loss_fn(model(x), y)
            t2 = time.perf_counter()
            if backward is None:
                loss.backward()
            else:
                backward(model, task.loss_fn, x, y)
            t3 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            if i >= KERNEL_WARMUP_STEPS:
                read_s.append(t1 - t0)
                forward_s.append(t2 - t1)
                backward_s.append(t3 - t2)
                optimizer_s.append(t4 - t3)
    finally:
        torch.set_num_threads(previous_threads)
    median = statistics.median
    return {"data_s": median(read_s), "forward_s": median(forward_s), "backward_s": median(backward_s),
            "optimizer_s": median(optimizer_s), "steps": KERNEL_TIMED_STEPS, "threads": threads,
            "strategy_backward": backward is not None}
