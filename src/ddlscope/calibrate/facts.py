"""`workload_facts`: the torch side of `ddlscope predict-run`, one rank's step as the local predictor reads it."""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import time
from typing import Any, Callable

# Steps timed by the kernel benchmark (after the warm-up ones): enough for a stable median of a step
# that takes milliseconds, few enough that predict-run stays a second or two per run.
KERNEL_WARMUP_STEPS, KERNEL_TIMED_STEPS = 3, 9
# In launched ranks the steps are timed alone and side by side in turn, this many rounds of each (a third of
# the timed steps a round, one warm-up step after the first round's): this machine's speed drifts by a fifth
# within a minute (the same step 82 -> 101 ms in 40 s), and one block alone then one side by side, ~10 s
# apart, read that drift as contention (side by side came out 0.69x and 2.06x alone; the ranks' thread CPU
# said 0.93-1.08). Each round's ratio is the drift of seconds, not of a minute.
KERNEL_ROUNDS = 3
# Each round times at least this long a block, alone and side by side: three steps of a 5 ms step were a
# median of 15 ms, and the same configuration's kernels alone, timed after each of three runs a minute
# apart, read 5.3-7.1 ms (nodepar) and 11.6-14.9 ms (partitioned), the side-by-side stretch 0.96-1.61
# (mm-psgd) where the runs computed at 1.03-1.05x their CPU time. At most KERNEL_MAX_ROUND_STEPS steps.
# Half a second, not 0.2: one process stepping the digits' MLP for 2 minutes on a quiet machine, its mean
# step over windows of 0.1 / 0.5 / 1 / 2 / 5 s spread 24 / 17 / 14 / 12 / 10% (10th to 90th percentile),
# and a second's mean correlated 0.41 with the next second's, 0.08 with one 5 s away: the noise is of
# seconds, and a block of 0.2 s drew one sample of it.
KERNEL_ROUND_S, KERNEL_MAX_ROUND_STEPS = 0.5, 100


def workload_facts(experiment_config: dict[str, Any], *, time_kernels: bool = False) -> dict[str, Any]:
    """FLOPs, op counts and parameter bytes of one rank's training step (forward + backward), from
    the step profiler (runtime/profiler.py) with its op-counting pass: a small model's CPU step is
    mostly per-op overhead, not FLOPs. With `time_kernels`, also the step's own kernels timed alone
    and, for a run of several ranks, side by side, in launched ranks (`rank_kernel_times`)."""
    from ddlscope.runtime.config import experiment_from_dict
    from ddlscope.runtime.profiler import profile_task
    from ddlscope.workloads import WORKLOADS

    exp = experiment_from_dict(json.loads(json.dumps(experiment_config)))
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    per_rank = exp.per_rank_batch()
    step = profile_task(task, per_rank, count_ops=True)
    assert step.ops is not None
    kernels, kernels_error = None, None
    if time_kernels:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        try:
            kernels = rank_kernel_times(experiment_config)
        except SignalException:  # Ctrl-C or SIGTERM while the ranks ran: the user stops, not a failure
            raise
        except Exception as exc:  # noqa: BLE001 (ranks that did not start or died, whatever torch raised)
            # A prediction from FLOPs, said so, is more use than no prediction: the FLOP model stands.
            kernels_error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
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
        **({"kernels_error": kernels_error} if kernels_error else {}),
    }


def facts_key(experiment_config: dict[str, Any]) -> str:
    """What `workload_facts` of a run depends on: its workload, per-rank batch and the ranks that compute
    side by side, and its strategy where the strategy times a gradient pass of its own (Strategy.kernel_backward). Runs with equal
    keys share facts (benchmarks/predict_local.py times each key's kernels once)."""
    from ddlscope.runtime.config import experiment_from_dict
    from ddlscope.strategies import runtime_class

    exp = experiment_from_dict(json.loads(json.dumps(experiment_config)))
    own_backward = runtime_class(exp.strategy).kernel_backward(exp.strategy) is not None
    return json.dumps([experiment_config["workload"], exp.per_rank_batch(), contention_processes(experiment_config),
                       experiment_config["strategy"] if own_backward else None], sort_keys=True)


