"""`predict` and `plan` for a CNN (`cnn.py`) under DDP, FSDP or a parameter server.

The compute comes from the layer list (`cnn.layer_times_s`: implicit-GEMM
convolutions through the GPT model's efficiency curve, memory-bound layers
at the memory bandwidth); the communication from the strategy estimators
(`estimators/`: DDP, FSDP, ps-sync, ps-async, the ones advise ranks), given
a `Workload` whose compute time is exactly that compute:

    m        = global_batch / (dp x micro_batch)          micro-batches per step
    compute  = m (t_fwd(b) + t_bwd(b))
    DDP      step = compute + bucketed all-reduce of the fp32 gradients left over after the
                    last micro-batch's backward + optimizer step
    FSDP     step = m (t_fwd + t_bwd + per-unit all-gathers (forward, backward) and
                    reduce-scatter not hidden by prefetch) + optimizer step on the 1/dp shard
    PS       step = compute + push + server update + pull (sync), the server's NIC carrying
                    dp x the gradient each way and its CPU summing and stepping at the host's
                    memory bandwidth (PAPERS.md item 14); async as `strategies.parameter_server`.

Memory per GPU by category: fp32 parameters, gradients and optimizer states
(divided by dp under FSDP; none on a PS worker, whose server holds them),
activations of one micro-batch, and other (framework overhead, DDP's two
gradient buckets, FSDP's two gathered units).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from ddlscope.predict import cnn
from ddlscope.predict import strategies as pst
from ddlscope.predict.catalogue import Cluster, make_cluster
from ddlscope.predict.cnn import CNNSpec
from ddlscope.predict.estimators import ClusterCase, estimator_for
from ddlscope.predict.planner import PlanResult, PlanRow, divisors
from ddlscope.predict.specs import ParallelSpec, Prediction
from ddlscope.specs import STRATEGY_SPECS, ConfigError, StrategySpec
from ddlscope.specs.strategies.ddp import DDPSpec
from ddlscope.specs.strategies.fsdp import FSDPSpec
from ddlscope.specs.strategies.ps import PSAsyncSpec, PSSyncSpec

GB = 1e9
# The strategies a CNN is priced under: the main study's replicated and sharded collectives and its
# synchronous and asynchronous parameter servers, each by its spec class (their names are their own).
CNN_STRATEGY_SPECS: tuple[type[StrategySpec], ...] = (DDPSpec, FSDPSpec, PSSyncSpec, PSAsyncSpec)
CNN_STRATEGIES: tuple[str, ...] = tuple(cls.registered_name for cls in CNN_STRATEGY_SPECS)
# plan ranks the synchronous ones: the same training, only faster or slower
PLAN_STRATEGIES: tuple[str, ...] = tuple(cls.registered_name for cls in CNN_STRATEGY_SPECS if cls.traits.synchronous)
WEIGHT_BYTES_PER_PARAM = 4.0  # fp32 parameters and gradients (PyTorch AMP keeps them fp32)
# Host-memory bytes a parameter server moves per gradient byte it sums: read the arriving
# gradient, read and write the running sum.
SERVER_SUM_PASSES = 3
# Per parameter, one optimizer step reads and writes fp32 tensors: SGD reads weight and
# gradient and writes the weight (3 passes), each state tensor adds a read and a write.
OPTIMIZER_BASE_PASSES = 3
STATE_TENSORS = {"sgd": 0, "sgd-momentum": 1, "adamw": 2}


@dataclass
class CNNPrediction(Prediction):
    """A CNN's predicted step: `Prediction`'s fields (a token is an image) and the model's counts."""

    strategy: str = CNN_STRATEGIES[0]
    parameters: int = 0
    forward_gmacs_per_sample: float = 0.0  # multiply-adds, conv + linear
    forward_gflops_per_sample: float = 0.0  # 2 x the multiply-adds
    activation_mb_per_sample: float = 0.0  # saved for backward, 1e6 bytes
    images_per_s_per_gpu: float = 0.0
    comm_s: float = 0.0  # the strategy's communication per step on the wire (hidden or not)
    server_memory_gb: float | None = None  # a parameter server's weights + optimizer states
    fsdp_units: int = 0


