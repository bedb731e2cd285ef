"""Predictions: `predict` and `plan` (the performance model on the command line), and `predict-run`
(a stored local run predicted from this machine's calibration, next to what it measured).

A configuration for predict and plan comes from flags, from a TOML file, or both (flags win):

    cluster = "a100-80gb:280x8"
    spot = false                  # price with spot instead of on-demand rates
    [model]
    name = "gpt"
    hidden = 20480
    heads = 128
    layers = 105
    seq = 2048
    vocab = 51200
    global_batch = 1920
    attention = "unfused"         # or "flash" (default)
    dtype = "bf16"                # bf16 | fp16 | fp32
    ffn_hidden = 0                # 0: 4 x hidden
    kv_heads = 0                  # 0: = heads; fewer = grouped-query attention
    gated_mlp = false             # true: SwiGLU MLP (Llama)
    [parallel]                    # predict; plan searches the layout, keeps the last two
    tp = 8
    pp = 35
    dp = 8                        # default: GPUs / (tp x pp)
    micro_batch = 1
    zero = 1
    recompute = "full"            # none | selective | full
    sequence_parallel = false
    interleave = 1
    schedule = "1f1b"             # or "gpipe"
    overlap_grad_reduce = true    # false: the gradient reduction waits for the last backward
                                  # (Megatron-LM's local DDP before 2023, DeepSpeed's pipeline engine)
    fused_grad_accumulation = false  # true: Megatron-LM --gradient-accumulation-fusion

A CNN (`name = "resnet50"`, `"vgg16"` or `"densenet121"`) takes `global_batch`,
`image_size` (224 ImageNet, 32 CIFAR), `classes`, `dtype` (default fp32 at the
TF32 peak) and `optimizer` (sgd, sgd-momentum, adamw) in [model], and
`dp`, `micro_batch`, `zero` (0, or 3 = FSDP), `bucket_mb`, `overlap_grad_reduce`
and `strategy` (ddp, fsdp, ps-sync, ps-async) in [parallel]; see
`ddlscope.predict.cnn_predict`.

Bad input raises `ddlscope.specs.ConfigError`; the CLI's main() prints its
one-line message and exits with status 2.
"""

from __future__ import annotations

import functools
import json
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Column, Table

from ddlscope.cli.common import (DEFAULT_DB, DbOption, JsonOption, RunArg, cluster_from_text, console, db_option,
                                 require_store)
from ddlscope.specs import ConfigError
from ddlscope.store import Store

MODEL_KEYS = ("name", "hidden", "heads", "layers", "seq", "vocab", "global_batch", "attention", "dtype", "ffn_hidden",
              "kv_heads", "gated_mlp", "image_size", "classes", "optimizer", "experts", "top_k", "capacity_factor",
              "expert_imbalance")
PARALLEL_KEYS = ("tp", "cp", "pp", "dp", "ep", "micro_batch", "zero", "recompute", "sequence_parallel", "interleave", "schedule",
                 "overlap_grad_reduce", "fused_grad_accumulation", "bucket_mb", "strategy")
TOP_KEYS = ("cluster", "spot", "sustained_fraction", "model", "parallel")
CNN_MODELS = ("resnet50", "vgg16", "densenet121")  # = ddlscope.predict.cnn.CNN_MODELS (not imported at startup)
MODELS = ("gpt", *CNN_MODELS)
CNN_ONLY_MODEL_KEYS = ("image_size", "classes", "optimizer")
GPT_ONLY_MODEL_KEYS = ("hidden", "heads", "layers", "seq", "vocab", "attention", "ffn_hidden", "kv_heads", "gated_mlp",
                       "experts", "top_k", "capacity_factor", "expert_imbalance")
REQUIRED_MODEL_KEYS = ("hidden", "heads", "layers", "seq", "vocab", "global_batch")

ConfigArg = Annotated[Optional[Path], typer.Argument(
    help="TOML file with cluster, \\[model] and \\[parallel]; flags override it.")]
ClusterOpt = Annotated[Optional[str], typer.Option(
    "--cluster", help="NAME:NODESxGPUS_PER_NODE, e.g. a100-80gb:64x8; local:1xN is N ranks of this machine "
                      "as `ddlscope calibrate` measured it.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", help="gpt (default; --hidden, --heads, ...), a CNN: resnet50, vgg16, densenet121, a "
                    "transformers decoder hf:ARCH (hf:llama, with --hidden, --heads, ...), or an image model "
                    "torchvision:NAME, timm:NAME, module:PKG.MOD:FACTORY (--image-size, --classes).")]
ImageSizeOpt = Annotated[Optional[int], typer.Option(
    "--image-size", help="CNN input size: 224 (ImageNet network) or 32 (CIFAR variant); any size for a "
                         "torchvision/timm/module model (default 224).")]
ClassesOpt = Annotated[Optional[int], typer.Option("--classes", help="CNN output classes (default 1000).")]
HiddenOpt = Annotated[Optional[int], typer.Option("--hidden", help="Hidden size h.")]
HeadsOpt = Annotated[Optional[int], typer.Option("--heads", help="Attention heads a.")]
LayersOpt = Annotated[Optional[int], typer.Option("--layers", help="Transformer layers l.")]
SeqOpt = Annotated[Optional[int], typer.Option("--seq", help="Sequence length s.")]
VocabOpt = Annotated[Optional[int], typer.Option("--vocab", help="Vocabulary size V.")]
GlobalBatchOpt = Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per optimizer step.")]
AttentionOpt = Annotated[Optional[str], typer.Option("--attention", help="flash (fused kernel) or unfused.")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="bf16, fp16 or fp32.")]
FfnOpt = Annotated[Optional[int], typer.Option("--ffn-hidden", help="MLP width (default 4 x hidden).")]
KvHeadsOpt = Annotated[Optional[int], typer.Option("--kv-heads", help="Key/value heads (grouped-query attention).")]
GatedOpt = Annotated[Optional[bool], typer.Option("--gated-mlp/--plain-mlp", help="SwiGLU MLP (Llama) or GeLU (GPT).")]
ExpertsOpt = Annotated[Optional[int], typer.Option(
    "--experts", help="Mixture of experts: experts per layer (0: a dense MLP).")]
