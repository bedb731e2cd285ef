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
localsgd), the whole batch where it does not (pipeline); its compute is interpolated between the
batches the profile measured the whole step at (piecewise linear, calibrate/model.py's
interpolation), not taken in proportion: a small batch's CPU step is mostly per-op overhead.

The device: on the device the profile was measured on (the same host's CPU, or a GPU of the
catalogue device the profile names) the figures are used as measured; on another device they are
scaled by the ratio of the two devices' kernel rates: the profile's measured fp32 matmul FLOP/s over
the target's (the calibration's measured peak for this machine, the catalogue's dense peak at the
dtype the cluster model computes at for a GPU).
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
               global_batch: int | None = None) -> dict[str, Any]:
    """The experiment config the local predictor reads: the profile's workload, the strategy, the ranks."""
    workload = dict(profile["workload"])
    if global_batch is not None:
        workload["batch_size"] = global_batch
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
    """The profile's whole step at `batch` samples (interpolated between the measured batches), each time
    times `scale` (the device ratio): the facts' `kernels` as predict/local.py reads them."""
    by_batch = profile["step_by_batch"]
    batches = [float(b) for b in by_batch["batch"]]
    kernels: dict[str, Any] = {key: interpolate_linear(batches, [float(v) for v in by_batch[key]], batch) * scale
                               for key in TIMES}
    kernels["steps"] = int(profile["step"].get("steps", 0))
    kernels["from_profile"] = True
    return kernels


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
    """(factor on the profile's times, why) for this machine as `calibration` describes it: 1 on the host
    the profile was taken on (its CPU), else the profile device's matmul rate over this machine's."""
    meta, calibration_meta = profile["meta"], calibration.meta
    if meta.get("device_type") == "cpu" and calibration_meta is not None and meta.get("host") == calibration_meta.host:
        return 1.0, f"as measured on {profile['device']['name']}"
    target = float(required(calibration.compute.peak_flops, "peak_flops"))
    return rate_ratio(profile, target), (f"scaled from {profile['device']['name']} by its matmul rate over this "
                                         f"machine's ({profile['device']['matmul_flops'] / 1e9:.1f} / "
                                         f"{target / 1e9:.1f} GFLOP/s)")


def rate_ratio(profile: Mapping[str, Any], target_flops: float) -> float:
    """How much longer a kernel takes on the target than on the profile's device: their rates' ratio."""
    if target_flops <= 0:
        raise ConfigError(f"target device rate {target_flops} FLOP/s: must be > 0")
    return float(profile["device"]["matmul_flops"]) / target_flops


def predict_local_from_profile(profile: Mapping[str, Any], strategy: Mapping[str, Any], world: int,
                               calibration: CalibrationProfile | Mapping[str, Any],
                               environment: Mapping[str, Any] | None = None,
                               global_batch: int | None = None) -> dict[str, Any]:
    """predict/local.py's step of `world` ranks of this machine, its compute the profile's."""
    from ddlscope.predict.local import predict_local

    calibration = CalibrationProfile.coerce(calibration)
    config = run_config(profile, strategy, world, global_batch)
    scale, why = local_scale(profile, calibration)
    batch = rank_batch(config)
    predicted = predict_local(config, dict(environment or {}), facts_from_profile(profile, batch, scale), calibration)
    predicted["notes"] = [note for note in predicted["notes"] if not note.startswith("compute alone:")]
    predicted["notes"].append(f"compute alone: the profile's whole step at {batch} samples a rank, {why}")
    predicted["profile"] = {"device": profile["device"]["name"], "scale": scale, "rank_batch": batch,
                            "split": profile.get("split")}
    return predicted


def same_device(profile: Mapping[str, Any], device_key: str, description: str) -> bool:
    """Whether the profile was measured on the catalogue device (its name holds the key's model, e.g. h100)."""
    name = str(profile["device"]["name"]).lower()
    model = device_key.lower().split("-")[0]
    return str(profile["meta"].get("device_type")) == "cuda" and (model in name or description.lower() in name)


def predict_cluster_from_profile(profile: Mapping[str, Any], strategy: Mapping[str, Any], cluster: Any,
                                 global_batch: int | None = None) -> Any:
    """The strategy's cluster estimate (predict/estimators/, the catalogue's collectives) of a workload whose
    per-worker compute is the profile's: as measured on the same device, else scaled by the rate ratio."""
    from ddlscope.predict import strategies as pst
    from ddlscope.predict.cnn_predict import server_spec
    from ddlscope.predict.estimators import ClusterCase, estimator_for
    from ddlscope.predict.local import strategy_of

    config = run_config(profile, strategy, cluster.n_gpus, global_batch)
    spec = strategy_of(config)
    batch = rank_batch(config)
    device = cluster.device
    peak = device.peak_flops.get("tf32") or device.peak("fp32")  # what pst.compute_s divides fp32 work by
    scale = 1.0 if same_device(profile, device.key, device.description) else rate_ratio(profile, peak)
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
    estimate.notes.append(f"compute: the profile's step at {batch} samples a worker, " + (
        f"as measured on {profile['device']['name']}" if scale == 1.0 else
        f"scaled from {profile['device']['name']} by {scale:.4g} (its matmul rate over the {device.key}'s peak)"))
    return estimate