def optimizer_bytes_per_param(optimizer: str) -> float:
    return STATE_TENSORS[optimizer] * WEIGHT_BYTES_PER_PARAM


def optimizer_step_s(params: float, optimizer: str, bytes_per_s: float) -> float:
    passes = OPTIMIZER_BASE_PASSES + 2 * STATE_TENSORS[optimizer]
    return passes * WEIGHT_BYTES_PER_PARAM * params / bytes_per_s


def strategy_of(parallel: ParallelSpec, strategy: str | None) -> str:
    """The strategy a CNN configuration names: --strategy, else ZeRO-3 = FSDP, else DDP."""
    sharded = next(cls.registered_name for cls in CNN_STRATEGY_SPECS if cls.traits.shards_model_states)
    if strategy is None:
        return sharded if parallel.zero == 3 else CNN_STRATEGIES[0]
    if strategy not in CNN_STRATEGIES:
        raise ConfigError(f"strategy = {strategy!r}: allowed for a CNN: {', '.join(CNN_STRATEGIES)}")
    if parallel.zero == 3 and strategy != sharded:
        raise ConfigError(f"zero = 3 is FSDP: it does not go with strategy = {strategy!r}")
    return strategy


def validate_cnn_parallel(spec: CNNSpec, parallel: ParallelSpec, cluster: Cluster, strategy: str) -> None:
    cnn.validate_cnn(spec)
    for name in ("tp", "pp", "interleave"):
        if getattr(parallel, name) != 1:
            raise ConfigError(f"{name} = {getattr(parallel, name)}: a CNN trains data-parallel here "
                              "(tp = pp = interleave = 1)")
    if parallel.recompute != "none" or parallel.sequence_parallel:
        raise ConfigError("recompute and sequence parallelism are GPT options: a CNN takes neither")
    if parallel.fused_grad_accumulation:
        raise ConfigError("fused_grad_accumulation is a GPT option (Megatron-LM's weight-gradient GEMM adding into "
                          "its buffer): a CNN does not take it")
    if parallel.zero not in (0, 3):
        raise ConfigError(f"zero = {parallel.zero}: for a CNN 0 (DDP, or a parameter server) or 3 (FSDP)")
    if parallel.micro_batch < 1 or parallel.dp < 1:
        raise ConfigError("dp and micro_batch must be >= 1")
    if parallel.dp != cluster.n_gpus:
        raise ConfigError(f"dp = {parallel.dp}: a CNN uses every GPU of the cluster ({cluster.n_gpus}); for fewer, "
                          f"name a smaller cluster (e.g. {cluster.name}:1x{parallel.dp})")
    if spec.global_batch % (parallel.dp * parallel.micro_batch):
        raise ConfigError(f"global_batch = {spec.global_batch}: must be divisible by dp x micro_batch = "
                          f"{parallel.dp} x {parallel.micro_batch} = {parallel.dp * parallel.micro_batch}")
    if _has_servers(strategy) and not cluster.node.host_memory_bytes_per_s:
        raise ConfigError(f"strategy = {strategy!r}: the catalogue has no host CPU figures for {cluster.name} "
                          "(host_memory_gb_per_s); use a cluster that has them, e.g. paper-fast or paper-slow")
    cluster.device.peak(spec.dtype)


def _strategy_spec(strategy: str, parallel: ParallelSpec) -> StrategySpec:
    """The strategy's spec with the configuration's knobs (DDP's bucket size)."""
    cls = STRATEGY_SPECS.get(strategy)
    return cls(bucket_mb=parallel.bucket_mb) if "bucket_mb" in cls.model_fields else cls()


def _shards(strategy: str) -> bool:
    """Whether the strategy shards the model states (ZeRO-3)."""
    return STRATEGY_SPECS.get(strategy).traits.shards_model_states


def _has_servers(strategy: str) -> bool:
    """Whether the strategy's optimizer steps on parameter servers (a CPU host the catalogue must price)."""
    return not STRATEGY_SPECS.get(strategy).traits.local_optimizer