TopKOpt = Annotated[Optional[int], typer.Option("--top-k", help="MoE: experts each token is routed to (default 2).")]
CapacityOpt = Annotated[Optional[float], typer.Option(
    "--capacity-factor", help="MoE: expert buffers padded to this x the mean load (0, default: dropless).")]
ImbalanceOpt = Annotated[Optional[float], typer.Option(
    "--expert-imbalance", help="MoE, dropless: tokens of the busiest expert / the mean (default 1).")]
SpotOpt = Annotated[Optional[bool], typer.Option("--spot/--on-demand", help="Price with spot rates.")]
CALIBRATION_DEFAULT = "(default: the newest in the store, else ./ddlscope-calibration.toml)."
PredictCalibrationOpt = Annotated[Optional[Path], typer.Option(
    "--calibration", help=f"For --against or a local:1xN cluster: profile TOML from `ddlscope calibrate` "
                          f"{CALIBRATION_DEFAULT}")]
PlanCalibrationOpt = Annotated[Optional[Path], typer.Option(
    "--calibration", help=f"For a local:1xN cluster: profile TOML from `ddlscope calibrate` {CALIBRATION_DEFAULT}")]
OverlapGradReduceOpt = Annotated[Optional[bool], typer.Option(
    "--overlap-grad-reduce/--no-overlap-grad-reduce",
    help="Reduce data-parallel gradients in buckets during the last backward (default), or after it "
         "(Megatron-LM's local DDP before 2023, DeepSpeed's pipeline engine).")]
FusedGradAccumulationOpt = Annotated[Optional[bool], typer.Option(
    "--fused-grad-accumulation/--no-fused-grad-accumulation",
    help="The weight-gradient GEMM adds into the gradient buffer (Megatron-LM --gradient-accumulation-fusion); "
         "default: a separate pass per micro-batch.")]
PredictDbOpt = Annotated[Path, db_option("The store (for --against, and calibrations).")]
PlanDbOpt = Annotated[Path, db_option("The store (for calibrations).")]
SustainedOpt = Annotated[Optional[float], typer.Option(
    "--sustained-fraction", help="Scale the published kernel rates by what your stack sustains (catalogue: 1, "
                                 "nothing derated; fit it with predict --measured-step-s).")]


# ---------------------------------------------------------------------------- predict
def predict_command(
    config: ConfigArg = None,
    cluster: ClusterOpt = None,
    model: ModelOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    layers: LayersOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
    global_batch: GlobalBatchOpt = None,
    micro_batch: Annotated[Optional[int], typer.Option("--micro-batch", help="Sequences per micro-batch.")] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", help="Tensor-parallel size.")] = None,
    cp: Annotated[Optional[int], typer.Option("--cp", help="Context-parallel size (ring attention; flash only).")] = None,
    ep: Annotated[Optional[int], typer.Option("--ep", help="Expert-parallel size (divides experts and dp x cp).")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", help="Pipeline stages.")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", help="Data-parallel size (default GPUs / (tp x pp)).")] = None,
    recompute: Annotated[Optional[str], typer.Option("--recompute", help="none, selective or full.")] = None,
    zero: Annotated[Optional[int], typer.Option("--zero", help="ZeRO stage 0-3 (3 = FSDP full shard).")] = None,
    sequence_parallel: Annotated[Optional[bool], typer.Option("--sequence-parallel/--no-sequence-parallel",
                                                              help="Megatron sequence parallelism (needs tp > 1).")] = None,
    interleave: Annotated[Optional[int], typer.Option("--interleave", help="Model chunks per pipeline stage.")] = None,
    schedule: Annotated[Optional[str], typer.Option("--schedule", help="1f1b or gpipe.")] = None,
    overlap_grad_reduce: OverlapGradReduceOpt = None,
    fused_grad_accumulation: FusedGradAccumulationOpt = None,
    attention: AttentionOpt = None,
    dtype: DtypeOpt = None,
    ffn_hidden: FfnOpt = None,
    kv_heads: KvHeadsOpt = None,
    gated_mlp: GatedOpt = None,
    experts: ExpertsOpt = None,
    top_k: TopKOpt = None,
    capacity_factor: CapacityOpt = None,
    expert_imbalance: ImbalanceOpt = None,
    image_size: ImageSizeOpt = None,
    classes: ClassesOpt = None,
    strategy: Annotated[Optional[str], typer.Option(
        "--strategy", help="CNN only: ddp (default), fsdp (= --zero 3), ps-sync or ps-async.")] = None,
    spot: SpotOpt = None,
    sustained_fraction: SustainedOpt = None,
    measured_step_s: Annotated[Optional[float], typer.Option(
        "--measured-step-s", help="A step time measured for this configuration on your stack: fit "
                                  "sustained_fraction to it, print it, and predict with it.")] = None,
    as_json: JsonOption = False,
    against: Annotated[Optional[str], typer.Option(
        "--against", metavar="RUN", help="Predict a stored local run with this machine's calibration instead.")] = None,
    calibration: PredictCalibrationOpt = None,
    db: PredictDbOpt = DEFAULT_DB,
) -> None:
    """Predict one configuration: step time, TFLOP/s, MFU, memory per GPU, energy and cost per step."""
    if against is not None:
        print_run_prediction(against, db, calibration, as_json)
        return
    from ddlscope.predict import predict

    raw = _read_config(config)
    model_raw = _merged(raw.get("model", {}), "model", MODEL_KEYS, name=model, hidden=hidden, heads=heads,
                        layers=layers, seq=seq, vocab=vocab, global_batch=global_batch, attention=attention,
                        dtype=dtype, ffn_hidden=ffn_hidden, kv_heads=kv_heads, gated_mlp=gated_mlp,
                        image_size=image_size, classes=classes, experts=experts, top_k=top_k,
                        capacity_factor=capacity_factor, expert_imbalance=expert_imbalance)
    parallel_raw = _merged(raw.get("parallel", {}), "parallel", PARALLEL_KEYS, tp=tp, cp=cp, ep=ep, pp=pp, dp=dp,
                           micro_batch=micro_batch, zero=zero, recompute=recompute,
                           sequence_parallel=sequence_parallel, interleave=interleave, schedule=schedule,
                           overlap_grad_reduce=overlap_grad_reduce, fused_grad_accumulation=fused_grad_accumulation,
                           strategy=strategy)
    the_cluster = _stack_cluster(cluster_from_text(_required(cluster or raw.get("cluster"),
                                                             "--cluster (or cluster in the config file)"),
                                                   calibration, db), sustained_fraction, raw)
    use_spot = bool(spot if spot is not None else raw.get("spot", False))
    if _is_cnn(model_raw):
        _predict_cnn(model_raw, parallel_raw, the_cluster, use_spot, measured_step_s, sustained_fraction, raw,
                     as_json)
        return
    if "strategy" in parallel_raw:
        raise ConfigError("--strategy is for a CNN model (resnet50, vgg16, densenet121); a GPT's data-parallel "
                          "strategy is --zero")
    spec = _model_spec(model_raw)
    parallel = _parallel_spec(parallel_raw, the_cluster.n_gpus)
    if measured_step_s is not None:
        if sustained_fraction is not None or "sustained_fraction" in raw:
            raise ConfigError("--measured-step-s fits sustained_fraction: give one or the other, not both")
        from ddlscope.predict import fitted_prediction

        fraction, result = fitted_prediction(spec, parallel, the_cluster, measured_step_s, spot=use_spot)
        fitted = {"sustained_fraction": fraction, "fitted_to_step_s": measured_step_s,
                  "catalogue_sustained_fraction": the_cluster.device.efficiency.sustained_fraction}
    else:
        result, fitted = predict(spec, parallel, the_cluster, spot=use_spot), None
    if as_json:
        out = result.to_dict()
        out["parameters"] = spec.params
        out["sustained_fraction"] = fitted["sustained_fraction"] if fitted else \
            the_cluster.device.efficiency.sustained_fraction
        if fitted:
            out["fitted_to_step_s"] = measured_step_s
        print(json.dumps(out))
        return
    _print_prediction(result, parallel.label(), use_spot)
    if fitted:
        console.print(f"sustained_fraction {fitted['sustained_fraction']:.4f} reproduces the measured "
                      f"{measured_step_s:g} s step (catalogue: {fitted['catalogue_sustained_fraction']:g}); pass "
                      f"--sustained-fraction {fitted['sustained_fraction']:.3f} to predict or plan other "
                      "configurations on this stack")


