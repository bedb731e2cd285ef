"""Predictions: `predict` and `plan` (the performance model on the command line), and `predict-run`
(a stored local run predicted from this machine's calibration, next to what it measured).

A configuration for predict and plan comes from flags, from a TOML file, or both (flags win):

    cluster = "a100-80gb:280x8"
    spot = false                  # price with spot instead of on-demand rates
    stack = "ideal"               # a named software stack (catalogue.toml [stacks]); --stack wins
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

File and flags together are one `ddlscope.specs.prediction.PredictionInput`,
validated once; bad input raises `ddlscope.specs.ConfigError`, and the CLI's
main() prints its one-line message and exits with status 2.
"""

from __future__ import annotations

import functools
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, NamedTuple, Optional

import typer
from rich.markup import escape
from rich.table import Column, Table

from ddlscope.cli.common import (DEFAULT_DB, DbOption, JsonOption, RunArg, cluster_from_text, console, db_option,
                                 require_store, run_ref_callback)
from ddlscope.specs import ConfigError
from ddlscope.specs.prediction import CNN_MODELS, ModelInput, PredictionInput, read_input
from ddlscope.store import Store

ConfigArg = Annotated[Optional[Path], typer.Argument(
    help="TOML file with cluster, \\[model] and \\[parallel]; flags override it.")]
ClusterOpt = Annotated[Optional[str], typer.Option(
    "--cluster", help="(required) NAME:NODESxGPUS_PER_NODE, e.g. a100-80gb:64x8; local:1xN is N ranks of this machine "
                      "as `ddlscope calibrate` measured it.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", help="gpt (default; --hidden, --heads, ...), a well-known model by name (llama3-8b, llama3-70b, "
                    "mixtral-8x7b, gpt3-175b, ...: predict/models.toml), a CNN: resnet50, vgg16, densenet121, a "
                    "transformers decoder hf:ARCH (hf:llama, with --hidden, --heads, ...), or an image model "
                    "torchvision:NAME, timm:NAME, module:PKG.MOD:FACTORY (--image-size, --classes).")]
ImageSizeOpt = Annotated[Optional[int], typer.Option(
    "--image-size", help="CNN input size: 224 (ImageNet network) or 32 (CIFAR variant); any size for a "
                         "torchvision/timm/module model (default 224).")]
