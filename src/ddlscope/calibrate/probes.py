"""The torch probes of `ddlscope calibrate`: what this process and launched gloo ranks measure.

What is measured, each with one intra-op thread per process as training ranks use:

- matmul: achieved fp32 FLOP/s of square matmuls from 64 to 1024, and a fit
  time = overhead + flops / peak, so small GEMMs (where per-call overhead
  dominates) and large ones are both described; bf16 at one size where supported.
- per-op overhead: the time of one tiny tensor op, what a small model's step
  is mostly made of on a CPU.
- memory bandwidth: a large tensor copy (read + write bytes / time).
- collectives on gloo for each world size: all_reduce, all_gather,
  reduce_scatter, broadcast and point-to-point (ping-pong / 2), message sizes
  ~1 KB .. tens of MB, a few repeats per size. Two fits per collective: the
  fastest repeat (`fastest`: what the link itself costs; interference only
  adds time) and the median repeat (the top-level alpha/beta: what a training
  step typically sees). On a shared 2-core machine they differ by 2-4x at
  megabyte sizes: gloo's threads and the other ranks' processes contend for
  the cores, and a step pays that every time.
- synchronisation, per world size: every rank runs a fixed block of matmuls
  alone (the others parked in a barrier) and then all together, each followed
  by a one-element all_reduce. `compute_stretch` = concurrent / alone compute
  time (shared caches and memory bandwidth, time slices lost to the other
  ranks), `sync_overhead_s` = the period of that loop minus the work (taking
  turns for a core when ranks outnumber cores) minus an empty all_reduce:
  what a rank waits at each step's synchronisation for the slowest rank and
  for gloo's threads to wake. On this 2-core machine it is about a
  millisecond: the same order as a small model's whole step.
- what DDP and FSDP add to a step, per world size, at model sizes from KiB
  to MiB (`_strategy_probes`): a model of Linear blocks stepped wrapped and
  unwrapped; the difference is the strategy's cost as a step pays it (hooks,
  bucket or shard copies, the collectives, gloo's threads competing with the
  compute they overlap). DDP per step against the model's bytes, FSDP per
  unit against the unit's bytes, and per parameter tensor in a unit beyond
  a Linear's two (`unit_tensor_s`: units of 4 Linear layers against units of
  one, at the smallest width).
- a parameter server's transport round, per world size (`_incast_probe`):
  all ranks but the last push a header and a message to the last, which
  answers each; the round's time as the workers see it, at a few sizes,
  back to back and with every worker computing a block before its push (the
  round and the compute then both stretch). Many senders to one receiver on
  shared cores cost more than two-rank ping-pong suggests.
- tensor parallel's DTensor, per world size (`_tp_probe`): from a
  TorchDispatchMode trace of one tiny GPT block split as strategies/tp.py
  splits it (forward + backward, counted, not timed), how many aten ops take
  a DTensor and how many all-reduces it makes, of what size against the
  block's activations; and DTensor's cost per such op: the block's step
  sharded less the same block whole less its all-reduces timed alone, over
  the op count (the block's compute is negligible at its width). A few
  seconds.
- torch's pipelining runtime, per world size (`_pipeline_probe`): a GPipe
  step of one Linear(8, 8) stage per rank over 4 micro-batches, over the
  2 (m + p - 1) actions on its critical path: what each schedule action
  costs beyond its compute (bookkeeping, posting and waiting on its sends
  and receives); and zero-bubble's split backward (torch's input- then
  weight-gradient passes) against a full one on 8 tiny blocks, per op of
  their forward + backward as the facts count ops. Under a second.

Everything here imports torch inside the function that needs it, so that importing
ddlscope.calibrate (its profile file, say) costs no torch.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from ddlscope.calibrate.fit import fit_matmul
from ddlscope.calibrate.profile import CalibrationProfile

T = TypeVar("T")

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
MATMUL_SIZES = (64, 96, 128, 192, 256, 384, 512, 768, 1024)
QUICK_MATMUL_SIZES = (64, 128, 256, 512)
# Convolutions by channel count: 3x3, C -> C channels, on 16 images of 16x16 (4,096 output positions,
# a CIFAR CNN's middle stage at a rank's batch).
CONV_CHANNELS = (4, 8, 16, 32, 64, 128, 256)
CONV_BATCH, CONV_PX = 16, 16


# --------------------------------------------------------------------------- compute (this process)
def _median_time(fn: Any, repeats: int, inner: int = 1) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def _alternating_median_times(fns: list[Any], repeats: int, before: Any = None) -> list[float]:
    """The median time of each of `fns`, stepped in turn (one of each, `repeats` times over, after one
    warm-up each), not one block after another: this machine's speed drifts by a fifth within a minute,
    and a difference of two blocks timed seconds apart reads the drift as the difference (the [tp] probe's
    per-op cost, a small difference of two large times, read 252 and 382 us at one size in two
    calibrations an hour apart). `before`, untimed, before each: e.g. a barrier, so that a collective is
    not timed waiting for a rank still in the block before it."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, samples):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return [statistics.median(times) for times in samples]


