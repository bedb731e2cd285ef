"""`workload_facts`: the torch side of `ddlscope predict-run`, one rank's step as the local predictor reads it."""

from __future__ import annotations

import json
from typing import Any


def workload_facts(experiment_config: dict[str, Any]) -> dict[str, Any]:
    """FLOPs, op counts and parameter bytes of one rank's training step (forward + backward), from
    the step profiler (runtime/profiler.py) with its op-counting pass: a small model's CPU step is
    mostly per-op overhead, not FLOPs."""
    from ddlscope.runtime.config import experiment_from_dict
    from ddlscope.runtime.profiler import profile_task
    from ddlscope.workloads import WORKLOADS

    exp = experiment_from_dict(json.loads(json.dumps(experiment_config)))
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    per_rank = exp.per_rank_batch()
    step = profile_task(task, per_rank, count_ops=True)
    assert step.ops is not None
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
    }