# ---------------------------------------------------------------------------- plan
def plan_command(
    config: ConfigArg = None,
    cluster: ClusterOpt = None,
    model: ModelOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    layers: LayersOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
    global_batch: GlobalBatchOpt = None,
    attention: AttentionOpt = None,
    dtype: DtypeOpt = None,
    ffn_hidden: FfnOpt = None,
    kv_heads: KvHeadsOpt = None,
    gated_mlp: GatedOpt = None,
    experts: ExpertsOpt = None,
    top_k: TopKOpt = None,
    capacity_factor: CapacityOpt = None,
    expert_imbalance: ImbalanceOpt = None,
    image_size: ImageSizeOpt = None,
    classes: ClassesOpt = None,
    by: Annotated[str, typer.Option("--by", help="Rank by step time or by cost per step.")] = "time",
    top: Annotated[int, typer.Option("--top", help="How many configurations to show.")] = 5,
    max_micro_batch: Annotated[int, typer.Option("--max-micro-batch", help="Largest micro-batch to try.")] = 64,
    spot: SpotOpt = None,
    sustained_fraction: SustainedOpt = None,
    overlap_grad_reduce: OverlapGradReduceOpt = None,
    fused_grad_accumulation: FusedGradAccumulationOpt = None,
    burst: Annotated[bool, typer.Option("--burst", help="CNN: a data-parallel degree per unit (burst parallelism, "
                                        "DeepPool): its predicted gain over uniform data parallelism and the "
                                        "cluster throughput when the freed GPUs run a background job.")] = False,
    background_efficiency: Annotated[float, typer.Option(
        "--background-efficiency", help="With --burst: the share of a freed GPU-second the background job "
                                        "uses (1: all of it).")] = 1.0,
    max_slowdown: Annotated[float, typer.Option(
        "--max-slowdown", help="With --burst: the most the job may slow down (x uniform's step) to free GPUs "
                               "for the background job.")] = 1.0,
    as_json: JsonOption = False,
    calibration: PlanCalibrationOpt = None,
    db: PlanDbOpt = DEFAULT_DB,
) -> None:
    """Search every valid TP x PP x DP x micro-batch x ZeRO x recompute x SP x interleave config; rank those that fit."""
    from ddlscope.predict.planner import plan

    raw = _read_config(config)
    model_raw = _merged(raw.get("model", {}), "model", MODEL_KEYS, name=model, hidden=hidden, heads=heads,
                        layers=layers, seq=seq, vocab=vocab, global_batch=global_batch, attention=attention,
                        dtype=dtype, ffn_hidden=ffn_hidden, kv_heads=kv_heads, gated_mlp=gated_mlp,
                        image_size=image_size, classes=classes, experts=experts, top_k=top_k,
                        capacity_factor=capacity_factor, expert_imbalance=expert_imbalance)
    # checked; the layout is searched over, the stack's gradient handling holds for every layout
    stack = _booleans(_merged(raw.get("parallel", {}), "parallel", PARALLEL_KEYS,
                              overlap_grad_reduce=overlap_grad_reduce, fused_grad_accumulation=fused_grad_accumulation),
                      STACK_KEYS)
    if by not in ("time", "cost"):
        raise ConfigError(f"--by = {by!r}: allowed: time, cost")
    if max_micro_batch < 1:
        raise ConfigError(f"--max-micro-batch = {max_micro_batch}: must be >= 1")
    the_cluster = _stack_cluster(cluster_from_text(_required(cluster or raw.get("cluster"),
                                                             "--cluster (or cluster in the config file)"),
                                                   calibration, db), sustained_fraction, raw)
    use_spot = bool(spot if spot is not None else raw.get("spot", False))
    if burst:
        _plan_burst(model_raw, the_cluster, background_efficiency, max_slowdown, as_json)
        return
    if _is_cnn(model_raw):
        from ddlscope.predict.cnn_predict import plan_cnn

        result = plan_cnn(_cnn_spec(model_raw), the_cluster, top=top, rank_by=by, spot=use_spot,
                          max_micro_batch=max_micro_batch, **stack)
    else:
        spec = _model_spec(model_raw)
        result = plan(spec, the_cluster, top=top, rank_by=by, spot=use_spot, max_micro_batch=max_micro_batch,
                      **stack)
    if as_json:
        print(json.dumps({
            "cluster": result.cluster, "by": result.rank_by, "evaluated": result.evaluated,
            "feasible": result.feasible, "search_s": result.search_s, "configs_per_s": result.configs_per_s,
            "top": [{"rank": r.rank, "why": r.why, **r.prediction.to_dict()} for r in result.rows]}))
        return
    _print_plan(result)