# A rank that waited (for a collective, a server, a neighbour) computes its next forward slower than one
# that went straight on: the digits' MLP, one process, steps taken in turn with and without a sleep before
# them, forward + backward +0.03 / +0.1 / +0.3 / +0.5 ms after 0.2 / 1 / 4 / 16 ms away (+1 / +4 / +13 /
# +21% of the forward; a 4 ms busy loop in Python cost as much as a 4 ms sleep, so it is not the wake-up
# but what the machine did to the caches meanwhile). Kernels timed back to back do not pay it; a
# synchronous run pays it every step. Every KERNEL_PAUSE_EVERY-th timed step, in turn, follows a sleep of
# one of KERNEL_PAUSES_S, and `pause_extra_s` is what those steps' forward + backward cost beyond the
# others' (predict/local.py interpolates it at the wait a step of the run has before its forward).
KERNEL_PAUSES_S, KERNEL_PAUSE_EVERY = (0.002, 0.016), 4


def pause_before(step: int, pauses_s: tuple[float, ...]) -> float:
    """The sleep before timed step `step` (0 for most): every KERNEL_PAUSE_EVERY-th, `pauses_s` in turn."""
    if not pauses_s or step % KERNEL_PAUSE_EVERY != KERNEL_PAUSE_EVERY - 1:
        return 0.0
    return pauses_s[(step // KERNEL_PAUSE_EVERY) % len(pauses_s)]


def kernel_times(task: Any, workload: Any, per_rank: int, threads: int,
                 backward: Callable[[Any, Any, Any, Any], None] | None = None, device: str = "cpu",
                 timed_steps: int = KERNEL_TIMED_STEPS, warmup_steps: int = KERNEL_WARMUP_STEPS,
                 pauses_s: tuple[float, ...] = ()) -> dict[str, Any]:
    """Mean time of one rank's batch read, forward (with the loss), backward and optimizer step (with
    zero_grad; the workload's optimizer over the whole model), alone in this process with the rank's
    intra-op threads: the workload's own kernels benchmarked on this machine. The mean, not the median:
    a run's step time is the mean of its steps, hiccups included (the MLP's forward: mean 1-4% above the
    median over 300 steps). `backward`: the strategy's own gradient pass where it replaces
    `loss.backward()` (Strategy.kernel_backward: a private step's per-sample gradients), timed as the
    backward. `pauses_s`: some steps follow a sleep (`pause_before`), and are timed apart from the others:
    `pause_extra_s[pause]` is their forward + backward beyond the others'.

    A one-device profile is what trace-driven predictors start from (Daydream, Zhu et al. 2020); here
    it stands in for the FLOP model where CPU kernels run far from their FLOP or byte rates: a
    convolution's weight gradient, max-pooling with indices and group norm run several times slower
    than the convolution probe's and the copy rate predict (docs/calibrate.md). The distributed part
    (contention between ranks, turn-taking for cores, communication) stays the model's. On a CUDA
    `device` (calibrate --model) the batch is read on the CPU and moved, and every time is taken after
    the device has finished (synchronised)."""
    import torch

    from ddlscope.runtime.loop import make_optimizer

    model = copy.deepcopy(task.model).to(device).train()  # the task's own model stays untouched
    optimizer = make_optimizer(model, workload)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    ids = torch.arange(per_rank)
    read_s, forward_s, backward_s, optimizer_s = [], [], [], []
    paused_s: dict[float, list[float]] = {pause: [] for pause in pauses_s}
    def now() -> float:
        if device != "cpu":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    try:
        for i in range(warmup_steps + timed_steps):
            pause = pause_before(i - warmup_steps, pauses_s) if i >= warmup_steps else 0.0
            if pause:
                time.sleep(pause)
            t0 = now()
            x, y = task.train.get(ids % len(task.train))
            x, y = x.to(device), y.to(device)
            t1 = now()
            loss = task.loss_fn(model(x), y)
            t2 = now()
            if backward is None:
                loss.backward()
            else:
                backward(model, task.loss_fn, x, y)
            t3 = now()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t4 = now()
            if pause:
                paused_s[pause].append(t3 - t1)
            elif i >= warmup_steps:
                read_s.append(t1 - t0)
                forward_s.append(t2 - t1)
                backward_s.append(t3 - t2)
                optimizer_s.append(t4 - t3)
    finally:
        torch.set_num_threads(previous_threads)
    mean = statistics.fmean
    compute_s = mean(forward_s) + mean(backward_s)
    return {"data_s": mean(read_s), "forward_s": mean(forward_s), "backward_s": mean(backward_s),
            "optimizer_s": mean(optimizer_s), "steps": len(forward_s), "threads": threads,
            "strategy_backward": backward is not None,
            **({"pause_extra_s": {str(pause): mean(times) - compute_s for pause, times in paused_s.items() if times}}
               if pauses_s else {}),
            "compute_samples_s": [f + b for f, b in zip(forward_s, backward_s)]}  # each timed step's


# Side by side with at most this many ranks per core: a run from a cluster (hundreds of ranks, stored
# through the c10d rendezvous or Slurm) is not played out on this machine; its kernels are timed
# alone, in one rank, and the local model keeps the calibration's stretch.
MAX_SIDE_BY_SIDE_PER_CORE = 4


def contention_processes(experiment_config: dict[str, Any]) -> int:
    """How many ranks time the kernels: the run's training ranks, which compute at once (a parameter
    server sleeps in recv meanwhile; more of them than cores take turns for a core, and the kernels
    timed side by side hold that turn-taking too, as the runs' forward and backward times do), or
    one where the run has more than MAX_SIDE_BY_SIDE_PER_CORE per core of this machine."""
    world = max(1, int(experiment_config["cluster"]["world_size"]))
    return world if world <= MAX_SIDE_BY_SIDE_PER_CORE * (os.cpu_count() or 1) else 1


def rank_kernel_times(experiment_config: dict[str, Any]) -> dict[str, Any]:
    """The step's own kernels (`kernel_times`) timed where a training rank runs them: in launched ranks,
    `contention_processes` of them. Each times the step alone (the others parked in a barrier), then
    all together, KERNEL_ROUNDS times over (`side_by_side_rounds`).

    In a rank, not in the calling process: the same ResNet step took 27 ms in a fresh process and in
    the ranks, and 22 ms in a process that had launched a run before (its allocator then served the
    step's large buffers from the heap instead of fresh pages; MALLOC_MMAP_THRESHOLD_ did the same).
    Side by side: what running beside the other ranks costs these kernels (caches, memory bus, turns
    for a core), which the calibration's matmul probe measures for a matmul only."""
    from ddlscope.runtime.launcher import launch_processes

    processes = contention_processes(experiment_config)
    threads = int(experiment_config["cluster"].get("threads_per_rank", 1))
    results = list(launch_processes(kernel_rank, (json.dumps(experiment_config),), processes,
                                    run_id=f"ddlscope-kernels-{os.getpid()}", threads_per_rank=threads).values())
    return side_by_side_rounds(results, processes)


KERNEL_PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s")


def round_steps(warm: dict[str, Any]) -> int:
    """Steps a round's blocks time, the same on every rank: enough that a block lasts KERNEL_ROUND_S at the
    slowest rank's step (`warm`: its kernel times after the warm-up), at least the fixed count's share."""
    import torch
    import torch.distributed as dist

    step_s = torch.tensor([sum(float(warm[key]) for key in KERNEL_PHASES)], dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    return steps_for(float(step_s))


def steps_for(step_s: float) -> int:
    """A round's steps at `step_s` a step (KERNEL_ROUND_S a block, within the fixed share and the cap)."""
    fewest = KERNEL_TIMED_STEPS // KERNEL_ROUNDS
    if step_s <= 0:
        return KERNEL_MAX_ROUND_STEPS
    return max(fewest, min(KERNEL_MAX_ROUND_STEPS, math.ceil(KERNEL_ROUND_S / step_s)))


def side_by_side_rounds(results: list[list[tuple[dict[str, Any], dict[str, Any]]]], processes: int
                        ) -> dict[str, Any]:
    """The kernels from every rank's rounds (`results[rank][round]`: its times alone, then side by side).
    Alone: each phase's median over the rounds of its mean over the ranks (and so `pause_extra_s`). Side by
    side (`together`, where `processes` > 1): `stretch` is the median over the rounds of the round's pooled
    side-by-side mean over its alone compute, both timed seconds apart; `slowest_wait_s` how long the mean
    rank waits for the slowest of `processes` (a synchronous step waits for its slowest rank), from the
    side-by-side steps' spread about their round's median, as if normal."""
    rounds = range(len(results[0]))

    def alone_mean_s(key: str, r: int) -> float:
        return statistics.fmean(rank_rounds[r][0][key] for rank_rounds in results)

    first = results[0][0][0]
    kernels: dict[str, Any] = {**first, **{key: statistics.median(alone_mean_s(key, r) for r in rounds)
                                           for key in KERNEL_PHASES},
                               "steps": sum(results[0][r][0]["steps"] for r in rounds)}
    del kernels["compute_samples_s"]
    pauses = sorted(first.get("pause_extra_s") or {}, key=float)
    if pauses:  # like the phases: the median over the rounds of the mean over the ranks
        kernels["pause_extra_s"] = {pause: statistics.median(
            statistics.fmean(rank_rounds[r][0]["pause_extra_s"][pause] for rank_rounds in results) for r in rounds)
            for pause in pauses}
    if processes > 1:
        ratios, deviations_s = [], []
        for r in rounds:
            pooled = [s for rank_rounds in results for s in rank_rounds[r][1]["compute_samples_s"]]
            median_s = statistics.median(pooled)
            # means over means: the alone times are means (kernel_times), as a run's step is
            ratios.append(statistics.fmean(pooled) / (alone_mean_s("forward_s", r) + alone_mean_s("backward_s", r)))
            deviations_s += [abs(s - median_s) for s in pooled]
        # robust to a hiccup: a 100 ms stall in one of 18 timed steps is noise of this machine, not the
        # workload's spread (as a mean or an empirical maximum would take it)
        spread_s = NORMAL_MAD_TO_SIGMA * statistics.median(deviations_s)
        kernels["together"] = {"processes": processes, "stretch": statistics.median(ratios),
                               "round_stretches": ratios,
                               "slowest_wait_s": spread_s * expected_max_of_normals(processes)}
    return kernels


NORMAL_MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation over its median absolute deviation


def expected_max_of_normals(draws: int) -> float:
    """E[max of `draws` independent standard normals] (0.564 for 2, 1.029 for 4): how far, in standard
    deviations, the slowest of `draws` ranks' steps lies beyond the mean one. The integral
    of x * draws * pdf(x) * cdf(x)^(draws - 1), summed on a fine grid."""
    normal, width = statistics.NormalDist(), 0.01
    return sum(x * draws * normal.pdf(x) * normal.cdf(x) ** (draws - 1) * width
               for x in (i * width for i in range(-800, 801)))


def kernel_rank(config_json: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """One rank of `rank_kernel_times`: its kernel times alone, then side by side with the others, in
    KERNEL_ROUNDS rounds (one, alone, in a lone rank)."""
    import torch.distributed as dist

    from ddlscope.calibrate.probes import each_rank_alone
    from ddlscope.runtime.config import experiment_from_dict
    from ddlscope.strategies import runtime_class
    from ddlscope.workloads import WORKLOADS

    exp = experiment_from_dict(json.loads(config_json))
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    backward = runtime_class(exp.strategy).kernel_backward(exp.strategy)

    def times(steps: int, warmup: int, pauses_s: tuple[float, ...] = ()) -> dict[str, Any]:
        return kernel_times(task, exp.workload, exp.per_rank_batch(), exp.cluster.threads_per_rank, backward,
                            timed_steps=steps, warmup_steps=warmup, pauses_s=pauses_s)

    dist.init_process_group("gloo")
    try:
        if dist.get_world_size() == 1:
            alone = times(KERNEL_ROUNDS * round_steps(times(1, KERNEL_WARMUP_STEPS)), 1)
            rounds = [(alone, alone)]
        else:
            steps, rounds = round_steps(times(1, KERNEL_WARMUP_STEPS)), []
            for _ in range(KERNEL_ROUNDS):
                # one warm-up step a block: the process's allocator is warm after the first. Alone, some
                # steps follow a pause, as a rank's forward follows its wait in a run of several ranks.
                alone = each_rank_alone(lambda: times(steps, 1, KERNEL_PAUSES_S))  # noqa: B023 (called at once)
                rounds.append((alone, times(steps, 1)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return rounds