def _strategy_notes(strategy: str, traits: Any, counts: Any, server: pst.ServerSpec, cluster: Cluster,
                    weights: float, est: pst.StrategyEstimate) -> list[str]:
    notes: list[str] = []
    if traits.shards_model_states:
        notes.append(f"{strategy}: {counts.units} units (FULL_SHARD), every micro-batch gathers and reduce-scatters; "
                     "units are priced as equal shares of the model")
    if not traits.local_optimizer:
        where = "its NIC" if cluster.nodes > 1 else "its PCIe link to the GPUs"
        notes.append(f"{strategy}: one CPU server; {cluster.n_gpus} workers push {weights / 1e6:.0f} MB of gradients "
                     f"and pull the weights through {where} ({server.link_gb_per_s:.1f} GB/s); it sums at "
                     f"{server.aggregate_gb_per_s:.1f} GB/s and steps in {server.update_s * 1e3:.2f} ms (host "
                     f"memory {cluster.node.host_memory_bytes_per_s / 1e9:.1f} GB/s)")
    if not traits.synchronous:
        notes.append(f"{strategy}: mean staleness {est.mean_staleness_steps:.2f} steps")
    return notes


def server_spec(cluster: Cluster, params: float, optimizer: str) -> pst.ServerSpec:
    """One parameter server on a CPU host: its NIC (across nodes) or its PCIe link to the GPUs of
    its own node, summing and stepping at the host's memory bandwidth."""
    node = cluster.node
    link = node.inter if cluster.nodes > 1 else (node.host_link or node.intra)
    host_bw = node.host_memory_bytes_per_s
    return pst.ServerSpec(servers=1, link_gb_per_s=link.achieved_bytes_per_s / 1e9,
                          aggregate_gb_per_s=host_bw / SERVER_SUM_PASSES / 1e9, alpha_s=link.alpha_s,
                          update_s=optimizer_step_s(params, optimizer, host_bw))