def _plan_burst(model_raw: dict[str, Any], cluster: Any, background_efficiency: float, max_slowdown: float,
                as_json: bool) -> None:
    """`plan --burst`: uniform data parallelism against the burst plans (predict/burst.py)."""
    from ddlscope.predict.burst import burst, degree_runs

    if not _is_cnn(model_raw):
        raise ConfigError(f"--burst: prices a data-parallel degree per unit of a CNN ({', '.join(CNN_MODELS)}); "
                          "give --model with one of them")
    result = burst(_cnn_spec(model_raw), cluster, background_efficiency, max_slowdown)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    console.print(f"[bold]{escape(result.cluster)}[/bold]: {escape(result.model)}, global batch "
                  f"{result.global_batch}, {result.units} units; burst parallelism (a data-parallel degree per unit)")
    table = Table("plan", "step ms", "vs uniform", "GPUs freed", "cluster throughput")
    for p in (result.uniform, result.fastest, result.best_cluster):
        table.add_row(escape(p.label), f"{p.step_s * 1e3:.3f}", f"{p.speedup_vs_uniform:.3f}x",
                      f"{p.freed_fraction:.1%}", f"{p.cluster_throughput:.3f}")
    console.print(table)
    console.print(f"fastest burst plan: {degree_runs(result.fastest.degrees)}", markup=False, highlight=False)
    console.print(f"highest cluster throughput: {degree_runs(result.best_cluster.degrees)} (background job at "
                  f"{result.background_efficiency:.0%} of a freed GPU-second, job at most {result.max_slowdown:g}x "
                  "slower)", markup=False, highlight=False)
    if result.ddp_step_s is not None:
        console.print(f"for scale: DDP with its all-reduce overlapped, {result.ddp_step_s * 1e3:.3f} ms a step",
                      markup=False, highlight=False)
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")


# ---------------------------------------------------------------------------- input
def _stack_cluster(cluster: Any, flag: Optional[float], raw: dict[str, Any]):
    """The cluster with the flag's (else the config file's) sustained_fraction, when one is given."""
    value = flag if flag is not None else raw.get("sustained_fraction")
    if value is None:
        return cluster
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"sustained_fraction = {value!r}: must be a number")
    return cluster.with_sustained_fraction(float(value))


def _read_config(path: Optional[Path]) -> dict[str, Any]:
    if path is None:
        return {}
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {' '.join(str(exc).split())}") from None
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(f"{unknown[0]} = {raw[unknown[0]]!r}: unknown field; allowed: {', '.join(TOP_KEYS)}")
    for section in ("model", "parallel"):
        if section in raw and not isinstance(raw[section], dict):
            raise ConfigError(f"{section} = {raw[section]!r}: must be a table ([{section}])")
    return raw


def _merged(section: dict[str, Any], section_name: str, allowed: tuple[str, ...], **flags: Any) -> dict[str, Any]:
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ConfigError(f"{section_name}.{unknown[0]} = {section[unknown[0]]!r}: unknown field; "
                          f"allowed: {', '.join(allowed)}")
    merged = dict(section)
    merged.update({k: v for k, v in flags.items() if v is not None})
    return merged


def _required(value: Any, what: str) -> Any:
    if value is None:
        raise ConfigError(f"missing {what}")
    return value


def _is_cnn(model_raw: dict[str, Any]) -> bool:
    name = model_raw.get("name", "gpt")
    if not isinstance(name, str):
        raise ConfigError(f"model.name = {name!r}: must be a string")
    if ":" in name:  # a model source: a Hugging Face decoder is a GPT to the step model, the rest CNNs
        return name.partition(":")[0] != "hf"
    if name not in MODELS:
        workloads = _vision_workloads()
        if name not in workloads:
            raise ConfigError(f"--model = {name!r}: allowed: {', '.join(MODELS)}, or a vision workload: "
                              f"{', '.join(workloads)}")
    return name != "gpt"


def _vision_workloads() -> tuple[str, ...]:
    """Registered workloads that train a CNN on images: predicted from their own recorded layers."""
    from ddlscope.workloads import WORKLOADS
    from ddlscope.workloads.vision import VisionSpec

    return tuple(sorted(name for name, cls in WORKLOADS.items() if issubclass(cls.spec_class, VisionSpec)))


