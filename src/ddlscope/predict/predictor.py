"""`predict`: one configuration, checked, scored, and packaged as a `Prediction`."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Callable, Collection

from ddlscope.predict.catalogue import Cluster, Device, Stack
from ddlscope.predict.model import ConfigArrays, evaluate
from ddlscope.predict.specs import RECOMPUTE_CODES, SCHEDULE_CODES, ModelSpec, ParallelSpec, Prediction
from ddlscope.specs import ConfigError

GB = 1e9
# Past these a model is a typo, not a plan (and its FLOP and byte counts leave int64).
MODEL_LIMITS = {"hidden": 2**20, "heads": 2**16, "layers": 2**16, "seq": 2**24, "vocab": 2**24, "global_batch": 2**24,
                "ffn_hidden": 2**22, "kv_heads": 2**16}


def validate_model(model: ModelSpec, cluster: Cluster) -> None:
    """Refuse a model no parallel configuration can run (what `predict` and `plan` both check)."""
    for name in ("hidden", "heads", "layers", "seq", "vocab", "global_batch"):
        if getattr(model, name) < 1:
            raise ConfigError(f"{name} = {getattr(model, name)}: must be >= 1")
    for name in ("ffn_hidden", "kv_heads"):
        if getattr(model, name) < 0:
            raise ConfigError(f"{name} = {getattr(model, name)}: must be >= 0 (0: the default)")
    for name, limit in MODEL_LIMITS.items():
        if getattr(model, name) > limit:
            raise ConfigError(f"{name} = {getattr(model, name)}: at most {limit:,}")
    if model.hidden % model.heads:
        raise ConfigError(f"hidden = {model.hidden}: must be divisible by heads = {model.heads}")
    if model.kv_heads and model.heads % model.kv_heads:
        raise ConfigError(f"kv_heads = {model.kv_heads}: must divide heads = {model.heads}")
    if model.attention not in ("flash", "unfused"):
        raise ConfigError(f"attention = {model.attention!r}: allowed: flash, unfused")
    if model.experts < 0 or model.experts > 2**16:
        raise ConfigError(f"experts = {model.experts}: must be 0 (a dense MLP) to {2**16:,}")
    if model.is_moe and not 1 <= model.top_k <= model.experts:
        raise ConfigError(f"top_k = {model.top_k}: must be 1 to experts = {model.experts}")
    # An expert takes each token once at most, so its load is at most every token: experts / top_k times the
    # mean. A buffer or an imbalance past that is no load at all (1e300 priced a step of nan seconds).
    most = model.experts / model.top_k if model.is_moe else 1.0
    if model.capacity_factor != 0 and not 1 <= model.capacity_factor <= max(most, 1.0):
        raise ConfigError(f"capacity_factor = {model.capacity_factor:g}: must be 0 (dropless) or 1 to experts / top_k "
                          f"= {most:g} (an expert's buffer past every token holds nothing more)")
    if not 1 <= model.expert_imbalance <= max(most, 1.0):
        raise ConfigError(f"expert_imbalance = {model.expert_imbalance:g}: must be 1 to experts / top_k = {most:g} "
                          "(busiest expert / the mean; the busiest takes every token at most)")
    cluster.device.peak(model.dtype)  # raises for a dtype the device has no peak for


def validate(model: ModelSpec, parallel: ParallelSpec, cluster: Cluster) -> None:
    """Refuse a configuration that cannot run, with one line naming the field and what is allowed."""
    validate_model(model, cluster)
    for name in ("tp", "pp", "dp", "micro_batch", "interleave", "cp", "ep"):
        if getattr(parallel, name) < 1:
            raise ConfigError(f"{name} = {getattr(parallel, name)}: must be >= 1")
    if parallel.zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero = {parallel.zero}: allowed: 0, 1, 2, 3")
    if parallel.recompute not in RECOMPUTE_CODES:
        raise ConfigError(f"recompute = {parallel.recompute!r}: allowed: {', '.join(RECOMPUTE_CODES)}")
    if parallel.schedule not in SCHEDULE_CODES:
        raise ConfigError(f"schedule = {parallel.schedule!r}: allowed: {', '.join(SCHEDULE_CODES)}")
    t, p, d, b, v = parallel.tp, parallel.pp, parallel.dp, parallel.micro_batch, parallel.interleave
    cp, ep = parallel.cp, parallel.ep
    if parallel.gpus > cluster.n_gpus:
        sizes = f"tp x pp x dp = {t} x {p} x {d}" if cp == 1 else f"tp x cp x pp x dp = {t} x {cp} x {p} x {d}"
        raise ConfigError(f"{sizes} = {parallel.gpus}: more than the cluster's {cluster.n_gpus} GPUs ({cluster})")
    if cp > 1 and model.attention != "flash":
        raise ConfigError(f"cp = {cp}: context parallelism (ring attention) needs attention = 'flash'")
    if model.seq % (2 * cp):
        raise ConfigError(f"cp = {cp}: seq = {model.seq} must be divisible by 2 x cp = {2 * cp} "
                          "(each rank takes two chunks, for causal balance)")
    if ep > 1 and not model.is_moe:
        raise ConfigError(f"ep = {ep}: expert parallelism needs a mixture-of-experts model (experts > 0)")
    if ep > 1 and (model.experts % ep or (d * cp) % ep):
        raise ConfigError(f"ep = {ep}: must divide experts = {model.experts} and dp x cp = {d * cp}")
    if model.heads % t:
        raise ConfigError(f"tp = {t}: must divide heads = {model.heads}")
    if model.kv % t:
        raise ConfigError(f"tp = {t}: must divide kv_heads = {model.kv}")
    if model.layers % p:
        raise ConfigError(f"pp = {p}: must divide layers = {model.layers}")
    if model.global_batch % (d * b):
        raise ConfigError(f"global_batch = {model.global_batch}: must be divisible by dp x micro_batch = "
                          f"{d} x {b} = {d * b}")
    if parallel.sequence_parallel and t == 1:
        raise ConfigError("sequence_parallel = true: needs tp > 1 (it splits the tensor-parallel group's work)")
    if v > 1:
        if p == 1:
            raise ConfigError(f"interleave = {v}: needs pp > 1")
        if model.layers % (p * v):
            raise ConfigError(f"interleave = {v}: layers = {model.layers} must be divisible by pp x interleave = "
                              f"{p * v}")
        m = model.global_batch // (d * b)
        if m % p:
            raise ConfigError(f"interleave = {v}: the {m} micro-batches per step must be a multiple of pp = {p}")
        if parallel.schedule != "1f1b":
            raise ConfigError(f"interleave = {v}: only with schedule = '1f1b'")


def with_stack(stack: Stack, model: ModelSpec, parallel: ParallelSpec, cluster: Cluster,
               given: Collection[str] = (), figure: bool = True) -> tuple[ModelSpec, ParallelSpec, Cluster]:
    """The specs under a named software stack (catalogue.toml [stacks]).

    The stack's switches (gradient reduction overlap, fused accumulation, ZeRO stage, attention kernel)
    fill the fields not in `given` (ParallelSpec / ModelSpec field names the user set); a layout the stack
    cannot run raises ConfigError; its one efficiency figure sets the cluster's `sustained_fraction`
    unless `figure` is False (the user's own measurement replaces it)."""
    parallel = replace(parallel, **{k: v for k, v in stack.parallel_defaults().items() if k not in given})
    if stack.attention is not None and "attention" not in given:
        model = replace(model, attention=stack.attention)
    why = stack.refusal(parallel.tp, parallel.pp, parallel.cp, parallel.zero, parallel.recompute,
                        parallel.sequence_parallel, parallel.interleave, parallel.schedule)
    if why:
        raise ConfigError(why)
    if figure and stack.has_figure:
        cluster = replace(cluster.with_sustained_fraction(stack.sustained_fraction), stack_share=stack.validated_share,
                          published_share_low=None)
    return model, parallel, cluster


def predict(model: ModelSpec, parallel: ParallelSpec, cluster: Cluster, spot: bool = False) -> Prediction:
    """Validate and score one configuration."""
    validate(model, parallel, cluster)
    configs = ConfigArrays.from_specs([parallel])
    out = evaluate(model, cluster, configs)
    return with_ranges(prediction_from_arrays(out, 0, model, parallel, cluster, spot), model, cluster, configs)


def with_ranges(prediction: Prediction, model: ModelSpec, cluster: Cluster, configs: ConfigArrays) -> Prediction:
    """`prediction` (of `configs`' one configuration) with its kernel range and its stack range set."""
    prediction.range = prediction_range(model, cluster, configs)
    prediction.stack_range = stack_range(prediction, cluster)
    return prediction


RANGE_KEYS = ("step_time_s", "tflops_per_gpu", "mfu")


def prediction_range(model: ModelSpec, cluster: Cluster, configs: ConfigArrays, i: int = 0) -> dict[str, list[float]]:
    """[low, high] of the headline figures with every measured efficiency at either end of its sources."""
    slow = evaluate(model, cluster.at_bound("low"), configs)
    fast = evaluate(model, cluster.at_bound("high"), configs)
    return {key: sorted([float(slow[key][i]), float(fast[key][i])]) for key in RANGE_KEYS}


def stack_range(prediction: Prediction, cluster: Cluster) -> dict[str, list[float]]:
    """[low, high] of the headline figures from the slowest published stack to the fastest kernels.

    The fast end is `range`'s (every kernel at the fast end of its sources); the slow end is the
    prediction's throughput times the lowest share of it a published training run reached
    (`cluster.published_share_low`): how much slower than the sum of its kernels a real stack has run.
    Under a named stack's published figure the range is that stack's own runs' spread around the prediction
    (`cluster.stack_share`: the lowest and highest published / predicted share among them); empty where
    nothing was validated (a stack with one run)."""
    if cluster.stack_share is not None and prediction.range:
        low, high = cluster.stack_share
        return {"step_time_s": [prediction.step_time_s / high, prediction.step_time_s / low],
                "tflops_per_gpu": [prediction.tflops_per_gpu * low, prediction.tflops_per_gpu * high],
                "mfu": [prediction.mfu * low, prediction.mfu * high]}
    share = cluster.published_share_low
    if share is None or not prediction.range:
        return {}
    fast_step_s = prediction.range["step_time_s"][0]
    return {"step_time_s": [fast_step_s, prediction.step_time_s / share],
            "tflops_per_gpu": [prediction.tflops_per_gpu * share, prediction.range["tflops_per_gpu"][1]],
            "mfu": [prediction.mfu * share, prediction.range["mfu"][1]]}


# The lowest fraction tried: below it a GPU would do a tenth of its isolated GEMM rate, which no
# training stack does; a measured step still slower than that is not the compute's doing.
LOWEST_SUSTAINED_FRACTION = 0.1


def fit_sustained_fraction(step_s_at: Callable[[float], float], measured_step_s: float, device: Device) -> float:
    """The `sustained_fraction` at which `step_s_at(fraction)` equals a measured step time.

    One measured run of a software stack sets the stack's constant; the
    model's mechanisms then carry it to other configurations (see
    docs/predict.md, "Calibrating to a stack"). The step time never rises
    with the fraction, so bisection finds it.
    """
    if not measured_step_s > 0:
        raise ConfigError(f"measured step = {measured_step_s:g} s: must be above 0")
    high = device.efficiency.max_sustained_fraction
    fastest, slowest = step_s_at(high), step_s_at(LOWEST_SUSTAINED_FRACTION)
    if measured_step_s < fastest:
        raise ConfigError(f"measured step = {measured_step_s:g} s: faster than the model allows on {device.key} "
                          f"even with GEMMs at the datasheet peak ({fastest:.4g} s)")
    if measured_step_s > slowest:
        raise ConfigError(f"measured step = {measured_step_s:g} s: slower than the model gives at "
                          f"sustained_fraction {LOWEST_SUSTAINED_FRACTION} ({slowest:.4g} s); something other "
                          "than compute (a slow link, a wrong configuration) holds that run back")
    low = LOWEST_SUSTAINED_FRACTION
    for _ in range(60):
        middle = (low + high) / 2
        if step_s_at(middle) > measured_step_s:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def fitted_prediction(model: ModelSpec, parallel: ParallelSpec, cluster: Cluster, measured_step_s: float,
                      spot: bool = False) -> tuple[float, Prediction]:
    """(sustained_fraction, prediction at it) for a configuration whose step time was measured."""
    validate(model, parallel, cluster)
    fraction = fit_sustained_fraction(
        lambda f: predict(model, parallel, cluster.with_sustained_fraction(f)).step_time_s, measured_step_s,
        cluster.device)
    return fraction, predict(model, parallel, cluster.with_sustained_fraction(fraction), spot)


def prediction_from_arrays(out: dict, i: int, model: ModelSpec, parallel: ParallelSpec, cluster: Cluster,
                           spot: bool = False) -> Prediction:
    value = lambda key: float(out[key][i])  # noqa: E731
    breakdown = {
        "compute": value("compute_s"),
        "recompute_included": value("recompute_s"),
        "tp_comm": value("tp_comm_s"),
        "ep_all_to_all": value("ep_comm_s"),
        "cp_ring": value("cp_comm_s"),
        "pp_p2p": value("pp_p2p_s"),
        "zero_comm": value("zero_comm_s"),
        "dp_grad_sync": value("dp_sync_s"),
        "embedding_sync": value("embedding_sync_s"),
        "bubble": value("bubble_s"),
        "optimizer": value("optimizer_s"),
        "grad_accumulation": value("grad_accumulation_s"),
    }
    memory = {
        "parameters": value("parameters_bytes") / GB,
        "gradients": value("gradients_bytes") / GB,
        "optimizer": value("optimizer_bytes") / GB,
        "activations": value("activations_bytes") / GB,
        "other": value("other_bytes") / GB,
    }
    notes = []
    used = parallel.gpus
    if used < cluster.n_gpus:
        sizes = "tp x pp x dp" if parallel.cp == 1 else "tp x cp x pp x dp"
        notes.append(f"uses {sizes} = {used} of the cluster's {cluster.n_gpus} GPUs; "
                     "per-GPU figures, energy and cost count the GPUs used")
    if not bool(out["fits"][i]):
        notes.append(f"needs {value('memory_bytes') / GB:.1f} GB per GPU; {cluster.device.key} has "
                     f"{cluster.device.memory_bytes / GB:.1f} GB")
    return Prediction(
        cluster=str(cluster),
        model=asdict(model),
        parallel=asdict(parallel),
        step_time_s=value("step_time_s"),
        tflops_per_gpu=value("tflops_per_gpu"),
        mfu=value("mfu"),
        hfu=value("hfu"),
        tokens_per_s_per_gpu=value("tokens_per_s_per_gpu"),
        samples_per_s=value("samples_per_s"),
        memory_gb_per_gpu=value("memory_bytes") / GB,
        memory_breakdown_gb=memory,
        memory_capacity_gb=cluster.device.memory_bytes / GB,
        fits=bool(out["fits"][i]),
        energy_kwh_per_step=value("energy_kwh"),
        cost_usd_per_step=value("spot_cost_usd" if spot else "cost_usd"),
        breakdown_s=breakdown,
        micro_batches=int(round(value("micro_batches"))),
        bubble_fraction=value("bubble_fraction"),
        notes=notes,
    )