def predict_cnn(spec: CNNSpec, parallel: ParallelSpec, cluster: Cluster, strategy: str | None = None,
                spot: bool = False, straggler: float = 1.0) -> CNNPrediction:
    """Validate and score one CNN configuration; `straggler`: one worker that many times slower."""
    strategy = strategy_of(parallel, strategy)
    validate_cnn_parallel(spec, parallel, cluster, strategy)
    dev = cluster.device
    counts = cnn.counts(spec)
    params = float(counts.params)
    n, b = cluster.n_gpus, parallel.micro_batch
    per_gpu = spec.global_batch // n
    m = per_gpu // b
    forward_mb, backward_mb = (float(x) for x in cnn.layer_times_s(spec, b, dev))
    compute_s = m * (forward_mb + backward_mb)
    hw_flops = float(cnn.hardware_flops_per_sample(spec))
    peak = dev.peak_flops.get(spec.compute_dtype) or dev.peak(spec.dtype)
    mem_bw = dev.memory_bandwidth_bytes_per_s * dev.efficiency.memory_fraction
    opt_bytes = optimizer_bytes_per_param(spec.optimizer)

    def workload(batch: int, micro_batches: int) -> pst.Workload:
        c = micro_batches * (forward_mb + backward_mb)
        return pst.Workload(name=spec.name, params=params, flops_per_sample=hw_flops, batch_per_worker=batch,
                            activation_bytes_per_sample=float(counts.activation_bytes_per_sample), dtype=spec.dtype,
                            grad_bytes_per_param=WEIGHT_BYTES_PER_PARAM,
                            state_bytes_per_param=2 * WEIGHT_BYTES_PER_PARAM + opt_bytes,
                            achieved_fraction=batch * hw_flops / (peak * c), layers=counts.units,
                            # gradients leave during the last micro-batch's backward only (DDP's no_sync)
                            backward_fraction=backward_mb / c if parallel.overlap_grad_reduce else 0.0)

    server = server_spec(cluster, params, spec.optimizer) if _has_servers(strategy) else pst.ServerSpec()

    def case(w: pst.Workload) -> ClusterCase:
        slowdowns = [1.0] * (cluster.n_gpus - 1) + [straggler] if straggler > 1 else None
        return ClusterCase(workload=w, cluster=cluster, stragglers=straggler, slowdowns=slowdowns, server=server,
                           activation_bytes=w.activation_bytes_per_sample * b,
                           weight_bytes_per_param=WEIGHT_BYTES_PER_PARAM, optimizer_bytes_per_param=opt_bytes)

    weights = WEIGHT_BYTES_PER_PARAM * params
    activations = counts.activation_bytes_per_sample * b
    strategy_spec = _strategy_spec(strategy, parallel)
    traits, estimator = strategy_spec.traits, estimator_for(strategy_spec)
    # Sharded model states are gathered for every micro-batch; the others exchange once a step.
    sharded = traits.shards_model_states
    est = estimator.cluster(strategy_spec, case(workload(b, 1) if sharded else workload(per_gpu, m)))
    repeats = m if sharded else 1
    step_wo_opt, comm, exposed = repeats * est.step_s, repeats * est.comm_s, repeats * est.exposed_comm_s
    zero_comm, dp_sync = (exposed, 0.0) if sharded else (0.0, exposed)
    shards = n if sharded else 1
    optimizer_bytes = opt_bytes * params / shards if traits.local_optimizer else 0.0  # else on the servers
    optimizer_s = optimizer_step_s(params / shards, spec.optimizer, mem_bw) if traits.local_optimizer else 0.0
    states = {"parameters": weights / shards, "gradients": weights / shards, "optimizer": optimizer_bytes}
    other = dev.framework_overhead_bytes + estimator.communication_buffer_bytes(
        strategy_spec, weights, WEIGHT_BYTES_PER_PARAM * counts.largest_unit_params)
    server_memory = (weights + opt_bytes * params) / GB if not traits.local_optimizer else None
    notes = _strategy_notes(strategy, traits, counts, server, cluster, weights, est)
    notes.extend(est.notes)
    step_s = step_wo_opt + optimizer_s
    memory = {**states, "activations": activations, "other": other}
    total = sum(memory.values())
    fits = total <= dev.memory_bytes
    if not fits:
        notes.append(f"needs {total / GB:.1f} GB per GPU; {dev.key} has {dev.memory_bytes / GB:.1f} GB")
    model_flops = 3 * counts.forward_flops_per_sample * spec.global_batch
    hardware_flops = hw_flops * spec.global_batch
    images_per_gpu = spec.global_batch / step_s / n
    parallel_dict = {**asdict(parallel), "strategy": strategy}
    return CNNPrediction(
        cluster=str(cluster), model=model_dict(spec), parallel=parallel_dict, step_time_s=step_s,
        tflops_per_gpu=hardware_flops / (step_s * n) / 1e12, mfu=model_flops / (step_s * n * peak),
        hfu=hardware_flops / (step_s * n * peak), tokens_per_s_per_gpu=images_per_gpu,
        samples_per_s=spec.global_batch / step_s, memory_gb_per_gpu=total / GB,
        memory_breakdown_gb={k: v / GB for k, v in memory.items()}, memory_capacity_gb=dev.memory_bytes / GB,
        fits=fits, energy_kwh_per_step=n * dev.power_w * step_s / 3.6e6,
        cost_usd_per_step=n * (dev.spot_price_usd_per_hour if spot else dev.price_usd_per_hour) * step_s / 3600.0,
        breakdown_s={"compute": compute_s, "recompute_included": 0.0, "tp_comm": 0.0, "pp_p2p": 0.0,
                     "zero_comm": zero_comm, "dp_grad_sync": dp_sync, "embedding_sync": 0.0, "bubble": 0.0,
                     "optimizer": optimizer_s},
        micro_batches=m, bubble_fraction=0.0, notes=notes, strategy=strategy, parameters=counts.params,
        forward_gmacs_per_sample=counts.macs_per_sample / 1e9,
        forward_gflops_per_sample=counts.forward_flops_per_sample / 1e9,
        activation_mb_per_sample=counts.activation_bytes_per_sample / 1e6, images_per_s_per_gpu=images_per_gpu,
        comm_s=float(comm), server_memory_gb=server_memory, fsdp_units=counts.units)


# ---------------------------------------------------------------------------- plan
TERMS = {"compute": "compute", "dp_grad_sync": "gradient sync", "zero_comm": "FSDP gathers",
         "optimizer": "optimizer"}


def model_dict(spec: CNNSpec) -> dict[str, Any]:
    """The model as the prediction reports it: a recorded workload's layer list as its length."""
    out = asdict(spec)
    if spec.layers:
        out["layers"] = len(spec.layers)
    else:
        del out["layers"]
    return out