def _workload_layers(name: str) -> tuple[Any, ...]:
    """The registered workload's network (its default knobs) as predict/cnn.py's layers, recorded
    from one real forward (runtime/profiler.py); the data set is generated at its smallest."""
    import torch

    from ddlscope.predict.cnn import Layer
    from ddlscope.runtime.profiler import cnn_layer_records
    from ddlscope.workloads import WORKLOADS

    workload = WORKLOADS.get(name)
    task = workload.build(workload.spec_class(samples=10, test_samples=10), seed=0)
    image, _ = task.train.get(torch.arange(1))
    return tuple(Layer(**record) for record in cnn_layer_records(task.model, image))


@functools.lru_cache(maxsize=8)  # plan and predict of one model in one process trace it once
def _source_layers(name: str, image_size: int, classes: int) -> tuple[Any, ...]:
    """A torchvision, timm or `module:` image model as predict/cnn.py's layers, recorded from one real
    forward of one image (studies/recorded.py), its FSDP units from the model's repeated blocks."""
    from ddlscope.runtime.config import load_experiment
    from ddlscope.studies.recorded import PRICED_FLOPS_TOLERANCE, priced_well, recorded_layers

    if not 8 <= image_size <= 1024:
        raise ConfigError(f"--image-size = {image_size}: must be between 8 and 1024")
    spec = load_experiment(None, {"workload.name": name, "workload.image_size": image_size,
                                  "workload.classes": classes}).workload
    layers, priced = recorded_layers(spec)
    if not priced_well(priced):
        raise ConfigError(f"--model = {name!r}: the CNN layer model prices {priced:.0%} of its forward FLOPs as torch "
                          f"counts them (more than {PRICED_FLOPS_TOLERANCE:.0%} off: attention, or operations other "
                          "than convolutions, linear layers, norms and pools); predict it as a transformer "
                          "(--model gpt or hf:ARCH) instead")
    _SOURCE_NOTES[name] = [] if abs(priced - 1) <= 0.01 else [
        f"the layer model prices {priced:.1%} of {name}'s forward FLOPs as counted by torch (the rest, e.g. "
        "attention, is not in the step time)"]
    return layers


_SOURCE_NOTES: dict[str, list[str]] = {}  # notes of the models _source_layers recorded, for the prediction


def _memory_per_rank(spec: Any, strategy: str, cluster: Any) -> dict[str, Any]:
    """What `ddlscope memory MODEL --strategy S --cluster C --batch B --json` gives for the same model,
    strategy, ranks and global batch: one rank's bytes by category, from the model table."""
    from ddlscope.memory_estimate import Budget, estimate
    from ddlscope.runtime.config import load_experiment

    overrides = {"workload.name": spec.name, "workload.image_size": spec.image_size, "workload.classes": spec.classes,
                 "workload.batch_size": spec.global_batch, "cluster.world_size": cluster.n_gpus,
                 "strategy.name": strategy}
    device = cluster.device
    budget = Budget(device.key, device.memory_bytes, device.framework_overhead_bytes)
    (per_rank,) = estimate(load_experiment(None, overrides), overrides, budget, all_strategies=False)["estimates"]
    return per_rank


def _hf_model_spec(raw: dict[str, Any]):
    """A transformers decoder (`hf:ARCH`) as the step model's GPT: its shapes from the flags, whether
    its MLP is gated (three matrices) found by matching one layer's parameters, its embeddings and
    positions read off the model built on the meta device."""
    from ddlscope.predict import ModelSpec
    from ddlscope.specs import describe_validation_error
    from ddlscope.workloads.sources import HFSpec, hf_decoder_facts
    from pydantic import ValidationError

    for key in REQUIRED_MODEL_KEYS:
        _required(raw.get(key), f"--{key.replace('_', '-')} (or model.{key} in the config file)")
    knobs = {"hidden": raw["hidden"], "heads": raw["heads"], "layers": raw["layers"], "seq_len": raw["seq"],
             "vocab": raw["vocab"]}
    knobs.update({name: raw[key] for key, name in (("kv_heads", "kv_heads"), ("ffn_hidden", "intermediate"))
                  if raw.get(key)})
    try:
        hf = HFSpec(name=raw["name"], **knobs)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, prefix="model")) from None
    facts = hf_decoder_facts(hf)
    shape = {k: facts[k] for k in ("hidden", "heads", "layers", "seq", "vocab", "kv_heads", "ffn_hidden",
                                   "tied_embeddings", "learned_positions")}
    kwargs = {k: raw[k] for k in ("global_batch", "attention", "dtype") if k in raw}
    kwargs["global_batch"] = _int(kwargs["global_batch"], "model.global_batch", minimum=1)
    candidates = [ModelSpec(name=raw["name"], gated_mlp=gated, **shape, **kwargs) for gated in (False, True)]
    if facts["layer_params"]:
        return min(candidates, key=lambda m: abs(m.layer_params - facts["layer_params"]))
    return candidates[0]


def _cnn_spec(raw: dict[str, Any]):
    from ddlscope.predict.cnn import CNNSpec, validate_cnn

    for key in GPT_ONLY_MODEL_KEYS:
        if key in raw:
            raise ConfigError(f"--{key.replace('_', '-')} (model.{key}) is a GPT option; "
                              f"{raw['name']} takes --global-batch, --image-size, --classes, --dtype")
    if raw["name"] not in CNN_MODELS and ":" not in raw["name"]:
        for key in ("image_size", "classes"):
            if key in raw:
                raise ConfigError(f"--{key.replace('_', '-')}: {raw['name']} is a registered workload; its images "
                                  "(32x32, 10 classes) are fixed")
    kwargs: dict[str, Any] = {"name": raw["name"], "global_batch": _int(
        _required(raw.get("global_batch"), "--global-batch (or model.global_batch in the config file)"),
        "model.global_batch", minimum=1)}
    for key in ("image_size", "classes"):
        if key in raw:
            kwargs[key] = _int(raw[key], f"--{key.replace('_', '-')}", minimum=1)
    for key in ("dtype", "optimizer"):
        if key in raw:
            if not isinstance(raw[key], str):
                raise ConfigError(f"model.{key} = {raw[key]!r}: must be a string")
            kwargs[key] = raw[key]
    if ":" in raw["name"]:
        kwargs.setdefault("image_size", 224)
        kwargs.setdefault("classes", 1000)
        kwargs["layers"] = _source_layers(raw["name"], kwargs["image_size"], kwargs["classes"])
    elif raw["name"] not in CNN_MODELS:
        kwargs.update(image_size=32, classes=10, layers=_workload_layers(raw["name"]))
    spec = CNNSpec(**kwargs)
    validate_cnn(spec)
    return spec


