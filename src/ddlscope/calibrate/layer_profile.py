"""`ddlscope calibrate --model`: one rank's forward and backward of the user's own model, layer by layer
and as a whole step, on this device (CUDA where there is one, else the CPU with a rank's threads).

The profile holds, for the workload's per-rank batch:

- `layers`: each piece of the model's split (runtime/profiler.py:model_split: the pipeline's layer
  sequence where the model is a chain, else its leaf-ish top-level children) and the loss, timed
  alone with its input as a leaf (median of `repeats` after a warm-up): forward_s, backward_s,
  parameter, activation and boundary bytes, FLOPs (FlopCounterMode);
- `step`: the whole forward + backward measured as one (calibrate/facts.py:kernel_times, the same
  timing `predict-run` uses), with the batch read and the optimizer step, at the batch and at
  smaller ones (`step_by_batch`), so a rank of a data-parallel run, which gets 1/N of the batch, is
  priced from measurements, not from a proportion;
- `overhead_s`: the whole step minus the sum of the pieces (what runs between them: the framework's
  per-layer costs, the glue of the forward, caches warmed by one piece for the next);
- `facts`: the step profiler's FLOPs, op count and parameter sizes (workload_facts), which the local
  predictor reads beside the times; `device`, its fp32 matmul rate, torch's version, the workload.

predict/from_profile.py composes multi-rank steps from it (torch-free).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

PROFILE_KIND = "ddlscope model profile"  # what predict/from_profile.py checks a file for
# The whole step at the batch, half and a quarter of it (distinct, >= 1): what 2 and 4 data-parallel
# ranks each compute.
BATCH_FRACTIONS = (1, 2, 4)
WARMUP = 2
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def device_name(device: str) -> str:
    """`cpu: <processor>` or `cuda: <GPU name>`: which device the figures were measured on."""
    import torch

    if device.startswith("cuda"):
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {_cpu_model() or platform.processor() or platform.machine()}"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@contextmanager
def rank_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set as a rank runs, put back afterwards."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def workload_batch(exp: Any, batch: int, device: str = "cpu") -> tuple[Any, Any, Any]:
    """The experiment's built task and its first `batch` training samples on `device`
    (what the pipeline partitioner and calibrate --model both profile)."""
    from ddlscope.runtime.profiler import first_batch
    from ddlscope.workloads import WORKLOADS

    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    x, y = first_batch(task.train, batch)
    return task, x.to(device), y.to(device)


def matmul_flops(device: str, n: int = 1024, repeats: int = 5) -> float:
    """This device's fp32 matmul FLOP/s at n x n (the best of `repeats`): on a CPU, what another CPU's
    calibrated rate at that size (calibrate/probes.py, fp32 too) is compared with when a profile is
    scaled to it."""
    import torch

    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        began = time.perf_counter()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return 2.0 * n**3 / best


def profile_model(experiment_config: dict[str, Any], repeats: int = 5,
                  progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The profile of the experiment's workload on one rank of this device (see the module docstring)."""
    import torch

    from ddlscope.calibrate.facts import kernel_times, workload_facts
    from ddlscope.runtime.config import experiment_from_dict
    from ddlscope.runtime.profiler import model_split, profile_modules

    exp = experiment_from_dict(json.loads(json.dumps(experiment_config)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, threads = exp.per_rank_batch(), exp.cluster.threads_per_rank
    progress("counting FLOPs, ops and parameters (the step profiler)")
    facts = workload_facts(experiment_config)
    with rank_threads(threads):
        task, x, y = workload_batch(exp, batch, device)
        model = copy.deepcopy(task.model).to(device).train()  # the task's own stays as built, for the whole step
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        split, pieces = model_split(model)
        progress(f"{len(pieces)} pieces ({split}) + the loss, {repeats} repeats each")
        layers = profile_modules(model, task.loss_fn, x, y, pieces, chain=split.startswith("layer sequence"),
                                 repeats=repeats, warmup=WARMUP)
        del model
        steps = {}
        for b in sorted({max(1, batch // f) for f in BATCH_FRACTIONS}, reverse=True):
            progress(f"the whole step at batch {b}")
            steps[b] = kernel_times(task, exp.workload, b, threads, device=device, timed_steps=repeats)
        rate = matmul_flops(device)
    whole = steps[batch]
    layer_sum_s = sum(l.forward_s + l.backward_s for l in layers)
    return {
        "kind": PROFILE_KIND,
        "meta": {"created_at": time.time(), "host": socket.gethostname(), "cores": os.cpu_count() or 1,
                 "torch": torch.__version__, "device": device_name(device), "device_type": device,
                 "threads": threads, "repeats": repeats, "load_average_1min": os.getloadavg()[0]},
        # the precision the times ran at: what a catalogue GPU's peak is taken at when they are scaled to another
        # (predict/from_profile.py:cluster_scale); TF32 is torch's switch for fp32 matmuls on a GPU (off by default)
        "device": {"name": device_name(device), "matmul_flops": rate, "dtype": DTYPE_NAMES.get(str(dtype), str(dtype)),
                   "tf32": bool(torch.backends.cuda.matmul.allow_tf32)},
        # pieces of the split that no hook timed (a module the forward never calls): their time is in overhead_s
        "untimed": [name for name, _ in pieces if name not in {l.name for l in layers}],
        "workload": _plain(exp.workload.model_dump(mode="json")),
        "batch": batch,
        "split": split,
        "layers": _columns([_plain(asdict(l)) for l in layers]),
        "step": _step_of(whole),
        "step_by_batch": {"batch": sorted(steps), **{key: [steps[b][key] for b in sorted(steps)]
                                                       for key in ("data_s", "forward_s", "backward_s",
                                                                   "optimizer_s")}},
        "layers_sum_s": layer_sum_s,
        # on a GPU, the pieces' CUDA kernels (torch.profiler): the stack's per-layer overhead is the sum beyond it
        **({"layers_kernel_s": sum(l.kernel_s or 0.0 for l in layers)} if device == "cuda" else {}),
        "overhead_s": whole["forward_s"] + whole["backward_s"] - layer_sum_s,
        "facts": _plain(facts),
    }


def _step_of(kernels: dict[str, Any]) -> dict[str, Any]:
    return {key: kernels[key] for key in ("data_s", "forward_s", "backward_s", "optimizer_s", "steps", "threads")}


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Rows as one list per key (a TOML table of arrays)."""
    return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


def _plain(data: Any) -> Any:
    """`data` without None values (TOML has no null), tuples as lists."""
    if isinstance(data, dict):
        return {str(k): _plain(v) for k, v in data.items() if v is not None}
    if isinstance(data, (list, tuple)):
        return [_plain(v) for v in data]
    return data


def summary_rows(profile: dict[str, Any]) -> list[tuple[str, float, float, int]]:
    """(name, forward_s, backward_s, flops) per piece, for the terminal."""
    layers = profile["layers"]
    return list(zip(layers["name"], layers["forward_s"], layers["backward_s"], layers["flops"]))


def write_model_profile(profile: dict[str, Any], path: Path) -> None:
    """The profile as TOML (JSON where the path ends in .json), written atomically."""
    from ddlscope.calibrate.profile import to_toml
    from ddlscope.store import atomic_output

    text = json.dumps(profile, indent=1) if path.suffix.lower() == ".json" else (
        "# ddlscope model profile (ddlscope calibrate --model)\n" + to_toml(profile))
    with atomic_output(path, what="model profile") as f:
        f.write(text)