ClassesOpt = Annotated[Optional[int], typer.Option("--classes", help="CNN output classes (default 1000).")]
HiddenOpt = Annotated[Optional[int], typer.Option("--hidden", help="(required for gpt and hf: models) Hidden size h.")]
HeadsOpt = Annotated[Optional[int], typer.Option("--heads", help="(required for gpt and hf: models) Attention heads a.")]
LayersOpt = Annotated[Optional[int], typer.Option("--layers", help="(required for gpt and hf: models) Transformer layers l.")]
SeqOpt = Annotated[Optional[int], typer.Option("--seq", help="(required for gpt and hf: models) Sequence length s.")]
VocabOpt = Annotated[Optional[int], typer.Option("--vocab", help="(required for gpt and hf: models) Vocabulary size V.")]
GlobalBatchOpt = Annotated[Optional[int], typer.Option("--global-batch", help="(required) Sequences (or images) per optimizer step.")]
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
StackOpt = Annotated[Optional[str], typer.Option(
    "--stack", help="A named software stack (catalogue.toml \\[stacks]): ideal (default: today's kernel ceiling), "
                    "megatron-lm-2021, megatron-lm-2022, deepspeed-megatron-2021, megatron-deepspeed-2022, "
                    "llm-foundry-2023, torchtitan-2024. It sets the switches you leave unset (gradient overlap, "
                    "fused accumulation, ZeRO stage, attention kernel), refuses layouts its code cannot run, and "
                    "scales the kernel rates by its one figure, from one named published run; "
                    "--sustained-fraction or --measured-step-s replaces that figure with yours.")]
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
        "--strategy", help="CNN: ddp (default), fsdp (= --zero 3), ps-sync or ps-async; --profile: any strategy "
                           "(default ddp).")] = None,
    spot: SpotOpt = None,
    stack: StackOpt = None,
    sustained_fraction: SustainedOpt = None,
    measured_step_s: Annotated[Optional[float], typer.Option(
        "--measured-step-s", help="A step time measured for this configuration on your stack: fit "
                                  "sustained_fraction to it, print it, and predict with it.")] = None,
    as_json: JsonOption = False,
    against: Annotated[Optional[str], typer.Option(
        "--against", metavar="RUN", help="Predict a stored local run with this machine's calibration instead.",
        callback=run_ref_callback)] = None,
    calibration: PredictCalibrationOpt = None,
    db: PredictDbOpt = DEFAULT_DB,
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", help="A model profile (`ddlscope calibrate --model`): predict its model under --strategy on "
                          "--world-size ranks of this machine (with --calibration), or on a catalogue --cluster, "
                          "its compute the profile's (docs/profile.md).")] = None,
    world_size: Annotated[Optional[int], typer.Option(
        "--world-size", help="--profile: ranks of this machine (default: local:1xN's N, else 2).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option(
        "--set", help="--profile: a strategy knob, strategy.KEY=VALUE, e.g. strategy.period=4 (repeatable).")] = None,
    steps: Annotated[Optional[int], typer.Option(
        "--steps", help="--profile: the run's steps, which decide how often a periodic strategy's averages land "
                        "in its mean step (default: the workload's, as `ddlscope run` takes it).")] = None,
) -> None:
    """Predict one configuration: step time, TFLOP/s, MFU, memory per GPU, energy and cost per step."""
    if profile is not None:
        if config is not None or model is not None:
            raise ConfigError("--profile predicts the profile's own model: leave out CONFIG and --model")
        refuse_unused_with_profile({
            "--against": against, "--hidden": hidden, "--heads": heads, "--layers": layers, "--seq": seq,
            "--vocab": vocab, "--micro-batch": micro_batch, "--tp": tp, "--cp": cp, "--ep": ep, "--pp": pp,
            "--dp": dp, "--recompute": recompute, "--zero": zero, "--sequence-parallel": sequence_parallel,
            "--interleave": interleave, "--schedule": schedule, "--overlap-grad-reduce": overlap_grad_reduce,
            "--fused-grad-accumulation": fused_grad_accumulation, "--attention": attention, "--dtype": dtype,
            "--ffn-hidden": ffn_hidden, "--kv-heads": kv_heads, "--gated-mlp": gated_mlp, "--experts": experts,
            "--top-k": top_k, "--capacity-factor": capacity_factor, "--expert-imbalance": expert_imbalance,
            "--image-size": image_size, "--classes": classes, "--spot": spot, "--stack": stack,
            "--sustained-fraction": sustained_fraction, "--measured-step-s": measured_step_s})
        print_profile_prediction(profile, strategy or "ddp", world_size, cluster, global_batch, set_ or [],
                                 calibration, db, as_json, steps)
        return
    if against is not None:
        print_run_prediction(against, db, calibration, as_json)
        return
    if set_ or world_size is not None or steps is not None:
        raise ConfigError("--set, --world-size and --steps go with --profile (a model profile)")
    from ddlscope.predict import ParallelSpec, predict

    spec = _input(config, cluster, spot, sustained_fraction, stack=stack, model=dict(
        name=model, hidden=hidden, heads=heads, layers=layers, seq=seq, vocab=vocab, global_batch=global_batch,
        attention=attention, dtype=dtype, ffn_hidden=ffn_hidden, kv_heads=kv_heads, gated_mlp=gated_mlp,
        image_size=image_size, classes=classes, experts=experts, top_k=top_k, capacity_factor=capacity_factor,
        expert_imbalance=expert_imbalance), parallel=dict(
        tp=tp, cp=cp, ep=ep, pp=pp, dp=dp, micro_batch=micro_batch, zero=zero, recompute=recompute,
        sequence_parallel=sequence_parallel, interleave=interleave, schedule=schedule,
        overlap_grad_reduce=overlap_grad_reduce, fused_grad_accumulation=fused_grad_accumulation, strategy=strategy))
    if measured_step_s is not None and spec.sustained_fraction is not None:
        raise ConfigError("--measured-step-s fits sustained_fraction: give one or the other, not both")
    the_stack = _stack(spec, stack)
    the_cluster, use_spot = _cluster(spec, calibration, db), spec.spot
    if spec.model.is_cnn:
        _refuse_stack_for_cnn(the_stack)
        _predict_cnn(spec, the_cluster, measured_step_s, as_json)
        return
    step_model = _step_model(spec.model)
    parallel = ParallelSpec(**spec.parallel.layout(the_cluster.n_gpus))
    own_figure = spec.sustained_fraction is not None or measured_step_s is not None
    step_model, parallel, the_cluster = _with_stack(the_stack, spec, step_model, parallel, the_cluster, own_figure)
    if measured_step_s is not None:
        from ddlscope.predict import fitted_prediction

        fraction, result = fitted_prediction(step_model, parallel, the_cluster, measured_step_s, spot=use_spot)
        fitted = {"sustained_fraction": fraction, "fitted_to_step_s": measured_step_s,
                  "catalogue_sustained_fraction": the_cluster.device.efficiency.sustained_fraction}
    else:
        result, fitted = predict(step_model, parallel, the_cluster, spot=use_spot), None
    if as_json:
        out = result.to_dict()
        out["parameters"] = step_model.params
        if spec.model.kind == "hf" and (memory := _decoder_memory_per_rank(spec.model, parallel, the_cluster)):
            out["memory_per_rank"] = memory  # what `ddlscope memory` says of this model and strategy
        if spec.model.preset:
            out["preset"] = {"name": spec.model.preset, "source": _preset_source(spec.model.preset)}
        out["sustained_fraction"] = fitted["sustained_fraction"] if fitted else \
            the_cluster.device.efficiency.sustained_fraction
        out["stack"] = _stack_json(the_stack, own_figure, out["sustained_fraction"])
        if fitted:
            out["fitted_to_step_s"] = measured_step_s
        print(json.dumps(out))
        return
    if spec.model.preset:
        console.print(f"{spec.model.preset}: {_preset_source(spec.model.preset)}", markup=False, highlight=False)
    _print_stack(the_stack, own_figure)
    _print_prediction(result, parallel.label(), use_spot, _range_label(the_stack, own_figure))
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
    top: Annotated[int, typer.Option("--top", help="How many layouts to show, each once at its best micro-batch, "
                                                   "ZeRO, recomputation and schedule (every configuration where "
                                                   "fewer layouts fit).")] = 5,
    max_micro_batch: Annotated[int, typer.Option("--max-micro-batch", help="Largest micro-batch to try.")] = 64,
    spot: SpotOpt = None,
    stack: StackOpt = None,
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
    from ddlscope.specs.prediction import PlanSearch

    search = read_input(PlanSearch, {"by": by, "top": top, "max_micro_batch": max_micro_batch},
                        flags=("by", "top", "max_micro_batch"))
    # the layout is searched over; the stack's gradient handling ([parallel] or flags) holds for every layout
    spec = _input(config, cluster, spot, sustained_fraction, stack=stack, model=dict(
        name=model, hidden=hidden, heads=heads, layers=layers, seq=seq, vocab=vocab, global_batch=global_batch,
        attention=attention, dtype=dtype, ffn_hidden=ffn_hidden, kv_heads=kv_heads, gated_mlp=gated_mlp,
        image_size=image_size, classes=classes, experts=experts, top_k=top_k, capacity_factor=capacity_factor,
        expert_imbalance=expert_imbalance), parallel=dict(
        overlap_grad_reduce=overlap_grad_reduce, fused_grad_accumulation=fused_grad_accumulation))
    the_stack = _stack(spec, stack)
    the_cluster = _cluster(spec, calibration, db)
    if burst:
        _plan_burst(spec.model, the_cluster, background_efficiency, max_slowdown, as_json)
        return
    options = dict(top=search.top, rank_by=search.by, spot=spec.spot, max_micro_batch=search.max_micro_batch,
                   **spec.parallel.stack())
    own_figure = spec.sustained_fraction is not None
    if spec.model.is_cnn:
        from ddlscope.predict.cnn_predict import plan_cnn

        _refuse_stack_for_cnn(the_stack)
        result = plan_cnn(_cnn(spec.model), the_cluster, **options)
    else:
        from ddlscope.predict import ParallelSpec, with_stack

        # the stack's switches where the input leaves them unset; its layout rules go to plan's search
        given = set(spec.parallel.stack()) | {"zero"} | (spec.model.model_fields_set & {"attention"})
        step_model, switches, the_cluster = with_stack(
            the_stack, _step_model(spec.model), ParallelSpec(**spec.parallel.stack()), the_cluster, given,
            figure=not own_figure)
        options.update(overlap_grad_reduce=switches.overlap_grad_reduce,
                       fused_grad_accumulation=switches.fused_grad_accumulation,
                       grad_reduce_bytes=switches.grad_reduce_bytes, fused_rope=switches.fused_rope,
                       fused_elementwise=switches.fused_elementwise)
        result = plan(step_model, the_cluster, stack=the_stack, **options)
    if as_json:
        out = {
            "cluster": result.cluster, "by": result.rank_by, "evaluated": result.evaluated,
            "feasible": result.feasible, "search_s": result.search_s, "configs_per_s": result.configs_per_s,
            "stack": _stack_json(the_stack, own_figure, the_cluster.device.efficiency.sustained_fraction),
            "top": [{"rank": r.rank, "why": r.why, **r.prediction.to_dict()} for r in result.rows]}
        print(json.dumps(out))
        return
    _print_stack(the_stack, own_figure)
    _print_plan(result, _range_label(the_stack, own_figure))