def _predict_cnn(model_raw: dict[str, Any], parallel_raw: dict[str, Any], cluster: Any, spot: bool,
                 measured_step_s: Optional[float], sustained_fraction: Optional[float], raw: dict[str, Any],
                 as_json: bool) -> None:
    from ddlscope.predict import fit_sustained_fraction
    from ddlscope.predict.cnn_predict import predict_cnn, strategy_of

    spec = _cnn_spec(model_raw)
    strategy = parallel_raw.get("strategy")
    if strategy is not None and not isinstance(strategy, str):
        raise ConfigError(f"parallel.strategy = {strategy!r}: must be a string")
    parallel = _parallel_spec(parallel_raw, cluster.n_gpus)
    strategy = strategy_of(parallel, strategy)
    fraction = None
    if measured_step_s is not None:
        if sustained_fraction is not None or "sustained_fraction" in raw:
            raise ConfigError("--measured-step-s fits sustained_fraction: give one or the other, not both")
        predict_cnn(spec, parallel, cluster, strategy)  # refuse bad input before fitting
        fraction = fit_sustained_fraction(
            lambda f: predict_cnn(spec, parallel, cluster.with_sustained_fraction(f), strategy).step_time_s,
            measured_step_s, cluster.device)
        cluster = cluster.with_sustained_fraction(fraction)
    result = predict_cnn(spec, parallel, cluster, strategy, spot=spot)
    result.notes.extend(_SOURCE_NOTES.get(spec.name, []))
    if as_json:
        out = result.to_dict()
        out["sustained_fraction"] = cluster.device.efficiency.sustained_fraction
        if ":" in spec.name:  # a model source: `ddlscope memory`'s per-rank figures for this strategy too
            out["memory_per_rank"] = _memory_per_rank(spec, strategy, cluster)
        if fraction is not None:
            out["fitted_to_step_s"] = measured_step_s
        print(json.dumps(out))
        return
    _print_prediction(result, f"{strategy} DP{parallel.dp} mb{parallel.micro_batch}", spot)
    if fraction is not None:
        console.print(f"sustained_fraction {fraction:.4f} reproduces the measured {measured_step_s:g} s step; pass "
                      f"--sustained-fraction {fraction:.3f} to predict or plan other configurations on this stack")


def _model_spec(raw: dict[str, Any]):
    from ddlscope.predict import ModelSpec

    name = raw.get("name", "gpt")
    if isinstance(name, str) and name.startswith("hf:"):
        for key in ("gated_mlp", "experts", "top_k", "capacity_factor", "expert_imbalance", *CNN_ONLY_MODEL_KEYS):
            if key in raw:
                raise ConfigError(f"--{key.replace('_', '-')} (model.{key}): {name} is read off the model; "
                                  "give its sizes (--hidden, --heads, --layers, --kv-heads, --ffn-hidden, --seq, --vocab)")
        return _hf_model_spec(raw)
    if name not in MODELS:
        raise ConfigError(f"--model = {name!r}: allowed: {', '.join(MODELS)}")
    for key in CNN_ONLY_MODEL_KEYS:
        if key in raw:
            raise ConfigError(f"--{key.replace('_', '-')} (model.{key}) is for a CNN model "
                              f"({', '.join(CNN_MODELS)})")
    for key in REQUIRED_MODEL_KEYS:
        _required(raw.get(key), f"--{key.replace('_', '-')} (or model.{key} in the config file)")
    kwargs = {k: raw[k] for k in MODEL_KEYS if k in raw}
    for key in (*REQUIRED_MODEL_KEYS, "ffn_hidden", "kv_heads", "experts", "top_k"):
        if key in kwargs:
            kwargs[key] = _int(kwargs[key], f"model.{key}",
                               minimum=0 if key in ("ffn_hidden", "kv_heads", "experts") else 1)
    for key in ("capacity_factor", "expert_imbalance"):
        if key in kwargs and (isinstance(kwargs[key], bool) or not isinstance(kwargs[key], (int, float))
                              or kwargs[key] != kwargs[key]):
            raise ConfigError(f"model.{key} = {kwargs[key]!r}: must be a number")
    if "gated_mlp" in kwargs and not isinstance(kwargs["gated_mlp"], bool):
        raise ConfigError(f"model.gated_mlp = {kwargs['gated_mlp']!r}: must be true or false")
    attention = kwargs.get("attention", "flash")
    if attention not in ("flash", "unfused"):
        raise ConfigError(f"--attention = {attention!r}: allowed: flash, unfused")
    dtype = kwargs.get("dtype", "bf16")
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"--dtype = {dtype!r}: allowed: bf16, fp16, fp32")
    return ModelSpec(**kwargs)