def label(p: CNNPrediction) -> str:
    return f"{p.strategy} DP{p.parallel['dp']} mb{p.parallel['micro_batch']}"


def plan_cnn(spec: CNNSpec, cluster: Cluster, top: int = 5, rank_by: str = "time", spot: bool = False,
             max_micro_batch: int = 64, overlap_grad_reduce: bool = True,
             fused_grad_accumulation: bool = False) -> PlanResult:
    """Every synchronous strategy (DDP, FSDP, ps-sync where the catalogue has the host) x every
    micro-batch dividing the per-GPU batch; by cost also every smaller whole number of nodes.
    `overlap_grad_reduce` (the stack's) holds for each; `fused_grad_accumulation` is refused by predict_cnn."""
    if rank_by not in ("time", "cost"):
        raise ConfigError(f"by = {rank_by!r}: allowed: time, cost")
    if top < 1:
        raise ConfigError(f"top = {top}: must be >= 1")
    cnn.validate_cnn(spec)
    start = time.perf_counter()
    node_counts = divisors(cluster.nodes) if rank_by == "cost" else [cluster.nodes]
    scored: list[CNNPrediction] = []
    for nodes in node_counts:
        sub = cluster if nodes == cluster.nodes else make_cluster(cluster.name, nodes, cluster.gpus_per_node)
        n = sub.n_gpus
        if spec.global_batch % n:
            continue
        strategies = [s for s in PLAN_STRATEGIES if not _has_servers(s) or sub.node.host_memory_bytes_per_s]
        for b in divisors(spec.global_batch // n, max_micro_batch):
            for strategy in strategies:
                parallel = ParallelSpec(dp=n, micro_batch=b, zero=3 if _shards(strategy) else 0,
                                        overlap_grad_reduce=overlap_grad_reduce,
                                        fused_grad_accumulation=fused_grad_accumulation)
                scored.append(predict_cnn(spec, parallel, sub, strategy, spot))
    search_s = time.perf_counter() - start
    if not scored and spec.global_batch % cluster.n_gpus:
        raise ConfigError(f"global_batch = {spec.global_batch}: must be divisible by the cluster's "
                          f"{cluster.n_gpus} GPUs")
    key = (lambda p: p.step_time_s) if rank_by == "time" else (lambda p: p.cost_usd_per_step)
    fitting = [p for p in scored if p.fits]
    best = min((key(p) for p in fitting), default=1.0) or 1.0
    # equal scores (to 1e-9 relative) go to the one needing less memory
    fitting.sort(key=lambda p: (round(key(p) / best, 9), p.memory_gb_per_gpu))
    rows = []
    for r, p in enumerate(fitting[:top]):
        runner_up = fitting[r + 1] if r + 1 < len(fitting) else None
        rows.append(PlanRow(rank=r + 1, prediction=p, why=_why(p, runner_up, rank_by)))
    return PlanResult(str(cluster), rank_by, len(scored), len(fitting), search_s, rows)


def _why(p: CNNPrediction, q: CNNPrediction | None, rank_by: str) -> str:
    if q is None:
        return "no other configuration fits"
    where = f" on {q.cluster}" if q.cluster != p.cluster else ""
    if rank_by == "time":
        lead = f"beats next ({label(q)}{where}) by {q.step_time_s - p.step_time_s:.3g} s"
    else:
        lead = f"beats next ({label(q)}{where}) by ${q.cost_usd_per_step - p.cost_usd_per_step:.3g}/step"
    deltas = sorted(((q.breakdown_s[t] - p.breakdown_s[t], t) for t in TERMS), reverse=True)
    parts = [f"less {TERMS[t]} (-{d:.3g} s)" for d, t in deltas[:2] if d > 1e-9]
    parts += [f"more {TERMS[t]} (+{-d:.3g} s)" for d, t in deltas[-1:] if d < -1e-9]
    if not parts:
        parts.append(f"same step time, {q.memory_gb_per_gpu - p.memory_gb_per_gpu:.3g} GB less memory per GPU")
    dominant = max(TERMS, key=lambda t: p.breakdown_s[t])
    return f"{lead}: {'; '.join(parts)}; {TERMS[dominant]} dominates its step"