def _plan_burst(model: ModelInput, cluster: Any, background_efficiency: float, max_slowdown: float,
                as_json: bool) -> None:
    """`plan --burst`: uniform data parallelism against the burst plans (predict/burst.py)."""
    from ddlscope.predict.burst import burst, degree_runs

    if not model.is_cnn:
        raise ConfigError(f"--burst: prices a data-parallel degree per unit of a CNN ({', '.join(CNN_MODELS)}); "
                          "give --model with one of them")
    result = burst(_cnn(model), cluster, background_efficiency, max_slowdown)
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
def _input(config: Optional[Path], cluster: Optional[str], spot: Optional[bool], sustained_fraction: Optional[float],
           model: dict[str, Any], parallel: dict[str, Any], stack: Optional[str] = None) -> PredictionInput:
    """The config file's tables with the flags given laid over them, validated once (specs/prediction.py)."""
    flags = {"cluster": cluster, "spot": spot, "sustained_fraction": sustained_fraction, "stack": stack,
             "model": model, "parallel": parallel}
    from ddlscope.predict.presets import expand_preset, model_presets

    data, given = _with_flags(_read_config(config), flags)
    preset = None
    if isinstance(data.get("model"), dict):
        preset = data["model"].get("name") if data["model"].get("name") in model_presets() else None
        data["model"] = expand_preset(data["model"])
    spec = read_input(PredictionInput, data, given, vision_workloads=_vision_workloads, presets=tuple(model_presets()))
    spec.model.from_preset(preset)
    return spec