def _parallel_spec(raw: dict[str, Any], n_gpus: int):
    from ddlscope.predict import ParallelSpec
    from ddlscope.predict.specs import RECOMPUTE_CODES, SCHEDULE_CODES

    kwargs = {k: raw[k] for k in PARALLEL_KEYS if k in raw and k != "strategy"}
    for key in ("tp", "cp", "pp", "dp", "ep", "micro_batch", "interleave"):
        if key in kwargs:
            kwargs[key] = _int(kwargs[key], f"--{key.replace('_', '-')}", minimum=1)
    if "zero" in kwargs:
        kwargs["zero"] = _int(kwargs["zero"], "--zero", minimum=0)
        if kwargs["zero"] not in (0, 1, 2, 3):
            raise ConfigError(f"--zero = {kwargs['zero']}: allowed: 0, 1, 2, 3")
    recompute = kwargs.get("recompute", "none")
    if recompute not in RECOMPUTE_CODES:
        raise ConfigError(f"--recompute = {recompute!r}: allowed: {', '.join(RECOMPUTE_CODES)}")
    schedule = kwargs.get("schedule", "1f1b")
    if schedule not in SCHEDULE_CODES:
        raise ConfigError(f"--schedule = {schedule!r}: allowed: {', '.join(SCHEDULE_CODES)}")
    _booleans(kwargs, ("sequence_parallel", *STACK_KEYS))
    if "dp" not in kwargs:
        tp, pp, cp = kwargs.get("tp", 1), kwargs.get("pp", 1), kwargs.get("cp", 1)
        if n_gpus % (tp * pp * cp):
            sizes = f"tp x pp = {tp} x {pp}" if cp == 1 else f"tp x cp x pp = {tp} x {cp} x {pp}"
            raise ConfigError(f"{sizes} = {tp * pp * cp}: must divide the cluster's {n_gpus} GPUs")
        kwargs["dp"] = n_gpus // (tp * pp * cp)
    known = {f.name for f in fields(ParallelSpec)}
    return ParallelSpec(**{k: v for k, v in kwargs.items() if k in known})


# [parallel] keys that describe the software stack rather than the layout: plan keeps them for every layout
STACK_KEYS = ("overlap_grad_reduce", "fused_grad_accumulation")


def _booleans(parallel_raw: dict[str, Any], keys: tuple[str, ...]) -> dict[str, bool]:
    """Those of `keys` that [parallel] (or a flag) gives, checked: true or false."""
    given = {k: parallel_raw[k] for k in keys if k in parallel_raw}
    for key, value in given.items():
        if not isinstance(value, bool):
            raise ConfigError(f"parallel.{key} = {value!r}: must be true or false")
    return given


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} = {value!r}: must be an integer")
    if value < minimum:
        raise ConfigError(f"{name} = {value}: must be >= {minimum}")
    return value


# ---------------------------------------------------------------------------- predict-run
def predict_run(
    run_ref: RunArg,
    calibration: Annotated[Optional[Path], typer.Option(
        "--calibration", help="Profile TOML from `ddlscope calibrate` (default: the newest in the store for the "
                              "run's host, else ./ddlscope-calibration.toml).")] = None,
    db: DbOption = DEFAULT_DB,
    as_json: JsonOption = False,
    kernels: Annotated[bool, typer.Option(
        "--kernels/--no-kernels", help="Time the workload's own forward and backward on this machine, alone "
                                       "and in the run's ranks side by side (a few seconds), rather than "
                                       "price them from FLOPs and bytes.")] = True,
) -> None:
    """Predict a stored local run from its config and this machine's calibration; compare with what it measured."""
    print_run_prediction(run_ref, db, calibration, as_json, kernels)


def print_run_prediction(run_ref: str, db: Path, calibration: Path | None, as_json: bool,
                         kernels: bool = True) -> None:
    """`predict-run RUN` and `predict --against RUN`: predicted next to measured."""
    result = predict_stored_run(run_ref, db, calibration, kernels)
    if as_json:
        print(json.dumps(result, default=str))
        return
    console.print(prediction_table(result))
    for note in result["predicted"]["notes"]:
        console.print(f"[yellow]note:[/yellow] {escape(str(note))}")


def predict_stored_run(run_ref: str, db: Path, calibration: Path | None, kernels: bool = True) -> dict[str, Any]:
    """Prediction, measurement and errors for one stored run (the logic behind `predict-run`)."""
    from ddlscope.analysis.summary import summarize
    from ddlscope.calibrate import workload_facts
    from ddlscope.calibrate.profile import resolve_calibration
    from ddlscope.predict.local import compare, measured_from_summary, predict_local

    require_store(db)
    with Store(db) as store:
        run = store.get_run(run_ref)
        summary = summarize(store, run).to_dict()
        profile, source = resolve_calibration(store, calibration, run.host)
    facts = workload_facts(run.config, time_kernels=kernels)
    predicted = predict_local(run.config, run.environment, facts, profile)
    measured = measured_from_summary(summary)
    return {"run": {"id": run.id, "name": run.name, "workload": run.workload, "strategy": run.strategy,
                    "world_size": run.world_size, "network": run.environment.get("network", {}).get("profile")},
            "calibration": source,
            "predicted": predicted, "measured": measured, "error": compare(predicted, measured)}


def prediction_table(result: dict[str, Any]) -> Table:
    p, m = result["predicted"], result["measured"]
    r = result["run"]
    table = Table("", "predicted", "measured", "error",
                  title=escape(f"run {r['id']}: {r['strategy']} x{r['world_size']} {r['workload']} "
                               f"(network {r['network']})"),
                  caption=escape(f"machine profile: {result.get('calibration', '-')}"))

    def ms(v: float | None) -> str:
        return f"{v * 1e3:.3f} ms" if v is not None else "-"

    def err(a: float | None, b: float | None) -> str:
        return f"{(a - b) / b * 100:+.1f}%" if a is not None and b else "-"

    table.add_row("step", ms(p["step_s"]), ms(m["step_s"]), err(p["step_s"], m["step_s"]))
    for phase, value in p["breakdown_s"].items():
        measured = m["breakdown_s"].get(phase)
        table.add_row(f"  {phase}", ms(value), ms(measured), err(value, measured))
    for cat, value in p["memory_bytes"]["worker"].items():
        measured = m["memory_bytes"].get(cat)
        table.add_row(f"{cat} bytes", str(value), str(measured), err(value, measured))
    table.add_row("model states bytes", str(p["model_state_bytes"]), str(m["model_state_bytes"]),
                  err(p["model_state_bytes"], m["model_state_bytes"]))
    return table


