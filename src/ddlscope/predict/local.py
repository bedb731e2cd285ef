"""Predict a stored local run (CPU, gloo) from its config and this machine's calibration.

Torch-free, like the rest of ddlscope.predict: the workload's FLOPs, op count
and parameter sizes come in as `facts` (ddlscope.calibrate.workload_facts,
which needs torch), the machine as a calibration profile (ddlscope calibrate).

Per step and rank:

- compute (forward + backward) = ops x per-op overhead + each matmul's FLOPs
  / the calibrated FLOP/s at its size + the other ops' bytes / memory
  bandwidth, split 1:2 between forward and backward as the FLOPs are (or the
  workload's kernels as timed, calibrate/facts.py); times `compute_stretch`
  (what running beside the other ranks costs: the kernels timed side by side
  where the facts have them, else the calibration's probe).
- oversubscription: when more ranks compute than there are cores, each waits
  its turn for a core: the step lasts at least busy CPU time x ranks / cores;
  the turn-taking shows up as waiting (comm_wait), as it does in the runs.
- communication: the strategy's estimator (predict/estimators/), from what
  the strategy sends, each message timed from the
  calibrated table of typical (median) gloo times at that world size,
  interpolated between measured sizes (gloo's cost is not one straight line
  in the size: it changes algorithm and falls out of cache), or the alpha-beta
  fit where the profile has no table; max'd with the emulated link's alpha +
  wire_bytes / bandwidth when the run emulated a network (LinkModel waits out
  the emulated time but the real transfer still happens):
  ddp: the calibrated DDP cost at the model's size (hooks, bucket copies and
  the all-reduces as a step pays them on this machine), interpolated between
  the probed model sizes; with an emulated link at least the smallest
  model's cost less its own all-reduce (the link's wait hides it) plus, per
  bucket_mb bucket, the larger of the link's and gloo's time for its all-reduce
  (on CPU/gloo DDP's all-reduce ends after backward's last bucket, so it
  counts as exposed); without the probe, the all-reduces from the table;
  fsdp: per unit the calibrated FSDP cost at its size (hooks, copies, its
  all-gather in forward, again in backward, and the reduce-scatter of its
  gradients, as fully_shard pays them on this machine), interpolated between
  the probed unit sizes; with an emulated link, at least the smallest unit's
  cost plus the link's time for those three collectives;
  ps-*: each worker flattens its gradients, pushes them (a header and a data
  message) and pulls the parameters through the server's link, which
  serialises the workers: a round of all pushes and answers from the
  calibrated transport probe (ps_round_s; sync: the round, one update;
  async: workers of equal speed arrive together and are served in turn, so
  the mean one queues behind half of the others, and a step lasts at least
  workers x (its share of the round + update)), then unflattens them. The
  server's update costs the passes over its shard that runtime/ps_server.py
  makes (server_apply_passes).
- synchronisation: a rank that finishes its compute waits for the slowest and
  for gloo's threads to wake: for a synchronous strategy at least the wait
  the kernels' spread side by side gives (where timed, and where the ranks
  do not outnumber the cores), and the calibrated
  `sync_overhead_s` per step
  wherever no probe of the strategy holds that wait already: ddp/fsdp
  without their probes (which time whole steps), parameter servers without
  the transport probe's rounds with compute (which hold the wait for the
  other workers' pushes; it also gives PS workers their compute stretch).
- optimizer: 3 passes over the parameters at memory bandwidth plus per-tensor
  op overheads (fsdp: the calibrated step per DTensor shard, several times a
  plain tensor's; none on PS workers: the server steps).
- model states per rank: parameters / gradients / optimizer bytes (ddp
  replicated; fsdp dim-0 shards padded to ceil(dim0 / world); ps workers hold
  parameters + gradients, each server its shard and the optimizer state).
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from ddlscope.calibrate.model import (
    OPS_PER_PARAM_OPTIMIZER, STATE_TENSORS, busy_period_s, emulated_link, gemm_time_s, interpolate_linear,
    machine_probe, optimizer_kind, oversubscription_of, required, sync_at)
from ddlscope.calibrate.profile import CalibrationProfile
from ddlscope.predict.estimators import LocalCase, LocalStep, estimator_for
from ddlscope.predict.estimators.base import forward_share
from ddlscope.specs import STRATEGY_SPECS, ConfigError, StrategySpec, describe_validation_error
from ddlscope.specs.registry import UnknownPluginError

PHASES = ("data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s")


def strategy_of(config: dict[str, Any]) -> StrategySpec:
    """The run's strategy spec, its knobs' defaults filled in by the spec class."""
    raw = config["strategy"]
    try:
        return STRATEGY_SPECS.get(raw["name"]).model_validate(raw)
    except UnknownPluginError as err:
        raise ConfigError(f"strategy.name = {err.name!r}: unknown strategy; allowed: {', '.join(err.known)}") from None
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, prefix="strategy")) from None


def local_case(config: dict[str, Any], environment: dict[str, Any], facts: dict[str, Any],
               profile: CalibrationProfile | Mapping[str, Any]) -> LocalCase:
    """What every local estimate of this run shares: ranks, cores, link, compute alone."""
    spec = strategy_of(config)
    profile = CalibrationProfile.coerce(profile)
    compute = profile.compute
    op_s = float(required(compute.op_overhead_s, "op_overhead_s"))
    # Memory-bound work at the largest calibrated copy's rate. The calibration also records copy
    # rates by size (caches); using them, at the step's footprint, predicted the benchmark's runs
    # worse (MAPE 10.0% against 7.5% on the same runs and calibration), so they stay a record.
    mem_bw = float(required(compute.memory_bandwidth_bytes_per_s, "memory_bandwidth_bytes_per_s"))
    opt_kind = optimizer_kind(facts)
    side_by_side = kernels_side_by_side(facts, int(config["cluster"]["world_size"])) or {}
    return LocalCase(
        world=int(config["cluster"]["world_size"]), servers=spec.extra_ranks(),
        cores=int((profile.meta.cores if profile.meta else None) or environment.get("cores") or 1),
        link=emulated_link(environment), profile=profile, facts=facts,
        alone_s=alone_compute_s(facts, compute, op_s, mem_bw),
        op_s=op_s, memory_bandwidth_bytes_per_s=mem_bw, optimizer_kind=opt_kind,
        per_tensor_s=float(2 * op_s if compute.optimizer_tensor_s is None else compute.optimizer_tensor_s)
        * OPS_PER_PARAM_OPTIMIZER[opt_kind] / 2,
        kernel_stretch=side_by_side.get("stretch"),
        kernel_slowest_wait_s=float(side_by_side.get("slowest_wait_s", 0.0)),
        steps=run_steps(config), workload=dict(config.get("workload") or {}))


def run_steps(config: dict[str, Any]) -> int | None:
    """The run's workload.steps where the config says it (a stored run's does), else None."""
    steps = (config.get("workload") or {}).get("steps")
    return int(steps) if isinstance(steps, (int, float)) and steps >= 1 else None


def alone_compute_s(facts: dict[str, Any], compute: Any, op_s: float, mem_bw: float) -> float:
    """One rank's forward + backward alone: the workload's kernels as timed on this machine where the
    facts have them (calibrate/facts.py kernel_times), else ops x overhead + FLOPs at the calibrated
    rates + the other ops' bytes at memory bandwidth."""
    kernels = facts.get("kernels")
    if kernels:
        return float(kernels["forward_s"] + kernels["backward_s"])
    return facts["ops"] * op_s + gemm_time_s(facts, compute) + facts.get("other_op_bytes", 0) / mem_bw