# Copies from 64 KiB to 64 MiB: what a memory-bound op moves per second depends on where its data
# sits (on this 2-core VM ~50-70 GB/s within the 4 MiB L2, ~25-40 GB/s at a few MiB, ~13 GB/s at
# 128 MiB moved). Recorded; predict/local.py uses the largest copy's rate (see there why).
MEMORY_COPY_BYTES = tuple(1 << p for p in (16, 18, 20, 22, 24, 26))


def _copy_rate(copied_bytes: int, repeats: int) -> float:
    """Bytes read + written per second by a copy of `copied_bytes`, both tensors written first: the
    pages of a never-written tensor all map the kernel's one zero page, whose reads hit the cache
    (that read 17-30 GB/s for 64 MiB here, where a real copy moves ~13)."""
    import torch

    src = torch.ones(copied_bytes // 4)
    dst = torch.zeros_like(src)
    inner = max(1, (16 << 20) // copied_bytes)  # each sample moves at least ~32 MiB: well above the clock's grain
    return 2 * copied_bytes / _median_time(lambda: dst.copy_(src), repeats, inner)


def measure_convolutions(quick: bool) -> dict[str, Any]:
    """FLOP/s of 3x3 convolutions, forward + input and weight gradients, by channel count.

    oneDNN (and cuDNN) run a convolution as an implicit GEMM of (N H W) x (9 C) @ (9 C x C), but not at
    the rate a plain matmul of that size reaches, and the channel count more than the GEMM's size
    sets how well a CPU kernel vectorises: measured here (one thread, a shared machine) 7 GFLOP/s at
    4 channels, 24 at 8, about 75 at 16 and 115-145 from 32 on, against 140-170 for matmuls of the
    same effective size. The step's convolutions are priced from this curve (calibrate/model.py).
    """
    import torch

    channels, flops = [], []
    for c in CONV_CHANNELS:
        conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        x = torch.randn(CONV_BATCH, c, CONV_PX, CONV_PX, requires_grad=True)
        seconds = _median_time(lambda: conv(x).sum().backward(), 3 if quick else 7)
        channels.append(c)
        flops.append(3 * 2.0 * CONV_BATCH * CONV_PX**2 * 9 * c * c / seconds)
    return {"channels": channels, "flops": flops}


def measure_compute(quick: bool, threads: int = 1) -> dict[str, Any]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sizes = list(QUICK_MATMUL_SIZES if quick else MATMUL_SIZES)
        seconds = []
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            reps = max(3, min(30, int(2e8 / (2 * n**3)) + 3))
            seconds.append(_median_time(lambda: a @ b, reps if not quick else min(reps, 8)))
        fit = fit_matmul(sizes, seconds)
        bf16: dict[str, float] = {}
        try:
            n = 512
            a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
            bf16 = {"size": n, "flops": 2 * n**3 / _median_time(lambda: a @ b, 5)}
        except RuntimeError:
            pass
        conv = measure_convolutions(quick)
        op_s, optimizer_tensor_s = measure_overheads(quick)
        memory_curve = {"bytes_moved": [], "bytes_per_s": []}
        for copied in MEMORY_COPY_BYTES:
            memory_curve["bytes_moved"].append(2 * copied)
            memory_curve["bytes_per_s"].append(_copy_rate(copied, 3 if quick else 7))
    finally:
        torch.set_num_threads(previous)
    return {
        "threads": threads,
        "matmul": {"sizes": sizes, "seconds": seconds, "flops": [2 * n**3 / s for n, s in zip(sizes, seconds)],
                   **fit},
        "peak_flops": max(2 * n**3 / s for n, s in zip(sizes, seconds)),
        "conv": conv,
        "bf16": bf16,
        "op_overhead_s": op_s,
        "optimizer_tensor_s": optimizer_tensor_s,
        "memory_bandwidth_bytes_per_s": memory_curve["bytes_per_s"][-1],
        "memory_curve": memory_curve,
    }


def measure_overheads(quick: bool) -> tuple[float, float]:
    """Per-op time of a training step whose FLOPs are negligible, and SGD's time per parameter tensor.

    A tiny MLP's forward + backward (modules, autograd, loss) divided by the ops
    the dispatcher saw: what one op costs on top of its FLOPs in a real step.
    """
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(8, 8), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(8, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    class _Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            _Count.count += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        nn.functional.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    reps = 5 if quick else 9
    op_s = _median_time(step, reps, inner=20) / max(_Count.count, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tensors = len(list(model.parameters()))
    optimizer_tensor_s = _median_time(optimizer.step, reps, inner=20) / tensors
    return op_s, optimizer_tensor_s


# --------------------------------------------------------------------------- collectives (worker ranks)
def collective_worker(sizes_json: str, repeats: int, out_path: str, quick: bool = False) -> None:
    """One rank of the collective benchmark (elastic_launch needs it importable at top level)."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor collectives' deprecation notices
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = json.loads(sizes_json)
    results: dict[str, list[float]] = {op: [] for op in COLLECTIVES}  # median repeat per size
    fastest: dict[str, list[float]] = {op: [] for op in COLLECTIVES}
    try:
        for size in sizes:
            numel = size // 4
            buf = torch.ones(numel)
            shard = torch.ones(max(numel // world, 1))
            gathered = torch.empty(shard.numel() * world)
            ops = {
                # payload conventions as comm.WIRE_FACTORS: all_gather's payload is the shard
                "all_reduce": (lambda: dist.all_reduce(buf), size),
                "all_gather": (lambda: dist.all_gather_into_tensor(gathered, shard), shard.numel() * 4),
                "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, gathered), size),
                "broadcast": (lambda: dist.broadcast(buf, 0), size),
            }
            for op, (fn, _payload) in ops.items():
                fn()  # warm-up
                samples = []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t0)
                # A collective lasts as long as its slowest rank: the max over ranks of each statistic.
                stats = torch.tensor([min(samples), statistics.median(samples)], dtype=torch.float64)
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                fastest[op].append(float(stats[0]))
                results[op].append(float(stats[1]))
            # point-to-point: ping-pong between ranks 0 and 1, half the round trip
            samples = []
            for i in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                elif rank == 1:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if i:
                    samples.append((time.perf_counter() - t0) / 2)
            fastest["p2p"].append(min(samples) if rank == 0 else 0.0)
            results["p2p"].append(statistics.median(samples) if rank == 0 else 0.0)
        sync = _sync_probe(repeats)
        strategies = _strategy_probes(repeats, quick)
        incast = _incast_probe(repeats, quick)
        tp = _tp_probe(repeats)
        pipeline = _pipeline_probe(repeats)
        if rank == 0:
            # The profile's sections of these names (calibrate/profile.py), as _strategy_probes returns its own.
            sections = dict(median=results, fastest=fastest, sync=sync, ps=incast, tp=tp, pipeline=pipeline)
            Path(out_path).write_text(json.dumps({**sections, **strategies}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


PIPELINE_PROBE_MICRO_BATCHES, PIPELINE_PROBE_WIDTH = 4, 8


def _pipeline_probe(repeats: int) -> dict[str, Any]:
    """torch's pipelining runtime per schedule action (its bookkeeping, posting and waiting on each send and
    receive, gloo's wake-ups): a GPipe step with one Linear(8, 8) stage per rank and 4 micro-batches (the
    compute negligible) over the 2 (m + p - 1) actions on its critical path, the slowest rank's. 0.8 ms here
    at load 3.5, where a GPT stage's micro-batch computes a few ms."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    world, rank = dist.get_world_size(), dist.get_rank()
    m, width = PIPELINE_PROBE_MICRO_BATCHES, PIPELINE_PROBE_WIDTH
    stage = PipelineStage(torch.nn.Linear(width, width), rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, m, loss_fn=lambda out, target: (out - target).square().mean())
    x = torch.zeros(2 * m, width)

    def step() -> None:
        if rank == 0:
            schedule.step(x, target=x if world == 1 else None, return_outputs=False)
        elif rank == world - 1:
            schedule.step(target=x, return_outputs=False)
        else:
            schedule.step(return_outputs=False)

    step_s = _median_time(step, max(10, 4 * repeats))
    slowest = torch.tensor([pipeline_action_s(step_s, m, world)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    split = torch.tensor([_split_backward_op_s(repeats)], dtype=torch.float64)
    dist.all_reduce(split)  # mean over the ranks, each timing it beside the others
    return {"action_s": float(slowest), "split_backward_op_s": float(split) / world}


SPLIT_PROBE_BLOCKS, SPLIT_PROBE_WIDTH = 8, 8


def _split_backward_op_s(repeats: int) -> float:
    """What zero-bubble's split backward costs beyond a full one, per op: torch's stage_backward_input then
    stage_backward_weight (Python walks of the autograd graph, an autograd.grad per parameter group) against
    its stage_backward, on 8 blocks of Linear(8, 8), LayerNorm, GELU (compute negligible), over the blocks'
    forward + backward ops as the workload's facts count them (runtime/profiler.py): the median of paired
    differences. 7-13 us here on 2 ranks at once at load 2-4, where a GPT block's split backward measured
    ~5 us an op more than its plain one."""
    import torch
    from torch import nn
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    from ddlscope.runtime.profiler import profile_step

    width = SPLIT_PROBE_WIDTH
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                             for _ in range(SPLIT_PROBE_BLOCKS)])
    x = torch.zeros(4, width)

    def backward(split: bool) -> None:
        inp = x.clone().requires_grad_()
        out = blocks(inp)
        grad = torch.ones_like(out)
        if split:
            _, groups = stage_backward_input([out], [grad], [inp], blocks.parameters())
            stage_backward_weight(blocks.parameters(), groups)
        else:
            stage_backward(out, grad, [inp])
        blocks.zero_grad(set_to_none=True)

    backward(True)
    backward(False)
    extra_s = []  # split and full in turn, so that other work on the machine weighs on both alike
    for _ in range(max(20, 8 * repeats)):
        t0 = time.perf_counter()
        backward(True)
        t1 = time.perf_counter()
        backward(False)
        extra_s.append(2 * t1 - t0 - time.perf_counter())
    step = profile_step(blocks, lambda out, target: (out - target).square().mean(), x, x, count_ops=True)
    assert step.ops is not None
    return max(statistics.median(extra_s), 0.0) / step.ops.ops


def pipeline_action_s(step_s: float, micro_batches: int, ranks: int) -> float:
    """One action's time from a GPipe step of negligible compute: its critical path runs the first stage's
    forwards, the last one's, its backwards, the first one's: 2 (m + p - 1) actions."""
    return step_s / (2 * (micro_batches + ranks - 1))


def _matmul_block(target_s: float) -> Any:
    """A function doing about `target_s` of single-thread matmuls, the same count on every rank."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(192, 192), torch.randn(192, 192)
    singles = []
    for _ in range(30):  # the fastest single call: the other ranks calibrating at once only add time
        t0 = time.perf_counter()
        a @ b
        singles.append(time.perf_counter() - t0)
    calls = torch.tensor([max(1, int(target_s / max(min(singles), 1e-7)))])
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    count = int(calls)

    def block() -> None:
        for _ in range(count):
            a @ b

    return block


SYNC_PROBE_BLOCKS_S = (0.002, 0.008)
# The profile's sections besides meta, compute and collectives, as calibrate/profile.py declares them:
# the synchronisation probe, DDP's and FSDP's step probes and a parameter server's round.
PROBES = tuple(name for name in CalibrationProfile.model_fields if name not in ("meta", "compute", "collectives"))


def _sync_probe(repeats: int) -> dict[str, Any]:
    """compute_stretch and sync_overhead_s at this world size, for two block lengths (see the
    module docstring); the predictor interpolates in the step's compute time."""
    import torch.distributed as dist

    from ddlscope.calibrate.model import busy_period_s, oversubscription_of

    world = dist.get_world_size()
    blocks = [_sync_block_probe(_matmul_block(target), max(10, 4 * repeats)) for target in SYNC_PROBE_BLOCKS_S]
    probe: dict[str, Any] = {key: [b[key] for b in blocks] for key in blocks[0]}
    stretch = [t / a for t, a in zip(probe["block_together_s"], probe["block_alone_s"])]
    oversubscription = oversubscription_of(world, os.cpu_count() or 1)
    overhead = [max(t + w - busy_period_s(a, st, oversubscription) - lat, 0.0) for t, w, a, st, lat in
                zip(probe["block_together_s"], probe["wait_s"], probe["block_alone_s"], stretch, probe["latency_s"])]
    return {**probe, "compute_stretch": stretch, "sync_overhead_s": overhead}


def _alone_s(block: Any, repeats: int) -> float:
    """Median time of `block` on this rank with every other rank parked in a barrier (each in turn)."""
    return each_rank_alone(lambda: _median_time(block, repeats))


def each_rank_alone(measure: Callable[[], T]) -> T:
    """`measure()` on every rank in turn, the others parked in a barrier; this rank's result."""
    import torch.distributed as dist

    result: T | None = None
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank():
            result = measure()
    dist.barrier()
    assert result is not None
    return result


def _sync_block_probe(block: Any, iterations: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    token = torch.zeros(1)
    alone_s = _alone_s(block, max(iterations // 2, 3))
    latency_s = _median_time(lambda: dist.all_reduce(token), iterations)
    together, waits = [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        block()
        t1 = time.perf_counter()
        dist.all_reduce(token)
        together.append(t1 - t0)
        waits.append(time.perf_counter() - t1)
    mine = torch.tensor([alone_s, statistics.fmean(together), statistics.fmean(waits), latency_s],
                        dtype=torch.float64)
    dist.all_reduce(mine)  # mean over ranks
    alone_s, together_s, wait_s, latency_s = (float(v) / world for v in mine)
    return {"block_alone_s": alone_s, "block_together_s": together_s, "wait_s": wait_s, "latency_s": latency_s}


# Block widths of the strategy probes: FSDP units of ~1 KiB, 16 KiB, 257 KiB, 1 MiB and 4 MiB of
# fp32 parameters; DDP models of 4 such blocks (~4 KiB .. 16 MiB, one 25 MiB bucket). Width 512
# puts a point between 1 and 16 MiB, where the models one trains here are (the step's cost is
# interpolated linearly between the widths).
PROBE_WIDTHS = (16, 64, 256, 512, 1024)
QUICK_PROBE_WIDTHS = (16, 256)
PROBE_BATCH = 32
PROBE_BLOCKS = 4


def _strategy_probes(repeats: int, quick: bool) -> dict[str, dict[str, Any]]:
    """What DDP and FSDP add to a step on this machine, at several model sizes (see the module docstring).

    A model of PROBE_BLOCKS Linear+ReLU blocks is stepped (forward + backward)
    wrapped and unwrapped; the difference is the strategy's cost as a step
    pays it: hooks, bucket or shard copies, the collectives themselves, and
    gloo's threads taking cores from the compute they overlap. On a CPU none
    of that is a straight line in the bytes, so it is measured at each size:
    DDP per step against the model's bytes, FSDP per unit (fully_shard per
    block) against the unit's bytes.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    def shard_blocks(model: Any) -> Any:
        for block in model:
            fully_shard(block)
        return fully_shard(model)  # the root: no parameters of its own here

    ddp: dict[str, Any] = {"model_bytes": [], "overhead_s": []}
    fsdp: dict[str, Any] = {"unit_bytes": [], "unit_overhead_s": []}
    for width in QUICK_PROBE_WIDTHS if quick else PROBE_WIDTHS:
        block_bytes = (width * width + width) * 4
        ddp_s = _wrapped_step_overhead_s(width, lambda m: DistributedDataParallel(m, bucket_cap_mb=25), repeats)
        ddp["model_bytes"].append(PROBE_BLOCKS * block_bytes)
        ddp["overhead_s"].append(ddp_s)
        fsdp_s = _wrapped_step_overhead_s(width, shard_blocks, repeats)
        fsdp["unit_bytes"].append(block_bytes)
        fsdp["unit_overhead_s"].append(fsdp_s / PROBE_BLOCKS)
    fsdp["optimizer_tensor_s"] = _sharded_optimizer_tensor_s(shard_blocks, repeats)
    # three times the steps: a difference of two small overheads, each a difference of medians
    fsdp["unit_tensor_s"] = _fsdp_unit_tensor_s(shard_blocks, 3 * repeats)
    # The profile's sections of these names (calibrate/profile.py: DdpProbe, FsdpProbe).
    return dict(ddp=ddp, fsdp=fsdp)


# Parameter tensors per unit of the second FSDP point: 4 Linear layers (8 tensors) against the width
# probe's 1 (2), at the smallest width, where the bytes cost next to nothing.
TENSOR_PROBE_LINEARS = 4


def _fsdp_unit_tensor_s(shard: Any, repeats: int) -> float:
    """FSDP2's cost per parameter tensor of a unit beyond what the unit costs (its hooks, the all-gather's
    copy-in and copy-out and the gradients' copies are per tensor): units of TENSOR_PROBE_LINEARS Linear
    layers against units of one, at the smallest probe width, the difference per extra tensor. A
    convolutional block (weights, norms' scales and shifts) carries several times the width probe's two
    tensors per unit."""
    width = PROBE_WIDTHS[0]
    one_s = _wrapped_step_overhead_s(width, shard, repeats)
    many_s = _wrapped_step_overhead_s(width, shard, repeats, linears=TENSOR_PROBE_LINEARS)
    extra_tensors = PROBE_BLOCKS * 2 * (TENSOR_PROBE_LINEARS - 1)
    return max(many_s - one_s, 0.0) / extra_tensors


def _sharded_optimizer_tensor_s(shard: Any, repeats: int) -> float:
    """Plain SGD's step per parameter tensor when the parameters are FSDP's DTensor shards, the
    slowest rank's: every tensor op of the step goes through DTensor's dispatch, which costs a
    sharded model's optimizer several times a plain tensor's (compute.optimizer_tensor_s) on a CPU.
    The width is the smallest probe's, so that the per-tensor cost is what is timed, not the bytes."""
    import torch
    import torch.distributed as dist
    from torch import nn

    width = PROBE_WIDTHS[0]
    model = shard(nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(PROBE_BLOCKS)]))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.SGD(params, lr=0.01)
    step_s = torch.tensor([_median_time(optimizer.step, max(5, repeats), inner=10) / len(params)],
                          dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    return float(step_s)


INCAST_SIZES = (64 << 10, 1 << 20, 4 << 20)
QUICK_INCAST_SIZES = (256 << 10, 4 << 20)


def _incast_probe(repeats: int, quick: bool) -> dict[str, Any]:
    """A parameter server's transport round at this world size: every rank but the last pushes a
    header and `size` bytes to the last rank, which takes them in arrival order and answers each with
    a header and `size` bytes (the messages, tags and order of strategies/ps.py and
    runtime/ps_server.py, without the update). The round's time as the workers see it, per size:
    many senders to one receiver on shared cores, which two-rank ping-pong does not show.

    Measured three ways: rounds back to back (`round_s`), and with each worker computing a block of
    matmuls (SYNC_PROBE_BLOCKS_S) before its push (`busy_round_s`, one list per block, and the
    block's time inside that loop, `busy_block_s`, against `block_alone_s`). A worker's push then
    meets the other workers' compute: on shared cores the server's receiving and answering take
    cores from it, and its rounds and its compute both stretch. Only the loop with compute is how a
    training step sees the exchange.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    sizes = QUICK_INCAST_SIZES if quick else INCAST_SIZES
    rounds = max(12, 6 * repeats)  # the rounds vary +-30% at 10 (two calibrations, 2 cores): average more
    idle_round_s = _mean_over_workers([_incast_rounds(size, None, rounds)[0] for size in sizes])
    blocks = [_matmul_block(target) for target in SYNC_PROBE_BLOCKS_S]
    block_alone_s = _mean_over_workers([_alone_s(block, max(rounds // 2, 3)) for block in blocks])
    busy_round_s, busy_block_s = [], []
    for block in blocks:
        measured = [_incast_rounds(size, block, rounds) for size in sizes]
        busy_round_s.append(_mean_over_workers([round_s for round_s, _ in measured]))
        busy_block_s.append(statistics.fmean(_mean_over_workers([block_s for _, block_s in measured])))
    return {"workers": world - 1, "bytes": list(sizes), "round_s": idle_round_s, "block_alone_s": block_alone_s,
            "busy_round_s": busy_round_s, "busy_block_s": busy_block_s}


def _mean_over_workers(values: list[float]) -> list[float]:
    """Each value's mean over the workers (every rank but the last, the server)."""
    import torch
    import torch.distributed as dist

    is_worker = dist.get_rank() < dist.get_world_size() - 1
    mine = torch.tensor(values if is_worker else [0.0] * len(values), dtype=torch.float64)
    dist.all_reduce(mine)
    return [float(v) / (dist.get_world_size() - 1) for v in mine]


def _incast_rounds(size: int, block: Any, rounds: int) -> tuple[float, float]:
    """(round, block) seconds, means over `rounds` rounds on a worker ((0, 0) on the server), at
    `size` bytes with `block` (None: nothing) computed by every worker before its push."""
    import torch
    import torch.distributed as dist

    from ddlscope.strategies.ps import DATA_TAG, HEADER_TAG, PUSH_HEADER, REPLY_HEADER

    rank, world = dist.get_rank(), dist.get_world_size()
    server = world - 1
    data = torch.ones(size // 4)
    header, reply = torch.zeros(PUSH_HEADER, dtype=torch.int64), torch.zeros(REPLY_HEADER, dtype=torch.int64)
    round_s, block_s = [], []
    dist.barrier()
    for i in range(rounds + 1):
        if block is None:
            dist.barrier()  # back to back: every round starts together
        if rank == server:
            sources = []
            for _ in range(world - 1):
                source = dist.recv(header, src=None, tag=HEADER_TAG)
                dist.recv(data, src=source, tag=DATA_TAG)
                sources.append(source)
            sends = []
            for source in sources:
                sends += [dist.isend(reply, source, tag=HEADER_TAG), dist.isend(data, source, tag=DATA_TAG)]
            for work in sends:
                work.wait()
            continue
        t0 = time.perf_counter()
        if block is not None:
            block()
        t1 = time.perf_counter()
        pending = [dist.isend(header, server, tag=HEADER_TAG), dist.isend(data, server, tag=DATA_TAG),
                   dist.irecv(reply, server, tag=HEADER_TAG), dist.irecv(data, server, tag=DATA_TAG)]
        for work in pending:
            work.wait()
        if i:  # the first round warms up
            round_s.append(time.perf_counter() - t1)
            block_s.append(t1 - t0)
    if rank == server:
        return 0.0, 0.0
    # Mean over the rounds: a step pays the slow rounds as well as the typical one.
    return statistics.fmean(round_s), statistics.fmean(block_s)


# The traced block: widths and a batch small enough that the trace and the timing take milliseconds;
# the op and all-reduce counts of the Megatron plan do not depend on them.
TP_PROBE_HIDDEN, TP_PROBE_HEADS, TP_PROBE_SEQ, TP_PROBE_BATCH = 16, 2, 8, 2
# DTensor's per-op cost grows with the tensors it handles: at 2 ranks, 72-77 us an op on the block above
# (16 tokens) and 262 us on a GPT block of 1024 tokens x hidden 128 (half the plain block subtracted, as the
# estimator prices a rank's compute). The per-op cost is timed on the small block and on a block of
# TP_PROBE_LARGE (batch, seq, hidden per rank), and the estimator reads it at the run's activation elements.
TP_PROBE_LARGE = (16, 64, 64)


def _tp_probe(repeats: int) -> dict[str, Any]:
    """DTensor's cost per dispatched op and one tp-sharded GPT block's op and all-reduce counts, traced
    (see the module docstring). The per-op cost is the block's own: its forward + backward sharded, less
    its share (1/tp) of the same block unsharded and its all-reduces timed alone, over the traced op count,
    the slowest rank's; timed at two block sizes (`activation_elements`: batch x seq x hidden of each), since
    the cost grows with the tensors. (An elementwise op on a shard costs ~21 us more than on its tensor here,
    but the block's ops, with their redistributions and autograd wrappers, cost 130-210 us each: a tiny
    block's step is 15.6 ms sharded over 2 ranks against 0.9 ms unsharded, at load ~7.)"""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    samples = max(10, 4 * repeats)
    per_op_s, elements = [], []
    counts: dict[str, Any] = {}
    for large in (False, True):
        sharded, plain, x = tp_probe_blocks(mesh, world, large)
        counts = trace_tp_block(sharded, x)
        activation = torch.zeros(x.numel())
        sharded_s, plain_s, all_reduce_s = _alternating_median_times(
            [lambda: sharded(x).sum().backward(), lambda: plain(x).sum().backward(),  # noqa: B023 (called at once)
             lambda: dist.all_reduce(activation)], samples, before=dist.barrier)  # noqa: B023
        ops = max(counts["block_dispatch_ops"], 1)
        per_op_s.append(max(sharded_s - plain_s / world - counts["block_all_reduces"] * all_reduce_s, 0.0) / ops)
        elements.append(float(x.numel()))
    slowest = torch.tensor(per_op_s, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"dispatch_op_s": float(slowest[0]), "dispatch_op_s_by_size": [float(v) for v in slowest],
            "activation_elements": elements, **counts}


def tp_probe_blocks(mesh: Any, ranks: int, large: bool = False) -> tuple[Any, Any, Any]:
    """(a GPT block split over `mesh` as strategies/tp.py splits it, the same block whole, an input: the
    probe's small block or its `large` one), each block stepped once (warm: sharding propagation's caches
    filled, as in a training step)."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    from ddlscope.strategies.tp import PLAN
    from ddlscope.workloads.gpt import Block, GPTConfig

    batch, seq, hidden = TP_PROBE_LARGE if large else (TP_PROBE_BATCH, TP_PROBE_SEQ, TP_PROBE_HIDDEN)
    cfg = GPTConfig(vocab_size=64, seq_len=seq, layers=1, hidden=hidden * ranks, heads=TP_PROBE_HEADS * ranks)
    torch.manual_seed(0)
    sharded, plain = Block(cfg), Block(cfg)
    sharded.attn.heads //= ranks
    parallelize_module(sharded, mesh, PLAN)
    x = torch.randn(batch, seq, cfg.hidden, requires_grad=True)
    for block in (sharded, plain):
        block(x).sum().backward()
    return sharded, plain, x


def trace_tp_block(block: Any, x: Any) -> dict[str, Any]:
    """One tp-split block's forward + backward traced: aten ops with a DTensor argument, all-reduces, and
    their elements over the block's activations (x's: batch x seq x hidden)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Trace(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtensor_ops, self.all_reduce_elements = 0, []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            leaves = tree_leaves((args, kwargs or {}))
            self.dtensor_ops += any(isinstance(a, DTensor) for a in leaves)
            if func.__name__.startswith("all_reduce"):
                self.all_reduce_elements.append(sum(a.numel() for a in leaves if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    with Trace() as trace:
        block(x).sum().backward()
    reduces = trace.all_reduce_elements
    return {"block_dispatch_ops": trace.dtensor_ops, "block_all_reduces": len(reduces),
            "all_reduce_activation_ratio": statistics.fmean(reduces) / x.numel() if reduces else 0.0}


def _wrapped_step_overhead_s(width: int, wrap: Any, repeats: int, linears: int = 1) -> float:
    """Median forward + backward of the probe model (blocks of `linears` Linear+ReLU) wrapped minus
    unwrapped, the slowest rank's.

    The two are stepped alternately, so that a change in what else the machine is doing lands on
    both sides of the difference rather than on one.
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(*[layer for _ in range(linears) for layer in
                                               (nn.Linear(width, width), nn.ReLU())])
                               for _ in range(PROBE_BLOCKS)])

    x = torch.randn(PROBE_BATCH, width)
    plain, wrapped = build(), wrap(build())
    dist.barrier()

    def step_s(model: nn.Module) -> float:
        t0 = time.perf_counter()
        model(x).sum().backward()
        return time.perf_counter() - t0

    for _ in range(2):
        step_s(plain), step_s(wrapped)
    plain_s, wrapped_s = [], []
    for _ in range(max(8, 4 * repeats)):
        plain_s.append(step_s(plain))
        wrapped_s.append(step_s(wrapped))
    both = torch.tensor([statistics.median(plain_s), statistics.median(wrapped_s)], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return max(float(both[1]) - float(both[0]), 0.0)


def measure_collectives(world_size: int, sizes: list[int], repeats: int, quick: bool = False) -> dict[str, Any]:
    """Start `world_size` gloo ranks through the elastic launcher: every collective (median and fastest
    repeat per size) and the PROBES (synchronisation, DDP, FSDP, a parameter server's round)."""
    from ddlscope.runtime.launcher import launch_processes

    with tempfile.TemporaryDirectory(prefix="ddlscope-calibrate-") as tmp:
        out = Path(tmp) / "times.json"
        # one intra-op thread per rank, as training ranks have by default
        launch_processes(collective_worker, (json.dumps(sizes), repeats, str(out), quick), world_size,
                         run_id="ddlscope-calibrate", threads_per_rank=1)
        return json.loads(out.read_text())