# ---------------------------------------------------------------------------- output
def _gpt_params(model: dict[str, Any]) -> int:
    from ddlscope.predict import ModelSpec

    return ModelSpec(**model).params


def _print_prediction(p: Any, label: str, spot: bool) -> None:
    console.print(f"[bold]{escape(str(p.cluster))}[/bold]  {label}  ({p.micro_batches} micro-batches per step)")
    head = Table(show_header=False, box=None, pad_edge=False)
    spread = getattr(p, "range", None) or {}
    head.add_row("step time", f"{p.step_time_s:.4g} s" + (
        f"  (range {spread['step_time_s'][0]:.4g}-{spread['step_time_s'][1]:.4g} s: the kernel sources' spread)"
        if "step_time_s" in spread else ""))
    stack = (getattr(p, "stack_range", None) or {}).get("step_time_s")
    if stack:
        head.add_row("", f"{stack[0]:.4g}-{stack[1]:.4g} s as published training stacks have run "
                     "(docs/predict.md, Validation)")
    if hasattr(p, "images_per_s_per_gpu"):  # a CNN
        head.add_row("model", f"{p.model['name']} at {p.model['image_size']}x{p.model['image_size']}: "
                     f"{p.parameters:,} parameters, {p.forward_gmacs_per_sample:.3g} GMACs forward per image, "
                     f"{p.activation_mb_per_sample:.3g} MB activations per image")
        head.add_row("throughput", f"{p.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {p.mfu:.1%}, "
                     f"{p.images_per_s_per_gpu:,.0f} images/s per GPU")
    else:
        m = p.model
        head.add_row("model", f"{m['name']}: {_gpt_params(m):,} parameters, {m['layers']} layers, hidden "
                     f"{m['hidden']}, {m['heads']} heads ({m['kv_heads'] or m['heads']} key/value), seq {m['seq']}")
        head.add_row("throughput", f"{p.tflops_per_gpu:.1f} TFLOP/s per GPU (with recomputation), "
                     f"MFU {p.mfu:.1%}, {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU")
    head.add_row("memory", f"{p.memory_gb_per_gpu:.1f} GB on the fullest GPU of {p.memory_capacity_gb:.1f} GB "
                 f"({p.memory_capacity_gb * 1e9 / 2**30:.0f} GiB): "
                 + ("[green]fits[/green]" if p.fits else "[red]does not fit[/red]"))
    head.add_row("energy", f"{p.energy_kwh_per_step:.4g} kWh per step (GPUs at board power)")
    head.add_row("cost", f"${p.cost_usd_per_step:.4g} per step ({'spot' if spot else 'on-demand'})")
    console.print(head)
    bt = Table("term", "seconds", "share", title="step breakdown (slowest pipeline stage)")
    for term, secs in p.breakdown_s.items():
        if term == "recompute_included":
            continue
        bt.add_row(term, f"{secs:.4g}", f"{secs / p.step_time_s:.1%}")
    bt.add_row("(recomputation, inside compute)", f"{p.breakdown_s['recompute_included']:.4g}", "")
    console.print(bt)
    mt = Table("memory", "GB", title="memory on the fullest GPU")
    for term, gb in p.memory_breakdown_gb.items():
        mt.add_row(term, f"{gb:.2f}")
    console.print(mt)
    for note in p.notes:
        if hasattr(p, "images_per_s_per_gpu"):
            console.print(f"[yellow]note:[/yellow] {escape(note)}")


def _with_range(p: Any) -> str:
    """The step time, and its range (the kernel sources' spread) where the prediction has one."""
    spread = (getattr(p, "range", None) or {}).get("step_time_s")
    return f"{p.step_time_s:.4g}" + (f" ({spread[0]:.3g}-{spread[1]:.3g})" if spread else "")


def _print_plan(result: Any) -> None:
    from ddlscope.predict import ParallelSpec

    console.print(f"[bold]{escape(str(result.cluster))}[/bold]: {result.evaluated:,} valid configurations scored in "
                  f"{result.search_s * 1e3:.1f} ms ({result.configs_per_s:,.0f}/s), {result.feasible:,} fit; "
                  f"ranked by {result.rank_by}")
    if not result.rows:
        console.print("[red]no configuration fits in memory[/red]")
        return
    # One configuration column that wraps, rather than ten narrow ones an 80-column log truncates.
    table = Table("#", Column("configuration", overflow="fold", ratio=1), "GPUs", "step s", "TFLOP/s", "MFU",
                  "GB", "$/step")
    for r in result.rows:
        p, q = r.prediction, r.prediction.parallel
        label = f"{q['strategy']} DP{q['dp']} mb{q['micro_batch']}" if "strategy" in q else ParallelSpec(**q).label()
        table.add_row(str(r.rank), label, str(q["tp"] * q.get("cp", 1) * q["pp"] * q["dp"]),
                      _with_range(p), f"{p.tflops_per_gpu:.0f}", f"{p.mfu:.1%}",
                      f"{p.memory_gb_per_gpu:.1f}", f"{p.cost_usd_per_step:.3g}")
    console.print(table)
    stack = (getattr(result.rows[0].prediction, "stack_range", None) or {}).get("step_time_s")
    if stack:
        slower = stack[1] / result.rows[0].prediction.step_time_s
        console.print(f"step s: the prediction (the kernel sources' spread); published training stacks have run up "
                      f"to {slower:.2f}x slower than predicted (docs/predict.md, Validation)", markup=False,
                      highlight=False)
    for r in result.rows:
        console.print(f"#{r.rank} {r.why}", markup=False, highlight=False)