def _preset_source(name: str) -> str:
    from ddlscope.predict.presets import model_presets

    return str(model_presets()[name]["source"])


def _with_flags(raw: dict[str, Any], flags: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """`raw` with every flag given (not None) in its place, and the dotted keys the flags gave."""
    data, given = dict(raw), set()
    for key, value in flags.items():
        if isinstance(value, dict):
            table = {k: v for k, v in value.items() if v is not None}
            given |= {f"{key}.{k}" for k in table}
            section = data.get(key, {})
            # a section that is not a table stays as the file has it, for the spec to name
            data[key] = {**section, **table} if isinstance(section, dict) else section
        elif value is not None:
            data[key] = value
            given.add(key)
    return data, given


def _read_config(path: Optional[Path]) -> dict[str, Any]:
    if path is None:
        return {}
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {' '.join(str(exc).split())}") from None


def _stack(spec: PredictionInput, flag: Optional[str]) -> Any:
    """The named stack (`ideal` when none): an unknown name is refused, naming the flag or the file's key."""
    from ddlscope.predict import get_stack

    return get_stack(spec.stack, "--stack" if flag is not None else "stack")


def _refuse_stack_for_cnn(stack: Any) -> None:
    if stack.name != "ideal":
        raise ConfigError(f"--stack = {stack.name!r}: the named stacks are transformer training stacks; a CNN takes "
                          "--sustained-fraction or --measured-step-s")


def _with_stack(stack: Any, spec: PredictionInput, model: Any, parallel: Any, cluster: Any, own_figure: bool) -> Any:
    """(model, parallel, cluster) under the stack: its switches where the input left them unset, its figure
    unless the user gave their own."""
    from ddlscope.predict import with_stack

    given = spec.parallel.model_fields_set | spec.model.model_fields_set
    return with_stack(stack, model, parallel, cluster, given, figure=not own_figure)


def _stack_json(stack: Any, own_figure: bool, sustained_fraction: float) -> dict[str, Any]:
    return stack.to_dict("your measurement" if own_figure else None, sustained_fraction)


def _print_stack(stack: Any, own_figure: bool) -> None:
    if stack.name == "ideal" and not own_figure:
        return
    if own_figure:
        figure = "your own sustained_fraction replaces its figure"
    elif stack.has_figure:
        figure = (f"sustained_fraction {stack.sustained_fraction:.3f} from one published run: {stack.figure_run} "
                  f"({stack.figure_source})")
    else:
        figure = "no figure (no published run of it is validated): kernels at their published rates"
    console.print(f"stack {stack.name}: {figure}", markup=False, highlight=False)


def _cluster(spec: PredictionInput, calibration: Optional[Path], db: Path) -> Any:
    """The cluster named, at the sustained fraction given (the catalogue refuses one past the device's peak)."""
    cluster = cluster_from_text(spec.cluster, calibration, db)
    if spec.sustained_fraction is None:
        return cluster
    return cluster.with_sustained_fraction(spec.sustained_fraction)


def _step_model(model: ModelInput) -> Any:
    """A GPT or a transformers decoder as predict.ModelSpec."""
    from ddlscope.predict import ModelSpec

    return _decoder(model) if model.kind == "hf" else ModelSpec(**model.gpt_knobs())


def _decoder(model: ModelInput) -> Any:
    """A transformers decoder (`hf:ARCH`) as the step model's GPT: its shapes from the flags, its
    embeddings, positions and MLP read off the model built on the meta device."""
    from pydantic import ValidationError

    from ddlscope.predict.specs import decoder_model_spec
    from ddlscope.specs import describe_validation_error
    from ddlscope.workloads.sources import HFSpec, hf_decoder_facts

    try:
        hf = HFSpec(**model.decoder_knobs())
    except ValidationError as err:  # sizes the architecture cannot take (heads not dividing hidden, ...)
        raise ConfigError(describe_validation_error(err, prefix="model")) from None
    return decoder_model_spec(hf_decoder_facts(hf), name=model.name, **model.batch_knobs())


def _cnn(model: ModelInput) -> Any:
    """A CNN as predict.cnn.CNNSpec; a registered workload's or a source's layers recorded from its model."""
    from ddlscope.predict.cnn import CNNSpec, validate_cnn

    knobs = model.cnn_knobs()
    if model.kind == "source":
        knobs["layers"] = _source_layers(model.name, knobs["image_size"], knobs["classes"]).layers
    elif model.kind == "workload":
        knobs["layers"] = _workload_layers(model.name)
    spec = CNNSpec(**knobs)
    validate_cnn(spec)
    return spec


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


class RecordedModel(NamedTuple):
    layers: tuple[Any, ...]  # predict/cnn.py's Layer, in forward order
    notes: list[str]  # what the layer model leaves out of the step, for the prediction to say


@functools.lru_cache(maxsize=8)  # plan and predict of one model in one process trace it once
def _source_layers(name: str, image_size: int, classes: int) -> RecordedModel:
    """A torchvision, timm or `module:` image model as predict/cnn.py's layers, recorded from one real
    forward of one image (studies/recorded.py), its FSDP units from the model's repeated blocks."""
    from ddlscope.runtime.config import load_experiment
    from ddlscope.studies.recorded import PRICED_FLOPS_TOLERANCE, priced_well, recorded_layers

    spec = load_experiment(None, {"workload.name": name, "workload.image_size": image_size,
                                  "workload.classes": classes}).workload
    layers, priced = recorded_layers(spec)
    if not priced_well(priced):
        raise ConfigError(f"--model = {name!r}: the CNN layer model prices {priced:.0%} of its forward FLOPs as torch "
                          f"counts them (more than {PRICED_FLOPS_TOLERANCE:.0%} off: attention, or operations other "
                          "than convolutions, linear layers, norms and pools); predict it as a transformer "
                          "(--model gpt or hf:ARCH) instead")
    notes = [] if abs(priced - 1) <= 0.01 else [
        f"the layer model prices {priced:.1%} of {name}'s forward FLOPs as counted by torch (the rest, e.g. "
        "attention, is not in the step time)"]
    return RecordedModel(layers, notes)


def _memory_per_rank(spec: Any, strategy: str, cluster: Any) -> dict[str, Any]:
    """What `ddlscope memory MODEL --strategy S --cluster C --batch B --json` gives for the same image
    model, strategy, ranks and global batch: one rank's bytes by category, from the model table."""
    return _memory_estimate({"workload.name": spec.name, "workload.image_size": spec.image_size,
                             "workload.classes": spec.classes, "workload.batch_size": spec.global_batch}, strategy, cluster)


def _decoder_memory_per_rank(model: ModelInput, parallel: Any, cluster: Any) -> dict[str, Any] | None:
    """`ddlscope memory`'s figures for a transformers decoder under the registered strategy this layout is
    (`Estimator.transformer_layout`: DDP is ZeRO-0, FSDP ZeRO-3 over every GPU); None for a layout no
    strategy is (tensor, pipeline or context parallel, ZeRO 1-2)."""
    from ddlscope.predict.estimators import estimator_for
    from ddlscope.specs import strategy_specs

    if (parallel.tp, parallel.pp, parallel.cp, parallel.ep) != (1, 1, 1, 1):
        return None
    wanted = {"dp": parallel.dp, "zero": parallel.zero}
    for spec_class in strategy_specs():
        spec = spec_class()
        layout = estimator_for(spec).transformer_layout(spec, parallel.dp) or {}
        if {k: layout.get(k) for k in wanted} == wanted:
            knobs = {f"workload.{k}": v for k, v in model.decoder_knobs().items()}
            return _memory_estimate({**knobs, "workload.batch_size": model.global_batch}, spec.registered_name,
                                    cluster, world_size=parallel.dp)
    return None


def _memory_estimate(workload: dict[str, Any], strategy: str, cluster: Any, world_size: int | None = None
                     ) -> dict[str, Any]:
    from ddlscope.memory_estimate import Budget, estimate
    from ddlscope.runtime.config import load_experiment

    overrides = {**workload, "cluster.world_size": world_size or cluster.n_gpus, "strategy.name": strategy}
    device = cluster.device
    budget = Budget(device.key, device.memory_bytes, device.framework_overhead_bytes)
    (per_rank,) = estimate(load_experiment(None, overrides), overrides, budget, all_strategies=False)["estimates"]
    return per_rank


def _predict_cnn(spec: PredictionInput, cluster: Any, measured_step_s: Optional[float], as_json: bool) -> None:
    from ddlscope.predict import ParallelSpec, fit_sustained_fraction
    from ddlscope.predict.cnn_predict import predict_cnn, strategy_of

    net = _cnn(spec.model)
    parallel = ParallelSpec(**spec.parallel.layout(cluster.n_gpus))
    strategy = strategy_of(parallel, spec.parallel.strategy)
    fraction = None
    if measured_step_s is not None:
        predict_cnn(net, parallel, cluster, strategy)  # refuse bad input before fitting
        fraction = fit_sustained_fraction(
            lambda f: predict_cnn(net, parallel, cluster.with_sustained_fraction(f), strategy).step_time_s,
            measured_step_s, cluster.device)
        cluster = cluster.with_sustained_fraction(fraction)
    result = predict_cnn(net, parallel, cluster, strategy, spot=spec.spot)
    if spec.model.kind == "source":  # recorded already: the cache hands back the same layers and notes
        result.notes.extend(_source_layers(net.name, net.image_size, net.classes).notes)
    if as_json:
        out = result.to_dict()
        out["sustained_fraction"] = cluster.device.efficiency.sustained_fraction
        if spec.model.kind == "source":  # `ddlscope memory`'s per-rank figures for this strategy too
            out["memory_per_rank"] = _memory_per_rank(net, strategy, cluster)
        if fraction is not None:
            out["fitted_to_step_s"] = measured_step_s
        print(json.dumps(out))
        return
    _print_prediction(result, f"{strategy} DP{parallel.dp} mb{parallel.micro_batch}", spec.spot)
    if fraction is not None:
        console.print(f"sustained_fraction {fraction:.4f} reproduces the measured {measured_step_s:g} s step; pass "
                      f"--sustained-fraction {fraction:.3f} to predict or plan other configurations on this stack")


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


# ---------------------------------------------------------------------------- predict --profile
def refuse_unused_with_profile(given: dict[str, Any]) -> None:
    """`predict --profile` prices the profile's own model at the precision it was measured at: the model,
    layout and pricing flags of a catalogue prediction have nothing to act on, and were silently ignored."""
    unused = [flag for flag, value in given.items() if value is not None]
    if unused:
        raise ConfigError(f"--profile does not use {', '.join(unused)}: it predicts the profiled model under "
                          "--strategy (with --set strategy.KEY=VALUE) on --world-size ranks or a --cluster, with "
                          "--global-batch, --steps, --calibration")


def print_profile_prediction(path: Path, strategy: str, world_size: int | None, cluster: str | None,
                             global_batch: int | None, sets: list[str], calibration: Path | None, db: Path,
                             as_json: bool, steps: int | None = None) -> None:
    """`predict --profile FILE`: the profile's model under `strategy`, on this machine or a catalogue cluster."""
    from ddlscope.predict.catalogue import LOCAL, cluster_name
    from ddlscope.predict.from_profile import load_model_profile

    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size {world_size}: must be >= 1")
    if global_batch is not None and global_batch < 1:
        raise ConfigError(f"--global-batch {global_batch}: must be >= 1")
    knobs = _strategy_knobs(strategy, sets)
    profile = load_model_profile(path)
    if cluster is None or cluster_name(cluster) == LOCAL:
        _print_local_profile_prediction(profile, knobs, world_size, cluster, global_batch, calibration, db, as_json,
                                        steps)
    else:
        _print_cluster_profile_prediction(profile, knobs, world_size, cluster, global_batch, as_json, steps)


def profile_run(profile: dict[str, Any], knobs: dict[str, Any], world: int, global_batch: int | None,
                steps: int | None) -> Any:
    """The run being predicted, as `ddlscope run` would take it: the profile's workload (its steps the
    run's: --steps, else the workload's default), the strategy, the ranks, through load_experiment and its
    checks (gossip refuses one rank here as `run` does)."""
    from ddlscope.predict.from_profile import run_config
    from ddlscope.runtime.config import load_experiment

    config = run_config(profile, knobs, world, global_batch, steps)
    return load_experiment(None, {"workload": config["workload"], "strategy": config["strategy"],
                                  "cluster.world_size": world})


def _strategy_knobs(strategy: str, sets: list[str]) -> dict[str, Any]:
    from ddlscope.runtime.config import parse_override

    knobs: dict[str, Any] = {"name": strategy}
    for item in sets:
        key, value = parse_override(item)
        if not key.startswith("strategy.") or key == "strategy.name":
            raise ConfigError(f"--set {item}: with --profile, --set takes strategy knobs (strategy.KEY=VALUE); "
                              "name the strategy with --strategy")
        knobs[key.removeprefix("strategy.")] = value
    return knobs


def _print_local_profile_prediction(profile: dict[str, Any], knobs: dict[str, Any], world_size: int | None,
                                   cluster: str | None, global_batch: int | None, calibration: Path | None, db: Path,
                                   as_json: bool, steps: int | None = None) -> None:
    from ddlscope.calibrate.profile import this_machine_profile
    from ddlscope.predict.from_profile import predict_local_from_profile

    world = world_size or (cluster_from_text(cluster, calibration, db).gpus_per_node if cluster else 2)
    if cluster and world != cluster_from_text(cluster, calibration, db).gpus_per_node:
        raise ConfigError(f"--world-size {world} and --cluster {cluster} disagree: give one")
    exp = profile_run(profile, knobs, world, global_batch, steps)
    knobs = exp.model_dump(mode="json")["strategy"]
    machine = this_machine_profile(calibration, db)
    predicted = predict_local_from_profile(profile, knobs, world, machine, global_batch=exp.workload.batch_size,
                                           steps=exp.workload.steps)
    if as_json:
        print(json.dumps({"strategy": knobs, "world_size": world, "cluster": f"local:1x{world}", **predicted}))
        return
    table = Table("", "predicted", title=escape(f"{profile['workload']['name']}: {knobs['name']} x{world} on this "
                                                f"machine, from the profile"))
    table.add_row("step", f"{predicted['step_s'] * 1e3:.3f} ms")
    for phase, value in predicted["breakdown_s"].items():
        table.add_row(f"  {phase}", f"{value * 1e3:.3f} ms")
    table.add_row("model states bytes", str(predicted["model_state_bytes"]))
    console.print(table)
    for note in predicted["notes"]:
        console.print(f"[yellow]note:[/yellow] {escape(str(note))}")


def _print_cluster_profile_prediction(profile: dict[str, Any], knobs: dict[str, Any], world_size: int | None,
                                     cluster: str, global_batch: int | None, as_json: bool,
                                     steps: int | None = None) -> None:
    from dataclasses import asdict

    from ddlscope.predict.catalogue import parse_cluster
    from ddlscope.predict.from_profile import predict_cluster_from_profile

    the_cluster = parse_cluster(cluster)
    if world_size is not None and world_size != the_cluster.n_gpus:
        raise ConfigError(f"--world-size {world_size} and --cluster {cluster} ({the_cluster.n_gpus} GPUs) disagree: "
                          "give one")
    exp = profile_run(profile, knobs, the_cluster.n_gpus, global_batch, steps)
    knobs = exp.model_dump(mode="json")["strategy"]
    estimate = predict_cluster_from_profile(profile, knobs, the_cluster, exp.workload.batch_size, exp.workload.steps)
    if as_json:
        print(json.dumps({"strategy": knobs, "cluster": cluster, **asdict(estimate)}, default=str))
        return
    table = Table("", "predicted", title=escape(f"{profile['workload']['name']}: {knobs['name']} on {cluster}, "
                                                f"from the profile"))
    table.add_row("step", f"{estimate.step_s * 1e3:.3f} ms")
    table.add_row("  compute", f"{estimate.compute_s * 1e3:.3f} ms")
    table.add_row("  exposed communication", f"{estimate.exposed_comm_s * 1e3:.3f} ms")
    table.add_row("memory per GPU", f"{estimate.memory_bytes_per_gpu / 2**30:.2f} GiB")
    console.print(table)
    for note in estimate.notes:
        console.print(f"[yellow]note:[/yellow] {escape(str(note))}")


# ---------------------------------------------------------------------------- output
def _gpt_params(model: dict[str, Any]) -> int:
    from ddlscope.predict import ModelSpec

    return ModelSpec(**model).params


def _range_label(stack: Any, own_figure: bool) -> str:
    """What the stack range is, in the text: the stack's own published runs under its figure, else all of them."""
    if stack.has_figure and not own_figure:
        return f"as the {stack.name} stack's published runs have run (docs/predict.md, Stacks)"
    return "as published training stacks have run (docs/predict.md, Validation)"


def _print_prediction(p: Any, label: str, spot: bool,
                      range_label: str = "as published training stacks have run (docs/predict.md, Validation)") -> None:
    console.print(f"[bold]{escape(str(p.cluster))}[/bold]  {label}  ({p.micro_batches} micro-batches per step)")
    head = Table(show_header=False, box=None, pad_edge=False)
    spread = getattr(p, "range", None) or {}
    head.add_row("step time", f"{p.step_time_s:.4g} s" + (
        f"  (range {spread['step_time_s'][0]:.4g}-{spread['step_time_s'][1]:.4g} s: the kernel sources' spread)"
        if "step_time_s" in spread else ""))
    stack = (getattr(p, "stack_range", None) or {}).get("step_time_s")
    if stack:
        head.add_row("", f"{stack[0]:.4g}-{stack[1]:.4g} s {range_label}")
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


def _print_plan(result: Any, range_label: str = "") -> None:
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
        if range_label.startswith("as the "):  # a named stack's figure: its own runs' spread
            faster = result.rows[0].prediction.step_time_s / stack[0]
            console.print(f"step s: the prediction (the kernel sources' spread); {range_label.removeprefix('as ')} "
                          f"from {faster:.2f}x faster to {slower:.2f}x slower than predicted", markup=False,
                          highlight=False)
        else:
            console.print(f"step s: the prediction (the kernel sources' spread); published training stacks have run "
                          f"up to {slower:.2f}x slower than predicted (docs/predict.md, Validation)", markup=False,
                          highlight=False)
    for r in result.rows:
        console.print(f"#{r.rank} {r.why}", markup=False, highlight=False)
