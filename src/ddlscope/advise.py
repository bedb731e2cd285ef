"""`ddlscope advise`: which data-parallel strategy to use for an experiment on a given GPU cluster.

For the experiment's workload (built on the meta device: shapes only, no
memory, no data) this module measures

* FLOPs of one per-GPU batch, forward + backward, with
  torch.utils.flop_counter.FlopCounterMode (attention through the math SDPA
  kernel so its matmuls are counted);
* the shapes of every nn.Linear, which go through the predict package's GEMM
  efficiency curve (`compute.gemm_s`) to give the fraction of peak the
  device reaches on this model;
* the bytes autograd saves for backward (activations);

then prices each strategy on the cluster with the predict package's
strategy models (`predict.strategies`: DDP bucketed all-reduce overlapped
with backward, FSDP all-gather x2 + reduce-scatter, parameter servers
through one server's link), adds model-state memory per strategy, cost per
step and time for the experiment's steps, and the statistical penalty of
staleness measured in local runs from the store. See docs/advise.md.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ddlscope.predict import strategies as pst
from ddlscope.predict.catalogue import GIB, Cluster, parse_cluster
from ddlscope.predict.estimators import ClusterCase, estimator_for
from ddlscope.predict.estimators.base import KNOB_NOTE_PREFIX
from ddlscope.specs import ConfigError, Experiment, StrategySpec, strategy_specs

# Among strategies this close in effective step time, the simpler one (Traits.simplicity) is preferred.
TIE_TOLERANCE = 0.03


def candidates(exp: Experiment) -> list[StrategySpec]:
    """Every registered multi-process strategy that can train the experiment's workload, simplest first:
    the experiment's own with its knobs, the others with their defaults. Federated strategies are not
    offered for another's place: they answer where the data must stay, not how to train fastest. Each is
    checked on at least 2 ranks (advise's own experiment has 1: it runs nothing), so that one that needs a
    neighbour (gossip) is not refused; a layout the target cluster cannot run is priced, with its reason."""
    mine = type(exp.strategy)
    specs = [exp.strategy if cls is mine else cls() for cls in strategy_specs()
             if not cls.traits.single_process and (cls is mine or cls.traits.family != "federated")]
    ranks = max(2, exp.cluster.world_size)
    multi = exp.model_copy(update={"cluster": exp.cluster.model_copy(update={"world_size": ranks})})
    return [spec for spec in specs if spec is exp.strategy or _can_train(spec, multi)]


def _can_train(spec: StrategySpec, exp: Experiment) -> bool:
    """Whether the strategy accepts the workload (e.g. a pipeline needs a model with layers to cut)."""
    try:
        spec.check_experiment(exp.model_copy(update={"strategy": spec}))
    except ConfigError:
        return False
    return True


def _asynchronous(specs: list[StrategySpec]) -> list[str]:
    return [s.name for s in specs if not s.traits.synchronous]


def _reference_syncs() -> tuple[str, str]:
    """The synchronous runs an async run's accuracy is compared with: the synchronous server (same
    server, same samples per update), else the simplest synchronous collective."""
    specs = strategy_specs()
    server = next(c for c in specs if c.traits.family == "server" and c.traits.synchronous)
    collective = next(c for c in specs if c.traits.family == "collective" and c.traits.synchronous)
    return server.registered_name, collective.registered_name


# ---------------------------------------------------------------------------- workload profile
@dataclass
class WorkloadProfile:
    """What one worker computes, stores and sends per step, measured on the built model."""

    name: str
    params: int
    batch_per_gpu: int
    flops_per_step: float  # one per-GPU batch, forward + backward
    linear_flops_per_step: float  # of which in nn.Linear GEMMs
    activation_bytes: float  # saved for backward, per-GPU batch
    dtype: str  # of the weights: fp32 -> TF32 peak
    weight_bytes_per_param: float
    optimizer: str
    optimizer_bytes_per_param: float
    units: int  # FSDP wrap units (strategies.units: transformer blocks, else top-level children with weights)
    gemms: list[tuple[int, int, int]] = field(default_factory=list)  # (m, n, k) of each Linear forward
    cnn: Any = None  # a predict.cnn.CNNSpec when the profile comes from its layer list (advise --model)
    transformer: Any = None  # a predict.ModelSpec when the planner's step model describes the model (a GPT)

    @property
    def state_bytes_per_param(self) -> float:
        return 2 * self.weight_bytes_per_param + self.optimizer_bytes_per_param


def profile_workload(exp: Experiment, workers: int) -> WorkloadProfile:
    """The experiment's per-GPU step, from the step profiler (runtime/profiler.py), on a model built
    on the meta device (shapes only: no parameter memory, whatever the model's size).

    An image model (a 4-D input: a built-in vision workload, `torchvision:`, `timm:`, your own) is
    priced as `predict --model` prices it: its forward recorded into the CNN layer model
    (predict/cnn.py), so advise and predict give it the same compute time."""
    import torch

    from ddlscope.runtime.profiler import cnn_layer_records, optimizer_states_per_param, profile_task
    from ddlscope.workloads import WORKLOADS

    spec = exp.workload
    batch = max(1, spec.batch_size // max(workers, 1))
    workload = WORKLOADS.get(spec.name)
    try:
        with torch.device("meta"):
            task = workload.build(spec, exp.seed)
    except Exception:  # a workload whose data loading needs real tensors: build it for real
        task = workload.build(spec, exp.seed)
    image, _ = task.train.get(torch.arange(1))
    if image.dim() == 4 and image.dtype.is_floating_point:
        on_meta = any(p.is_meta for p in task.model.parameters()) or image.is_meta
        if on_meta:  # the records need a real forward of one image
            task = workload.build(spec, exp.seed)
            image, _ = task.train.get(torch.arange(1))
        from ddlscope.predict.cnn import Layer

        layers = tuple(Layer(**record) for record in cnn_layer_records(task.model, image))
        return cnn_workload_profile(exp, spec.name, workers, image_size=int(image.shape[-1]),
                                    classes=int(task.model(image).shape[-1]), layers=layers)
    step = profile_task(task, batch)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(step.param_dtype, "fp32")
    weight_bytes = float(step.param_dtype.itemsize)
    return WorkloadProfile(transformer=transformer_spec(exp, task.model),
        name=spec.name, params=step.params, batch_per_gpu=batch, flops_per_step=float(step.flops),
        # each Linear's forward GEMM and its two backward GEMMs
        linear_flops_per_step=float(sum(6.0 * m * n * k for m, n, k in step.linear_gemms)),
        activation_bytes=float(step.activation_bytes), dtype=dtype, weight_bytes_per_param=weight_bytes,
        optimizer=spec.optimizer,
        optimizer_bytes_per_param=optimizer_states_per_param(spec.optimizer, spec.momentum) * weight_bytes,
        # FSDP's wrap units (strategies.units): the same count as the units `wrap = "block"` shards
        units=max(step.units, 1), gemms=list(step.linear_gemms))


def transformer_spec(exp: Experiment, model: Any) -> Any:
    """The experiment's model as the planner's step model (predict.ModelSpec), where it is one: ddlscope's
    GPT (untied output layer, learned positions), or a transformers decoder read off its config. None
    for anything else. Priced as `plan` prices a GPT: bf16 with fp32 master weights, flash attention."""
    from ddlscope.predict import ModelSpec
    from ddlscope.predict.specs import decoder_model_spec

    cfg = getattr(model, "cfg", None)
    if all(hasattr(cfg, k) for k in ("vocab_size", "seq_len", "layers", "hidden", "heads", "mlp_ratio")):
        return ModelSpec(hidden=cfg.hidden, heads=cfg.heads, layers=cfg.layers, seq=cfg.seq_len, vocab=cfg.vocab_size,
                         global_batch=exp.workload.batch_size, ffn_hidden=cfg.mlp_ratio * cfg.hidden,
                         tied_embeddings=False, learned_positions=True, name=exp.workload.name)
    if exp.workload.name.startswith("hf:"):
        from ddlscope.workloads.sources import hf_architectures, hf_decoder_facts

        if exp.workload.model_name in hf_architectures()[0]:
            return decoder_model_spec(hf_decoder_facts(exp.workload), global_batch=exp.workload.batch_size,
                                      name=exp.workload.name)
    return None


def cnn_workload_profile(exp: Experiment, model: str, workers: int, image_size: int = 224,
                         classes: int = 1000, layers: tuple[Any, ...] = ()) -> WorkloadProfile:
    """The per-GPU step of a CNN from its torch-free layer list (predict/cnn.py) instead of a built
    model: `advise --model resnet50|vgg16|densenet121`, or `layers` recorded from a workload's model;
    the experiment gives batch and optimizer."""
    from ddlscope.predict import cnn

    spec = exp.workload
    batch = max(1, spec.batch_size // max(workers, 1))
    states = 2 if spec.optimizer == "adamw" else (1 if spec.momentum > 0 else 0)
    optimizer = {0: "sgd", 1: "sgd-momentum", 2: "adamw"}[states]
    net = cnn.CNNSpec(model, global_batch=spec.batch_size, image_size=image_size, classes=classes,
                      optimizer=optimizer, layers=layers)
    counts = cnn.counts(net)
    gemms = [(batch * m, n, k) for layer in cnn.layers_of(net) if layer.kind in ("conv", "linear")
             for m, n, k, _ in [layer.gemm]]
    return WorkloadProfile(
        name=model, params=counts.params, batch_per_gpu=batch,
        flops_per_step=float(batch * cnn.hardware_flops_per_sample(net)),
        linear_flops_per_step=float(sum(6.0 * m * n * k for m, n, k in gemms)),
        activation_bytes=float(batch * counts.activation_bytes_per_sample), dtype="fp32", weight_bytes_per_param=4.0,
        optimizer=spec.optimizer, optimizer_bytes_per_param=4.0 * states, units=counts.units, gemms=gemms, cnn=net)


def achieved_fraction(profile: WorkloadProfile, cluster: Cluster) -> float:
    """Fraction of the device's peak this model's step reaches, from the predict package's GEMM curve.

    Each Linear costs its forward GEMM and its two backward GEMMs through `compute.gemm_s`
    (efficiency by output shape, with a memory roofline); FLOPs outside Linear layers
    (attention matmuls, element-wise) run at the Linear layers' FLOP-weighted efficiency.
    """
    from ddlscope.predict import compute

    device = cluster.device
    peak = _peak(profile, cluster)
    if profile.cnn is not None:  # the layer model's compute time (convolutions, norms, pools; predict/cnn.py)
        from ddlscope.predict import cnn

        forward, backward = cnn.layer_times_s(profile.cnn, profile.batch_per_gpu, device)
        return max(min(profile.flops_per_step / (peak * float(forward + backward)), 1.0), 1e-6)
    if not profile.gemms or profile.linear_flops_per_step <= 0:
        return device.efficiency.gemm_kernel_fraction * device.efficiency.sustained_fraction * 0.5
    bpe = profile.weight_bytes_per_param
    linear_s = 0.0
    for m, n, k in profile.gemms:
        linear_s += float(compute.gemm_s(m, n, k, device, peak, bytes_per_element=bpe)
                          + compute.gemm_s(m, k, n, device, peak, bytes_per_element=bpe)
                          + compute.gemm_s(k, n, m, device, peak, bytes_per_element=bpe))
    fraction = profile.linear_flops_per_step / (peak * linear_s)
    return max(min(fraction, 1.0), 1e-6)


def _peak(profile: WorkloadProfile, cluster: Cluster) -> float:
    peaks = cluster.device.peak_flops
    compute_dtype = "tf32" if profile.dtype == "fp32" else profile.dtype
    return peaks.get(compute_dtype) or cluster.device.peak(profile.dtype)


# ---------------------------------------------------------------------------- staleness from local runs
@dataclass
class StalenessPenalty:
    measured: bool
    text: str
    sync_run: int | None = None
    async_run: int | None = None
    metric_name: str | None = None
    final_metric_ratio: float | None = None  # async final / sync final
    samples_ratio: float | None = None  # samples async needed to reach sync's final metric / sync's samples
    factor: float = 1.0  # multiplies the step time in the ranking (more samples for the same result)


def _higher_is_better(metric_name: str) -> bool:
    return metric_name == "accuracy"


def _eval_curve(store: Any, run_id: int) -> list[tuple[float, float]]:
    """(samples seen, metric) of one evaluating rank, in order."""
    rows = [r for r in store.evals(run_id) if r["metric"] is not None]
    if not rows:
        return []
    rank = min(r["rank"] for r in rows)
    return sorted((float(r["samples_seen"] or 0), float(r["metric"])) for r in rows if r["rank"] == rank)


def _samples_to_reach(curve: list[tuple[float, float]], target: float, higher: bool) -> float | None:
    for samples, metric in curve:
        if (metric >= target) if higher else (metric <= target):
            return samples
    return None


def _comparable(run: Any) -> str:
    """What must match for two runs' accuracy to be compared: the workload's settings, the world
    size and the stragglers (staleness grows with both); seeds, networks and strategy knobs may differ."""
    config = run.config or {}
    cluster = config.get("cluster", {})
    return json.dumps([config.get("workload"), run.world_size, cluster.get("slowdown")], sort_keys=True)


def staleness_penalties(db: Path | None, workload: str, asynchronous: list[str]) -> dict[str, StalenessPenalty]:
    """Per async strategy: its finished local runs of `workload` with the newest settings that
    ps-sync (else ddp) runs share, against those runs; several runs (seeds) give a median.

    Asynchronous runs repeat badly (the order updates arrive in changes the result: the main
    study's ps-async cell, with momentum 0.9, ended anywhere from 10% to 91% accuracy on one
    seed), so one pair of runs is a sample, not a measurement; `ddlscope study paper
    --repeats N` stores N seeds.
    """
    missing = {s: StalenessPenalty(False, f"not measured (no store at {db})") for s in asynchronous}
    if db is None or not Path(db).exists():
        return missing
    from ddlscope.store import Store

    server_sync, collective_sync = _reference_syncs()
    syncs_text = f"{server_sync} or {collective_sync}"
    with Store(db) as store:
        sync_runs = store.find_runs(workload=workload, strategy=server_sync) + store.find_runs(
            workload=workload, strategy=collective_sync)
        if not sync_runs:
            return {s: StalenessPenalty(False, f"not measured (no finished {syncs_text} run of {workload})")
                    for s in asynchronous}
        sync_keys = [_comparable(r) for r in sync_runs]
        out: dict[str, StalenessPenalty] = {}
        for strategy in asynchronous:
            runs = store.find_runs(workload=workload, strategy=strategy)
            if not runs:
                out[strategy] = StalenessPenalty(False, f"not measured (no finished {strategy} run of {workload})")
                continue
            keys = [_comparable(r) for r in runs]
            usable = [(k, r) for k, r in zip(keys, runs) if k in sync_keys]
            if not usable:
                out[strategy] = StalenessPenalty(False, f"not measured (no {syncs_text} run with the workload "
                                                        f"settings, world size and stragglers of a {strategy} run; "
                                                        f"newest: run {runs[0].id})")
                continue
            key = usable[0][0]  # the newest settings that can be compared
            syncs = [r for k, r in zip(sync_keys, sync_runs) if k == key]
            # the synchronous server is the closer reference (same server, same samples per update)
            syncs = [r for r in syncs if r.strategy == server_sync] or syncs
            out[strategy] = _pooled(store, syncs, [r for k, r in usable if k == key])
        return out


def _pooled(store: Any, syncs: list[Any], asyncs: list[Any]) -> StalenessPenalty:
    """Each async run against the sync run with the median final metric; the median of their factors."""
    from ddlscope.analysis.summary import summarize

    sync_summaries = [(run, summarize(store, run)) for run in syncs]
    finals = [(final, i) for i, (_, summary) in enumerate(sync_summaries)
              if (final := _final_value(summary)) is not None]
    sync, sync_sum = sync_summaries[statistics.median_low(finals)[1]] if finals else sync_summaries[0]
    penalties = [_compare(store, sync, sync_sum, run, summarize(store, run)) for run in asyncs]
    measured = sorted((p for p in penalties if p.measured), key=lambda p: p.factor)
    if len(measured) < 2:
        return measured[0] if measured else penalties[0]
    typical = measured[(len(measured) - 1) // 2]
    typical.factor = statistics.median(p.factor for p in measured)
    reference = f"the median of {len(syncs)} {sync.strategy} runs" if len(syncs) > 1 else f"{sync.strategy}"
    typical.text = (f"{typical.factor:.2f}x, the median of {len(measured)} runs against {reference} "
                    f"(from {measured[0].factor:.2f}x to {measured[-1].factor:.2f}x); the median run: {typical.text}")
    return typical


def _final_value(summary: Any) -> float | None:
    if summary.final_eval:
        return float(summary.final_eval["metric"])
    return float(summary.final_loss) if summary.final_loss is not None else None


def _compare(store: Any, sync: Any, sync_sum: Any, run: Any, run_sum: Any) -> StalenessPenalty:
    if sync_sum.final_eval and run_sum.final_eval and sync_sum.final_eval.get("metric_name") == \
            run_sum.final_eval.get("metric_name"):
        name = str(sync_sum.final_eval["metric_name"])
        s_final, a_final = float(sync_sum.final_eval["metric"]), float(run_sum.final_eval["metric"])
    elif sync_sum.final_loss is not None and run_sum.final_loss is not None:
        name, s_final, a_final = "loss", float(sync_sum.final_loss), float(run_sum.final_loss)
    else:
        return StalenessPenalty(False, f"not measured (runs {sync.id}/{run.id} have no final metric)",
                                sync_run=sync.id, async_run=run.id)
    higher = _higher_is_better(name)
    ratio = a_final / s_final if s_final else None
    pen = StalenessPenalty(True, "", sync_run=sync.id, async_run=run.id, metric_name=name, final_metric_ratio=ratio)
    worse = 1.0
    if ratio:
        worse = max(1.0, (1.0 / ratio) if higher else ratio)
    text = f"final {name} {a_final:.4g} vs {s_final:.4g} for {sync.strategy} (ratio {ratio:.3f})" if ratio else \
        f"final {name} {a_final:.4g} vs {s_final:.4g} for {sync.strategy}"
    sync_curve, async_curve = _eval_curve(store, sync.id), _eval_curve(store, run.id)
    if sync_curve and async_curve:
        s_need = _samples_to_reach(sync_curve, s_final, higher)
        a_need = _samples_to_reach(async_curve, s_final, higher)
        if s_need and a_need:
            pen.samples_ratio = a_need / s_need
            worse = max(pen.samples_ratio, 1.0)
            text += f"; {pen.samples_ratio:.2f}x the samples to reach {sync.strategy}'s final {name}"
        elif s_need and a_need is None:
            text += f"; never reached {sync.strategy}'s final {name}"
    pen.factor = worse
    pen.text = text + f" (runs {run.id} vs {sync.id})"
    return pen


# ---------------------------------------------------------------------------- per-strategy estimates
@dataclass
class StrategyAdvice:
    strategy: str
    synchronous: bool
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    comm_compute_ratio: float
    samples_per_s: float
    memory_bytes_per_gpu: float
    memory_gib_per_gpu: float
    server_memory_gib: float | None
    fits: bool
    cost_usd_per_step: float
    experiment_steps: int
    experiment_time_s: float
    experiment_cost_usd: float
    mean_staleness_steps: float
    staleness_penalty: str
    staleness_factor: float
    effective_step_s: float  # step_s x staleness factor: what the ranking uses
    rank: int = 0
    notes: list[str] = field(default_factory=list)
    layout: dict[str, Any] | None = None  # the planner's ParallelSpec fields, where priced as plan prices it


@dataclass
class Advice:
    experiment: str
    workload: dict[str, Any]
    cluster: str
    device: str
    workers: int
    stragglers: float
    achieved_fraction_of_peak: float
    strategies: list[StrategyAdvice]
    recommendation: str
    reasons: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def by_name(self, name: str) -> StrategyAdvice:
        return next(s for s in self.strategies if s.strategy == name)


def advise(exp: Experiment, cluster: Cluster | str, stragglers: float = 1.0, db: Path | None = None,
           profile: WorkloadProfile | None = None) -> Advice:
    """Rank the six strategies for `exp` on `cluster` (a Cluster, or a catalogue cluster string);
    see the module docstring."""
    if isinstance(cluster, str):
        cluster = parse_cluster(cluster)
    if not (stragglers >= 1.0) or math.isinf(stragglers):
        raise ConfigError(f"--stragglers = {stragglers}: must be a finite number >= 1 (1 = no straggler)")
    n = cluster.n_gpus
    batch = exp.workload.batch_size
    if batch < n or batch % n:  # each GPU takes batch / n samples: a fraction of one is no batch
        suggestion = n * max(1, round(batch / n))
        raise ConfigError(f"workload.batch_size = {batch}: must be a multiple of the {n} GPUs of {cluster} "
                          f"(each takes batch_size / {n} samples); e.g. --batch-size {suggestion}")
    profile = profile or profile_workload(exp, n)
    fraction = achieved_fraction(profile, cluster)
    pw = pst.Workload(name=profile.name, params=float(profile.params),
                      flops_per_sample=profile.flops_per_step / profile.batch_per_gpu,
                      batch_per_worker=profile.batch_per_gpu,
                      activation_bytes_per_sample=profile.activation_bytes / profile.batch_per_gpu,
                      dtype=profile.dtype, grad_bytes_per_param=profile.weight_bytes_per_param,
                      state_bytes_per_param=profile.state_bytes_per_param, achieved_fraction=fraction,
                      layers=profile.units)
    slowdowns: Sequence[float] | None = [stragglers] + [1.0] * (n - 1) if stragglers > 1.0 else None
    # One parameter server on one of the cluster's nodes: its NIC (or the node's link when all fits in a node).
    link = cluster.node.inter if cluster.nodes > 1 else cluster.node.intra
    dev = cluster.device
    server = pst.ServerSpec(servers=1, link_gb_per_s=link.achieved_bytes_per_s / 1e9,
                            aggregate_gb_per_s=dev.memory_bandwidth_bytes_per_s * dev.efficiency.memory_fraction
                            / 3 / 1e9, alpha_s=link.alpha_s)
    case = ClusterCase(workload=pw, cluster=cluster, stragglers=stragglers, slowdowns=slowdowns, server=server,
                       activation_bytes=profile.activation_bytes, weight_bytes_per_param=profile.weight_bytes_per_param,
                       optimizer_bytes_per_param=profile.optimizer_bytes_per_param)
    specs = candidates(exp)
    penalties = staleness_penalties(db, profile.name, _asynchronous(specs))
    usable = dev.memory_bytes - dev.framework_overhead_bytes
    rows = [_planned_row(spec, profile.transformer, layout, case, penalties, exp.workload.steps)
            if profile.transformer is not None and (layout := estimator_for(spec).transformer_layout(spec, n))
            else _advice_row(spec, case, penalties, usable, exp.workload.steps) for spec in specs]
    ranked = _rank(rows, [spec.name for spec in specs])
    winner = ranked[0]
    reasons = _reasons(ranked, winner, profile, cluster, stragglers, fraction, usable,
                       {spec.name: spec for spec in specs})
    return Advice(experiment=exp.name or exp.workload.name, workload=_workload_dict(profile), cluster=str(cluster),
                  device=dev.key, workers=n, stragglers=stragglers, achieved_fraction_of_peak=fraction,
                  strategies=ranked, recommendation=winner.strategy if winner.fits else NOTHING_FITS,
                  reasons=reasons)


NOTHING_FITS = "none"  # the recommendation where no strategy fits the device
RECOMPUTE_OPTIONS = ("none", "selective", "full")


def _planned_row(spec: StrategySpec, model: Any, layout: dict[str, Any], case: ClusterCase,
                 penalties: dict[str, StalenessPenalty], steps: int) -> StrategyAdvice:
    """A transformer under a layout of the planner, priced by its step model (predict.predict, what
    `plan` ranks): the fastest micro-batch and recompute that fit, else the one needing least memory."""
    from ddlscope.predict import ParallelSpec, predict

    cluster = case.cluster
    per_gpu = model.global_batch // layout["dp"]
    options = [predict(model, ParallelSpec(**layout, micro_batch=mb, recompute=rc), cluster)
               for mb in range(1, per_gpu + 1) if per_gpu % mb == 0 for rc in RECOMPUTE_OPTIONS]
    fitting = [p for p in options if p.fits]
    best = min(fitting, key=lambda p: p.step_time_s) if fitting else min(options, key=lambda p: p.memory_gb_per_gpu)
    label = ParallelSpec(**best.parallel).label() if isinstance(best.parallel, dict) else str(best.parallel)
    breakdown = best.breakdown_s
    # The step model knows no straggler: the slowest worker's compute sets every synchronous step.
    compute = float(breakdown["compute"]) * case.stragglers
    step = float(best.step_time_s) + compute - float(breakdown["compute"])
    exposed = float(breakdown["dp_grad_sync"] + breakdown["zero_comm"])
    memory = float(best.memory_gb_per_gpu) * 1e9
    price, n = cluster.device.price_usd_per_hour, cluster.n_gpus
    pen = penalties.get(spec.name, StalenessPenalty(True, "none (synchronous: no staleness)"))
    return StrategyAdvice(
        strategy=spec.name, synchronous=spec.traits.synchronous, step_s=step, compute_s=compute,
        comm_s=exposed, exposed_comm_s=exposed, comm_compute_ratio=exposed / compute if compute else math.inf,
        samples_per_s=model.global_batch / step, memory_bytes_per_gpu=memory, memory_gib_per_gpu=memory / GIB,
        server_memory_gib=None, fits=bool(best.fits), cost_usd_per_step=price * n * step / 3600.0,
        experiment_steps=steps, experiment_time_s=steps * step, experiment_cost_usd=price * n * step * steps / 3600.0,
        mean_staleness_steps=0.0, staleness_penalty=pen.text, staleness_factor=pen.factor,
        effective_step_s=step * pen.factor,
        notes=[f"priced as `ddlscope plan` prices {label} ({model.dtype} with fp32 master weights, "
               f"{model.attention} attention)"], layout=dict(best.parallel))


def _advice_row(spec: StrategySpec, case: ClusterCase, penalties: dict[str, StalenessPenalty], usable: float,
                steps: int) -> StrategyAdvice:
    estimator = estimator_for(spec)
    est = estimator.cluster(spec, case)
    mem, server_mem = estimator.cluster_memory(spec, case)
    pen = penalties.get(spec.name, StalenessPenalty(True, "none (synchronous: no staleness)"))
    step = float(est.step_s)
    price, n = case.cluster.device.price_usd_per_hour, case.cluster.n_gpus
    return StrategyAdvice(
        strategy=spec.name, synchronous=spec.traits.synchronous, step_s=step, compute_s=float(est.compute_s),
        comm_s=float(est.comm_s), exposed_comm_s=float(est.exposed_comm_s),
        comm_compute_ratio=float(est.comm_s) / float(est.compute_s) if est.compute_s else math.inf,
        samples_per_s=float(est.samples_per_s), memory_bytes_per_gpu=mem, memory_gib_per_gpu=mem / GIB,
        server_memory_gib=server_mem / GIB if server_mem is not None else None, fits=mem <= usable,
        cost_usd_per_step=price * n * step / 3600.0, experiment_steps=steps, experiment_time_s=steps * step,
        experiment_cost_usd=price * n * step * steps / 3600.0, mean_staleness_steps=float(est.mean_staleness_steps),
        staleness_penalty=pen.text, staleness_factor=pen.factor, effective_step_s=step * pen.factor,
        notes=list(est.notes) + estimator.cluster_notes(spec, case))


def _workload_dict(profile: WorkloadProfile) -> dict[str, Any]:
    d = asdict(profile)
    d.pop("gemms")
    for key in ("cnn", "transformer"):
        if d[key] is None:
            d.pop(key)
    d["state_bytes_per_param"] = profile.state_bytes_per_param
    return d


def _rank(rows: list[StrategyAdvice], simplest_first: list[str]) -> list[StrategyAdvice]:
    """Fitting strategies first, by effective step time; near-ties (3%) go to the earlier, simpler one."""
    order = {name: i for i, name in enumerate(simplest_first)}
    ranked = sorted(rows, key=lambda r: (not r.fits, r.effective_step_s, order[r.strategy]))
    fitting = [r for r in ranked if r.fits]
    if fitting:
        best = fitting[0].effective_step_s
        close = [r for r in fitting if r.effective_step_s <= best * (1 + TIE_TOLERANCE)]
        first = min(close, key=lambda r: order[r.strategy])
        ranked.remove(first)
        ranked.insert(0, first)
    for i, r in enumerate(ranked, 1):
        r.rank = i
    return ranked


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _gib(b: float) -> str:
    return f"{b / GIB:.3g} GiB"


def duration_text(s: float) -> str:
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h"


def _framework_roles(specs: list[StrategySpec]) -> tuple[str, str, str, str]:
    """The four strategies the main study's decision framework weighs, by their traits (simplest of
    each): replicated collective, sharded collective, synchronous server, asynchronous server."""
    def simplest(family: str, **traits: bool) -> str:
        return next(s.name for s in specs if s.traits.family == family
                    and all(getattr(s.traits, k) == v for k, v in traits.items()))

    return (simplest("collective", shards_model_states=False), simplest("collective", shards_model_states=True),
            simplest("server", synchronous=True), simplest("server", synchronous=False))


def _reasons(ranked: list[StrategyAdvice], winner: StrategyAdvice, profile: WorkloadProfile, cluster: Cluster,
             stragglers: float, fraction: float, usable: float, specs: dict[str, StrategySpec]) -> list[str]:
    by = {r.strategy: r for r in ranked}
    ddp, fsdp, sync, asyn = (by[name] for name in _framework_roles(list(specs.values())))
    n = cluster.n_gpus
    reasons: list[str] = []
    reasons.append(
        f"Compute: {profile.flops_per_step / 1e12:.3g} TFLOP per GPU per step ({profile.batch_per_gpu} samples, "
        f"{profile.params / 1e6:.4g}M parameters) at {fraction:.2g} of the {cluster.device.key} peak takes "
        f"{_ms(ddp.compute_s / stragglers)} per step"
        + (f" ({_ms(ddp.compute_s)} on the {stragglers:g}x slower worker)." if stragglers > 1 else "."))
    grad_mb = profile.params * profile.weight_bytes_per_param / 1e6
    overlap = "hidden behind the backward pass" if ddp.exposed_comm_s < 0.05 * ddp.compute_s else \
        f"only partly hidden ({_ms(ddp.exposed_comm_s)} exposed)"
    reasons.append(
        f"Bandwidth: DDP all-reduces {grad_mb:.4g} MB of gradients over {n} GPUs in {_ms(ddp.comm_s)}, "
        f"a comm/compute ratio of {ddp.comm_compute_ratio:.2g}, {overlap}; one parameter server must move "
        f"{n} x {grad_mb:.4g} MB in and out through a single link, {_ms(sync.comm_s)} per synchronous step "
        f"(ratio {sync.comm_compute_ratio:.2g}).")
    states = profile.params * profile.state_bytes_per_param
    if ddp.fits:
        mem_text = (f"Memory: replicated model states ({_gib(states)}) plus activations ({_gib(profile.activation_bytes)}) "
                    f"take {_gib(ddp.memory_bytes_per_gpu)} per GPU and fit in the {_gib(usable)} usable per "
                    f"{cluster.device.key}, so the model is not memory-bound and FSDP's sharding buys nothing "
                    f"but extra collectives.")
    else:
        mem_text = (f"Memory: replicated model states ({_gib(states)}) plus activations need "
                    f"{_gib(ddp.memory_bytes_per_gpu)} per GPU, more than the {_gib(usable)} usable per "
                    f"{cluster.device.key}: DDP and the parameter-server workers do not fit; FSDP shards the states "
                    f"{n} ways to {_gib(fsdp.memory_bytes_per_gpu)} per GPU"
                    + (" and fits." if fsdp.fits else ", and even that does not fit: more GPUs or a smaller model."))
    reasons.append(mem_text)
    if stragglers > 1:
        reasons.append(
            f"Heterogeneity: with one worker {stragglers:g}x slower, every synchronous step waits for it "
            f"(DDP {_ms(ddp.step_s)}, {sync.strategy} {_ms(sync.step_s)} per step), while {asyn.strategy} lets "
            f"each worker run at its own pace ({asyn.samples_per_s:.4g} samples/s against {sync.strategy}'s "
            f"{sync.samples_per_s:.4g}), "
            f"bounded by the server link"
            + (" - which is what caps it here." if any("server-bound" in x for x in asyn.notes) else "."))
    else:
        reasons.append(
            "Scheduling: the workers are assumed identical and gang-scheduled, so synchronous steps lose nothing to "
            "stragglers and asynchrony only adds staleness (pass --stragglers F to model one slow worker).")
    measured = [r for r in ranked if not r.synchronous and not r.staleness_penalty.startswith("not measured")]
    if measured:
        reasons.append("Staleness, measured locally: " + "; ".join(
            f"{r.strategy}: {r.staleness_penalty}" for r in measured) + ".")
    else:
        asynchronous = "/".join(r.strategy for r in sorted(ranked, key=lambda r: specs[r.strategy].traits.simplicity)
                                if not r.synchronous)
        reasons.append(f"Staleness: its statistical cost was not measured (no finished local runs of this workload "
                       f"with {asynchronous} and {sync.strategy} or {ddp.strategy} in the store); async step times "
                       f"are ranked as if an update were worth a synchronous one.")
    reasons += [f"{r.strategy}'s {note}" for r in ranked for note in r.notes if note.startswith(KNOB_NOTE_PREFIX)]
    planned = [r.strategy for r in ranked if any(n.startswith("priced as `ddlscope plan`") for n in r.notes)]
    if planned:
        reasons.append(f"Pricing: {' and '.join(planned)} are layouts of the planner and are priced as `ddlscope plan` "
                       "prices them (bf16 with fp32 master weights, flash attention, the fastest micro-batch and "
                       "recompute that fit); the other strategies as the experiment runs (its precision, no recompute).")
    if not winner.fits:
        least = min(ranked, key=lambda r: r.memory_bytes_per_gpu)
        reasons.append(f"Recommendation: none: no strategy fits the {_gib(usable)} usable per {cluster.device.key} "
                       f"(the least, {least.strategy}, needs {_gib(least.memory_bytes_per_gpu)} per GPU); "
                       "`ddlscope plan` searches tensor and pipeline layouts with ZeRO and recompute, or use more GPUs.")
        return reasons
    runner = next((r for r in ranked if r is not winner), None)
    framework = specs[winner.strategy].advice
    rec = (f"Recommendation: {winner.strategy} ({framework}): {_ms(winner.step_s)} per step, "
           f"{winner.samples_per_s:.4g} samples/s, {_gib(winner.memory_bytes_per_gpu)} per GPU, "
           f"${winner.cost_usd_per_step:.3g} per step, {duration_text(winner.experiment_time_s)} and "
           f"${winner.experiment_cost_usd:.3g} for the experiment's {winner.experiment_steps} steps")
    if runner is not None:
        rec += (f"; next is {runner.strategy} at {_ms(runner.effective_step_s)} per step"
                + ("" if runner.fits else " (does not fit)"))
    reasons.append(rec + ".")
    if stragglers > 1 and winner.synchronous:
        reasons.append(f"The framework points to asynchrony for heterogeneous workers, but here the predicted numbers "
                       f"favour {winner.strategy}: one server's link costs asynchronous PS more than waiting for the "
                       f"{stragglers:g}x straggler costs {winner.strategy}.")
    return reasons
