"""Predict a multi-rank step from a model profile (`ddlscope calibrate --model`, calibrate/layer_profile.py).

Torch-free. The profile replaces the compute figure of the existing predictors; it is not a
predictor of its own:

- this machine (`local:1xN`, or no cluster): the profile's whole step at the rank's batch becomes
  the workload's kernels (`facts["kernels"]`, what `predict-run` times itself), and
  predict/local.py assembles the step from them as it does for a stored run: the ranks' turn-taking
  for cores, the stretch of running side by side and the strategy's communication, from the
  calibration and the strategy's estimator (predict/estimators/);
- a catalogue cluster: the strategy's cluster estimator on a workload whose compute per worker is
  the profile's, at the achieved fraction of the device's peak that makes it so.

The rank's batch is the global batch over the ranks where the strategy splits it (ddp, fsdp,
localsgd), the whole batch where it does not (pipeline); within the batches the profile measured
the whole step at, its compute is interpolated between them (piecewise linear, calibrate/model.py's
interpolation), not taken in proportion: a small batch's CPU step is mostly per-op overhead. Outside
them it is taken in proportion to the nearest measured batch (its time per sample; the optimizer
step, which does not grow with the batch, as measured there), and the prediction says so: a line
through two noisy points, continued, priced batch 1 at 0 s.

The device: on the device the profile was measured on (the same host's CPU, or a GPU of the
catalogue device the profile names) the figures are used as measured. Elsewhere, like with like:
another host's CPU by the two CPUs' measured fp32 1024^2 matmul rates (the profile's over the
calibration's at that size); a catalogue GPU to another catalogue GPU by their catalogue peaks at
the profile's precision (fp32, TF32 where the profile ran with it on, bf16, fp16). A CPU profile is
not scaled to a GPU, nor a GPU profile to this machine's CPU ranks: refused (see `cluster_scale`).

The run's steps (how often a periodic average lands in the mean step) are the predicted run's,
given by the caller, never the profile's workload's (the workload's default when it was profiled).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Mapping

from ddlscope.calibrate.layer_profile import PROFILE_KIND  # torch-free to import (torch inside its functions)
from ddlscope.calibrate.model import STATE_TENSORS, interpolate_linear, optimizer_kind, required
from ddlscope.calibrate.profile import CalibrationProfile
from ddlscope.specs import ConfigError

TIMES = ("data_s", "forward_s", "backward_s", "optimizer_s")
# Outside the measured batches these grow in proportion to the samples; the optimizer step does not
# (it steps the parameters, whatever the batch).
PER_SAMPLE = ("data_s", "forward_s", "backward_s")
MATMUL_SIZE = 1024  # the profile's matmul probe (calibrate/layer_profile.py:matmul_flops)
REQUIRED_KEYS = ("batch", "workload", "step", "step_by_batch", "facts", "device", "meta")


def load_model_profile(path: Path) -> dict[str, Any]:
    """A model profile from its TOML or JSON file; anything else is a one-line ConfigError."""
    if not path.is_file():
        raise ConfigError(f"--profile {path}: no such file (write one with `ddlscope calibrate --model`)")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--profile {path}: not a readable {'JSON' if path.suffix.lower() == '.json' else 'TOML'} "
                          f"file: {' '.join(str(exc).split())}") from None
    except OSError as exc:
        raise ConfigError(f"--profile {path}: cannot be read: {exc.strerror or exc}") from None
    return check_profile(data, f"--profile {path}")


def check_profile(data: Any, source: str = "the model profile") -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
        raise ConfigError(f"{source}: not a model profile (kind = {PROFILE_KIND!r}; "
                          "write one with `ddlscope calibrate --model`)")
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise ConfigError(f"{source}: missing {', '.join(missing)}")
    return data


def run_config(profile: Mapping[str, Any], strategy: Mapping[str, Any], world: int,
               global_batch: int | None = None, steps: int | None = None) -> dict[str, Any]:
    """The experiment config the local predictor reads: the profile's workload, the strategy, the ranks.
    The steps are the predicted run's (None: a run long enough to be in its steady state), never the
    profile's workload's: that is the workload's default when it was profiled (a 12-step localsgd run
    of period 4 was priced with the averages of 100 steps)."""
    workload = {key: value for key, value in profile["workload"].items() if key != "steps"}
    if global_batch is not None:
        workload["batch_size"] = global_batch
    if steps is not None:
        workload["steps"] = steps
    return {"workload": workload, "strategy": dict(strategy), "cluster": {"world_size": world}}


def rank_batch(config: Mapping[str, Any]) -> int:
    """Samples one rank computes per step: the global batch over the ranks where the strategy splits it."""
    from ddlscope.predict.local import strategy_of

    batch, world = int(config["workload"]["batch_size"]), int(config["cluster"]["world_size"])
    if strategy_of(dict(config)).traits.splits_global_batch:
        if batch < world:
            raise ConfigError(f"batch {batch} over {world} ranks: fewer than one sample a rank")
        return batch // world
    return batch


def step_at(profile: Mapping[str, Any], batch: int, scale: float = 1.0) -> dict[str, Any]:
    """The profile's whole step at `batch` samples, each time times `scale` (the device ratio): the facts'
    `kernels` as predict/local.py reads them. Between the measured batches interpolated; outside them in
    proportion to the nearest (time_at). A step with no forward + backward time is a ConfigError."""
    by_batch = profile["step_by_batch"]
    batches = [float(b) for b in by_batch["batch"]]
    kernels: dict[str, Any] = {key: time_at(batches, [float(v) for v in by_batch[key]], batch, key in PER_SAMPLE)
                               * scale for key in TIMES}
    compute_s = kernels["forward_s"] + kernels["backward_s"]
    if not compute_s > 0:
        raise ConfigError(f"the profile's forward + backward at {batch} samples a rank comes to {compute_s:g} s: "
                          "nothing to price the compute from; profile the model again (`ddlscope calibrate --model`)")
    kernels["steps"] = int(profile["step"].get("steps", 0))
    kernels["from_profile"] = True
    return kernels


def time_at(batches: list[float], values: list[float], batch: float, per_sample: bool) -> float:
    """A measured time at `batch` samples: piecewise linear between the measured batches; outside them the
    nearest one's, in proportion to the samples where the time is `per_sample` (never below 0). Not the
    end segment's slope continued: from 4/8/16 samples at 1/3/7 ms it priced 1 sample at 0 s, and noisy
    timings (a smaller batch slower) give a negative slope."""
    pairs = sorted(zip(batches, values))
    low, high = pairs[0], pairs[-1]
    if low[0] <= batch <= high[0]:
        return interpolate_linear([b for b, _ in pairs], [v for _, v in pairs], batch)
    nearest_batch, nearest_s = low if batch < low[0] else high
    return max(nearest_s, 0.0) * (batch / nearest_batch if per_sample else 1.0)


def batch_note(profile: Mapping[str, Any], batch: int) -> str | None:
    """What the prediction says where the rank's batch lies outside the profile's measured batches."""
    batches = sorted(int(b) for b in profile["step_by_batch"]["batch"])
    if batches[0] <= batch <= batches[-1]:
        return None
    nearest = batches[0] if batch < batches[0] else batches[-1]
    return (f"the rank's batch {batch} lies outside the batches the profile measured "
            f"({', '.join(map(str, batches))}): its forward, backward and batch read are batch {nearest}'s in "
            f"proportion to the samples, its optimizer step batch {nearest}'s; profile at --batch {batch} "
            "to measure it")


def facts_from_profile(profile: Mapping[str, Any], batch: int, scale: float = 1.0) -> dict[str, Any]:
    """The workload facts of one rank computing `batch` samples: the profile's (parameters, ops, FLOPs in
    proportion to the samples) with its measured step as the kernels."""
    facts = dict(profile["facts"])
    facts["flops"] = float(facts["flops"]) * batch / float(profile["batch"])
    facts["per_rank_batch"] = batch
    facts["kernels"] = step_at(profile, batch, scale)
    facts.pop("kernels_error", None)
    return facts


def local_scale(profile: Mapping[str, Any], calibration: CalibrationProfile) -> tuple[float, str]:
    """(factor on the profile's times, why) for this machine's CPU ranks as `calibration` describes them:
    1 on the host the profile was taken on, else another CPU's by the two CPUs' fp32 matmul rates at
    the probe's size (like with like). A GPU profile is refused: its 1024^2 matmul is launch-bound, and
    the model's step on a GPU neither per-op like a CPU's nor in proportion to one matmul's rate."""
    meta, calibration_meta = profile["meta"], calibration.meta
    name = profile["device"]["name"]
    if meta.get("device_type") != "cpu":
        raise ConfigError(f"the profile was measured on {name}: this machine's ranks compute on its CPU, and a GPU's "
                          "times do not scale to a CPU's; profile the model here (`ddlscope calibrate --model`), or "
                          "predict a catalogue cluster of that GPU (--cluster NAME:NODESxGPUS)")
    if calibration_meta is not None and meta.get("host") == calibration_meta.host:
        return 1.0, f"as measured on {name}"
    target = calibrated_matmul_flops(calibration)
    return rate_ratio(profile, target), (f"scaled from {name} by its {MATMUL_SIZE}^2 fp32 matmul rate over this "
                                         f"machine's ({profile['device']['matmul_flops'] / 1e9:.1f} / "
                                         f"{target / 1e9:.1f} GFLOP/s)")


def calibrated_matmul_flops(calibration: CalibrationProfile) -> float:
    """This machine's fp32 matmul FLOP/s at the profile probe's size where the calibration measured it
    (a full calibration does), else its best measured rate (a quick one stops at 512)."""
    matmul = calibration.compute.matmul
    sizes, flops = (matmul.sizes or [], matmul.flops or []) if matmul is not None else ([], [])
    at_size = [f for n, f in zip(sizes, flops) if int(n) == MATMUL_SIZE]
    return float(at_size[0]) if at_size else float(required(calibration.compute.peak_flops, "peak_flops"))


def rate_ratio(profile: Mapping[str, Any], target_flops: float) -> float:
    """How much longer a kernel takes on the target than on the profile's device: their rates' ratio."""
    if target_flops <= 0:
        raise ConfigError(f"target device rate {target_flops} FLOP/s: must be > 0")
    return float(profile["device"]["matmul_flops"]) / target_flops


def predict_local_from_profile(profile: Mapping[str, Any], strategy: Mapping[str, Any], world: int,
                               calibration: CalibrationProfile | Mapping[str, Any],
                               environment: Mapping[str, Any] | None = None,
                               global_batch: int | None = None, steps: int | None = None) -> dict[str, Any]:
    """predict/local.py's step of `world` ranks of this machine, its compute the profile's; `steps`: the
    predicted run's (None: its steady state)."""
    from ddlscope.predict.local import predict_local

    calibration = CalibrationProfile.coerce(calibration)
    config = run_config(profile, strategy, world, global_batch, steps)
    scale, why = local_scale(profile, calibration)
    batch = rank_batch(config)
    predicted = predict_local(config, dict(environment or {}), facts_from_profile(profile, batch, scale), calibration)
    predicted["notes"] = [note for note in predicted["notes"] if not note.startswith("compute alone:")]
    predicted["notes"].append(f"compute alone: the profile's whole step at {batch} samples a rank, {why}")
    if note := batch_note(profile, batch):
        predicted["notes"].append(note)
    predicted["profile"] = {"device": profile["device"]["name"], "scale": scale, "rank_batch": batch,
                            "split": profile.get("split")}
    return predicted


def same_device(profile: Mapping[str, Any], device_key: str, description: str) -> bool:
    """Whether the profile was measured on the catalogue device (its name holds the key's model, e.g. h100)."""
    name = str(profile["device"]["name"]).lower()
    model = device_key.lower().split("-")[0]
    return str(profile["meta"].get("device_type")) == "cuda" and (model in name or description.lower() in name)


def catalogue_device_of(profile: Mapping[str, Any]) -> Any:
    """The catalogue device the profile's GPU is (the one whose key's parts its name holds most of: an
    `NVIDIA A100-SXM4-80GB` is the a100-80gb), None for a CPU or a GPU the catalogue lacks."""
    from ddlscope.predict.catalogue import load_catalogue

    name = str(profile["device"]["name"]).lower().replace(" ", "-")
    matches = [(sum(part in name for part in device.key.split("-")), device)
               for device in load_catalogue().devices.values() if same_device(profile, device.key, device.description)]
    return max(matches, key=lambda match: match[0])[1] if matches else None


def precision(profile: Mapping[str, Any]) -> tuple[str, bool]:
    """(the model's parameter dtype, whether fp32 matmuls ran as TF32) as the profile recorded them; a
    profile from before they were recorded ran at torch's defaults: fp32, TF32 off."""
    device = profile["device"]
    return str(device.get("dtype", "fp32")), bool(device.get("tf32", False))


def catalogue_dtype(device: Any, dtype: str, tf32: bool) -> str:
    """The catalogue peak a step at this precision runs at on `device`: TF32 where fp32 matmuls were let
    run as TF32 and the device has it, else the dtype's own."""
    return "tf32" if dtype == "fp32" and tf32 and "tf32" in device.peak_flops else dtype


def cluster_scale(profile: Mapping[str, Any], device: Any) -> tuple[float, str]:
    """(factor on the profile's times, why) on a catalogue cluster of `device`. Like with like: 1 on the GPU
    the profile was taken on; from another catalogue GPU, the two catalogue peaks at the profile's precision.
    A profile from a CPU (or a GPU the catalogue lacks) is refused, not scaled: a CPU's step of a model is
    mostly per-op overhead, a GPU's launch-bound at these sizes, and its measured 1024^2 matmul over a GPU's
    datasheet peak (the earlier scaling) priced a 10 ms CPU step at a few microseconds, below one kernel
    launch; an H100 profile (fp32, TF32 off, measured) over the A100's TF32 peak came out faster than the H100."""
    name = profile["device"]["name"]
    if same_device(profile, device.key, device.description):
        return 1.0, f"as measured on {name}"
    source = catalogue_device_of(profile)
    if source is None:
        raise ConfigError(f"the profile was measured on {name}, not on a catalogue GPU: its times do not scale to "
                          f"the {device.key}'s (one matmul's rate carries neither a CPU's per-op costs nor a GPU's "
                          "launches); profile the model on a catalogue GPU, or predict this machine's ranks "
                          "(--world-size N)")
    dtype, tf32 = precision(profile)
    source_dtype, target_dtype = catalogue_dtype(source, dtype, tf32), catalogue_dtype(device, dtype, tf32)
    scale = source.peak(source_dtype) / device.peak(target_dtype)
    return scale, (f"scaled from {name} by {scale:.4g}: the {source.key}'s {source_dtype} peak over the "
                   f"{device.key}'s {target_dtype} peak")


def predict_cluster_from_profile(profile: Mapping[str, Any], strategy: Mapping[str, Any], cluster: Any,
                                 global_batch: int | None = None, steps: int | None = None) -> Any:
    """The strategy's cluster estimate (predict/estimators/, the catalogue's collectives) of a workload whose
    per-worker compute is the profile's: as measured on the same device, else scaled (cluster_scale)."""
    from ddlscope.predict import strategies as pst
    from ddlscope.predict.cnn_predict import server_spec
    from ddlscope.predict.estimators import ClusterCase, estimator_for
    from ddlscope.predict.local import strategy_of

    config = run_config(profile, strategy, cluster.n_gpus, global_batch, steps)
    spec = strategy_of(config)
    batch = rank_batch(config)
    device = cluster.device
    peak = device.peak_flops.get("tf32") or device.peak("fp32")  # what pst.compute_s divides fp32 work by
    scale, why = cluster_scale(profile, device)
    kernels = step_at(profile, batch, scale)
    compute_s = kernels["forward_s"] + kernels["backward_s"]
    facts = profile["facts"]
    params = float(sum(facts["param_numel"]))
    flops_per_sample = float(facts["flops"]) / float(profile["batch"])
    activation_bytes = float(sum(profile["layers"].get("activation_bytes", [0]))) * batch / float(profile["batch"])
    kind = optimizer_kind(facts)
    optimizer_bytes = 4.0 * STATE_TENSORS[kind]
    workload = pst.Workload(name=str(profile["workload"].get("name")), params=params,
                            flops_per_sample=flops_per_sample, batch_per_worker=batch,
                            activation_bytes_per_sample=activation_bytes / batch, dtype="fp32",
                            state_bytes_per_param=8.0 + optimizer_bytes,
                            achieved_fraction=batch * flops_per_sample / (peak * compute_s),
                            layers=max(1, len(facts.get("fsdp_units", [])) - 1),
                            backward_fraction=kernels["backward_s"] / compute_s)
    server = pst.ServerSpec()  # the workers step their own optimizers: no server to price
    if not spec.traits.local_optimizer:  # parameter servers: a CPU host of the node, as cnn_predict prices it
        if not cluster.node.host_memory_bytes_per_s:
            raise ConfigError(f"strategy = {spec.name!r}: the catalogue has no host CPU figures for {cluster.name} "
                              "(host_memory_gb_per_s); use a cluster that has them, e.g. paper-fast or paper-slow")
        server = server_spec(cluster, params, kind)
    case = ClusterCase(workload=workload, cluster=cluster, stragglers=1.0, slowdowns=None,
                       server=server, activation_bytes=activation_bytes,
                       weight_bytes_per_param=4.0, optimizer_bytes_per_param=optimizer_bytes)
    estimate = estimator_for(spec).cluster(spec, case)
    estimate.notes.append(f"compute: the profile's step at {batch} samples a worker, {why}")
    if note := batch_note(profile, batch):
        estimate.notes.append(note)
    return estimate