def pause_extra_s(facts: dict[str, Any], wait_s: float) -> float:
    """The forward + backward time beyond the kernels' of a step that follows a wait of `wait_s`: linear
    between the pauses the kernels were timed after (none after no wait), held beyond the longest; 0
    where the facts have no such timing. Negative extras (noise about a small one) count as none."""
    timed = (facts.get("kernels") or {}).get("pause_extra_s")
    if not timed:
        return 0.0
    pauses = sorted((float(pause), max(float(extra), 0.0)) for pause, extra in timed.items())
    return interpolate_linear([0.0] + [p for p, _ in pauses], [0.0] + [e for _, e in pauses],
                              min(wait_s, pauses[-1][0]))


def kernels_side_by_side(facts: dict[str, Any], world: int) -> dict[str, Any] | None:
    """The workload's kernels timed side by side (facts' kernels.together: stretch, slowest_wait_s), where
    they were timed with as many ranks at once as this run trains on (ranks beyond the cores: their
    turn-taking included, so busy_period adds none where the stretch holds it)."""
    together = (facts.get("kernels") or {}).get("together")
    if together is None or int(together["processes"]) != world:
        return None
    return together


def model_state_bytes(config: dict[str, Any], facts: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Predicted parameters / gradients / optimizer bytes of a worker (and of a server, for PS)."""
    spec = strategy_of(config)
    case = local_case(config, {}, facts, _NO_PROFILE)
    return estimator_for(spec).local_memory(spec, case)


# model_state_bytes needs no machine: a profile that prices nothing
_NO_PROFILE = CalibrationProfile.coerce({"compute": {"op_overhead_s": 0.0, "memory_bandwidth_bytes_per_s": 1.0,
                                                      "matmul": {"peak_flops": 1.0}}, "collectives": {}})


def predict_local(config: dict[str, Any], environment: dict[str, Any], facts: dict[str, Any],
                  profile: CalibrationProfile | Mapping[str, Any]) -> dict[str, Any]:
    """Predicted mean step time, its breakdown and model-state memory of one run."""
    spec = strategy_of(config)
    estimator = estimator_for(spec)
    case = local_case(config, environment, facts, profile)
    profile = case.profile
    world, op_s, mem_bw = case.world, case.op_s, case.memory_bandwidth_bytes_per_s
    # Servers sleep in recv while the workers compute: only the workers contend for cores then.
    oversubscription = oversubscription_of(world, case.cores)

    # The workers compute side by side (servers sleep in recv meanwhile); every process of the
    # run, servers too, meets at a step's synchronisation.
    sync_overhead_s = sync_at(machine_probe(profile, "sync", world + case.servers), case.alone_s)[1]
    probed_stretch = estimator.local_compute_stretch(spec, case)
    stretch = case.side_by_side_stretch() if probed_stretch is None else probed_stretch
    # The rank's part of the model's work (its stages, under pipeline), at the stretch of running beside
    # the others: what the facts timed for the whole model becomes this rank's.
    share = estimator.local_compute_share(spec, case)
    scale = stretch * share
    extra_s, extra_notes = estimator.local_compute_extra_s(spec, case)
    compute_s = case.alone_s * scale * estimator.local_compute_factor(spec, case) + extra_s
    forward_s = compute_s * forward_share(facts)
    backward_s = compute_s - forward_s
    # Reading the batch (the in-memory split's gather): timed with the kernels, else not priced.
    data_s = float(facts["kernels"]["data_s"]) * scale if facts.get("kernels") else 0.0

    n_tensors = len(facts["param_numel"])
    local_params = estimator.local_optimizer_bytes(spec, case)
    tensor_s = estimator.local_optimizer_tensor_s(spec, case)
    timed_s = (facts.get("kernels") or {}).get("optimizer_s")
    if timed_s is not None and local_params == case.param_bytes and tensor_s == case.per_tensor_s:
        optimizer_s = float(timed_s) * scale  # the whole model's plain tensors: as timed with the kernels
    else:  # a shard, or DTensors (FSDP): passes over the local bytes + the per-tensor overhead
        # The rank's share of the tensors; its bytes are the estimator's local ones already (a stage's).
        passes = 3 + 2 * STATE_TENSORS[case.optimizer_kind]
        optimizer_s = (n_tensors * tensor_s * share + passes * local_params / mem_bw) * stretch
    zero_grad_s = n_tensors * op_s * scale
    comm = estimator.local_comm(spec, case, LocalStep(scale, forward_s, backward_s, zero_grad_s))
    if not spec.traits.local_optimizer:  # the servers step; the workers only zero their gradients
        optimizer_s = zero_grad_s
    # A run step of several minibatches (a federated round) reads and steps each of them.
    minibatches = estimator.local_minibatches(spec, case)
    data_s, optimizer_s = data_s * estimator.local_data_reads(spec, case), optimizer_s * minibatches
    notes = list(comm.notes) + extra_notes

    # The synchronisation probe is for a strategy with no probe of its own that holds the wait. A
    # synchronous step also waits for its slowest rank's compute: as the kernels side by side spread,
    # where timed (the probes' own compute is small; the synchronisation probe's wait holds its blocks').
    # Not where more ranks compute than there are cores: there the side-by-side spread is the scheduler
    # interleaving the ranks, which the stretch holds already (a rank that finishes first sleeps in the
    # collective and hands its core to the one behind, which catches up). R4 (session 23): ddp x4 on the
    # loopback priced 17.3 ms of waiting, 3.0 of it this wait, where the run waited 13.7.
    slowest_wait_s = case.kernel_slowest_wait_s if spec.traits.synchronous and oversubscription <= 1 else 0.0
    probe_wait_s = sync_overhead_s if world > 1 and not comm.holds_sync_wait else 0.0
    sync_s = max(probe_wait_s, slowest_wait_s)
    # Turn-taking for a core: the step cannot be shorter than the CPU work ranks / cores times over.
    # Counted for DDP and FSDP too, whose probes hold the turn-taking of their own (tiny) compute only:
    # with the compute timed as kernels, CNN ddp x4 on 2 cores went from -63% to -33% and the MLP's from
    # -15% to +11% (benchmarks/predict_local.py, docs/calibrate.md).
    # The rank's own CPU work alone is its busy time over the stretch proper (not over its share: a
    # pipeline rank takes turns for a core with its stages' work, not the whole model's).
    busy_s = compute_s + optimizer_s + data_s
    turn_wait_s = busy_period_s(busy_s / stretch, stretch, oversubscription) - busy_s
    if turn_wait_s > 0:
        notes.append(f"{world} computing ranks on {case.cores} cores: each waits its turn for a core "
                     f"({turn_wait_s * 1e3:.2f} ms a step, counted as waiting)")
    # After each wait the rank's next forward runs slower (calibrate/facts.py KERNEL_PAUSES_S): the kernels'
    # extra after a pause, at this step's wait spread over its waits, stretched as the compute is.
    waits = estimator.local_waits_per_step(spec, case)
    wait_s = comm.comm_s + sync_s + max(turn_wait_s, 0.0)
    after_wait_s = waits * pause_extra_s(facts, wait_s / waits) * stretch if waits > 0 and wait_s > 0 else 0.0
    forward_s += after_wait_s
    if after_wait_s > 0:
        notes.append(f"after each of its waits ({waits:g} a step, {wait_s / waits * 1e3:.2f} ms each) a rank "
                     f"computes {after_wait_s / waits * 1e3:.2f} ms slower (its kernels timed after a pause)")
    if facts.get("kernels_error"):
        notes.append(f"the workload's kernels could not be timed in ranks ({facts['kernels_error']}): "
                     f"compute priced from FLOPs and bytes instead")
    if facts.get("kernels"):
        notes.append(f"compute alone: this workload's forward and backward timed on this machine "
                     f"({facts['kernels']['steps']} steps at {facts['per_rank_batch']} samples), not its FLOPs")
    breakdown = {"data_s": data_s, "forward_s": forward_s, "backward_s": backward_s,
                 "comm_wait_s": comm.comm_s + sync_s + max(turn_wait_s, 0.0), "optimizer_s": optimizer_s}
    memory = estimator.local_memory(spec, case)
    link = case.link
    return {
        "step_s": sum(breakdown.values()),
        "breakdown_s": breakdown,
        "compute_flops_per_step": facts["flops"],
        "ops_per_step": facts["ops"],
        "oversubscription": oversubscription,
        "compute_stretch": stretch,
        "sync_overhead_s": sync_s,
        "link": {"alpha_s": link[0], "bandwidth_bytes_per_s": link[1]} if link else None,
        "memory_bytes": memory,
        "model_state_bytes": sum(memory["worker"].values()),
        "notes": notes,
    }


def measured_from_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures predict_local predicts, from analysis.summary's to_dict()."""
    mem = summary.get("memory_bytes_by_rank", {})
    rank0 = mem.get("0", mem.get(0, {}))
    states = {k: int(rank0.get(k, 0)) for k in ("parameters", "gradients", "optimizer")}
    return {
        "step_s": summary.get("mean_step_s"),
        "breakdown_s": {p: summary.get("breakdown_mean_s", {}).get(p) for p in PHASES},
        "memory_bytes": states,
        "model_state_bytes": sum(states.values()),
        "compute_wall_over_cpu": compute_wall_over_cpu(summary),
    }


def compute_wall_over_cpu(summary: dict[str, Any]) -> float | None:
    """The ranks' forward and backward wall time over their threads' CPU time in them: 1.0-1.08 when a
    rank had its core to itself, more where other work took turns on the cores (the test suite beside a
    run: 1.5-2x). What tells a measured row disturbed by this machine from the predictor's miss."""
    ranks = [b for b in summary.get("breakdown_mean_s_by_rank", {}).values() if (b.get("compute_cpu_s") or 0) > 0]
    if not ranks:
        return None
    return sum(b["forward_s"] + b["backward_s"] for b in ranks) / sum(b["compute_cpu_s"] for b in ranks)


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    def err(p: float | None, m: float | None) -> float | None:
        return (p - m) / m if p is not None and m else None

    return {
        "step_s_error": err(predicted["step_s"], measured["step_s"]),
        "model_state_error": err(predicted["model_state_bytes"], measured["model_state_bytes"]),
    }
