"""The calibration profile: its typed layout, and the TOML file `ddlscope calibrate` writes.

`CalibrationProfile` declares every table and field calibrate writes (units in
the names: `_s`, `_bytes`, `_per_s`). Each table keeps the keys it does not
declare, every field is optional but `compute` and `collectives`, and numbers
stay the int or float they were written as, so any profile an older ddlscope
wrote still loads, and `as_dict()` gives back exactly the dict that was read.
The local machine model (calibrate/model.py), the local predictor and
`local:1xN` clusters read the typed profile; a figure they need and an older
profile lacks is one line naming it. Per-world-size tables are keyed `ws<N>`
(N ranks).

The file is TOML, written by the small writer below (nested tables of numbers,
strings, bools and lists) and read with tomllib.
"""

from __future__ import annotations

import json
import socket
import tomllib
from pathlib import Path
from typing import Annotated, Any, Mapping, Union

from pydantic import BaseModel, ConfigDict, PlainValidator, StringConstraints, ValidationError

from ddlscope.specs import ConfigError
from ddlscope.store import Store, atomic_output

DEFAULT_PROFILE = Path("ddlscope-calibration.toml")
HEADER = "# ddlscope hardware profile (ddlscope calibrate)\n"


def _number(value: Any) -> int | float:
    """An int or a float, left as it is (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    return value


Number = Annotated[Union[int, float], PlainValidator(_number)]
Numbers = list[Number]
WorldSize = Annotated[str, StringConstraints(pattern=r"^ws\d+$")]  # "ws4": measured with 4 ranks


class _Table(BaseModel):
    """A TOML table: typed fields, and the keys it does not declare kept as they are."""

    model_config = ConfigDict(extra="allow", strict=True)


class Meta(_Table):
    created_at: Number | None = None  # Unix time
    host: str | None = None
    cores: int | None = None
    torch: str | None = None
    quick: bool | None = None
    backend: str | None = None
    memory_bytes: int | None = None
    load_average_1min: Number | None = None  # other work on the machine skews every figure


class MatmulFit(_Table):
    """Square fp32 matmuls, and the fit time = overhead_s + 2 n^3 / peak_flops."""

    sizes: Numbers | None = None
    seconds: Numbers | None = None
    flops: Numbers | None = None  # achieved FLOP/s per size
    overhead_s: Number | None = None
    peak_flops: Number | None = None
    r2: Number | None = None


class ConvCurve(_Table):
    """3x3 fp32 convolutions (C -> C channels, 16 images of 16x16), forward + both gradients, by C."""

    channels: Numbers | None = None  # ascending
    flops: Numbers | None = None  # achieved FLOP/s per channel count


class Bf16Matmul(_Table):
    size: int | None = None
    flops: Number | None = None


class MemoryCurve(_Table):
    bytes_moved: Numbers | None = None  # read + written per copy
    bytes_per_s: Numbers | None = None


class Compute(_Table):
    threads: int | None = None
    matmul: MatmulFit | None = None
    conv: ConvCurve | None = None  # absent in calibrations before it: convolutions then run at the matmul rates
    peak_flops: Number | None = None  # the best achieved matmul FLOP/s
    bf16: Bf16Matmul | None = None  # empty where the CPU has no bf16 matmul
    op_overhead_s: Number | None = None
    optimizer_tensor_s: Number | None = None
    memory_bandwidth_bytes_per_s: Number | None = None  # the largest copy's rate
    memory_curve: MemoryCurve | None = None


class AlphaBetaFit(_Table):
    """time = alpha_s + bytes / beta_bytes_per_s (fit.fit_alpha_beta)."""

    alpha_s: Number | None = None
    beta_bytes_per_s: Number | None = None
    r2: Number | None = None  # of the bandwidth fit
    r2_all: Number | None = None  # over every size
    alpha_fit_s: Number | None = None  # the least-squares intercept
    seconds: Numbers | None = None


class CollectiveFit(AlphaBetaFit):
    """The median repeat's fit (what a step typically pays), and the fastest repeat's."""

    sizes: Numbers | None = None  # payload bytes per message
    fastest: AlphaBetaFit | None = None


class SyncProbe(_Table):
    """One value per block length (probes.SYNC_PROBE_BLOCKS_S)."""

    block_alone_s: Numbers | None = None
    block_together_s: Numbers | None = None
    wait_s: Numbers | None = None
    latency_s: Numbers | None = None
    compute_stretch: Numbers | None = None
    sync_overhead_s: Numbers | None = None


class DdpProbe(_Table):
    model_bytes: Numbers | None = None
    overhead_s: Numbers | None = None


class FsdpProbe(_Table):
    unit_bytes: Numbers | None = None
    unit_overhead_s: Numbers | None = None
    optimizer_tensor_s: Number | None = None  # plain SGD's step per DTensor-sharded parameter tensor
    unit_tensor_s: Number | None = None  # forward + backward per parameter tensor of a unit beyond a Linear's 2


class TpProbe(_Table):
    """What torch's tensor parallel (DTensor) adds to a GPT block on this machine (probes._tp_probe): absent in
    calibrations before it (the predictor then prices the Megatron layout's all-reduces only, and says so)."""

    dispatch_op_s: Number | None = None  # an op on a DTensor shard minus the same op on its local tensor
    # the same at the probe's two block sizes, and their activations' elements (batch x seq x hidden): the cost
    # grows with the tensors (absent before: dispatch_op_s at every size)
    dispatch_op_s_by_size: Numbers | None = None
    activation_elements: Numbers | None = None
    block_dispatch_ops: int | None = None  # aten ops with a DTensor argument in one sharded block's fwd + bwd
    block_all_reduces: int | None = None  # all-reduces in that trace (Megatron: 2 forward, 2 backward)
    all_reduce_activation_ratio: Number | None = None  # elements per all-reduce / (batch x seq x hidden)


class PipelineProbe(_Table):
    """What torch's pipelining runtime costs per schedule action on this machine (probes._pipeline_probe): absent
    in calibrations before it (the predictor then prices the actions' compute and the transfers only)."""

    action_s: Number | None = None  # a GPipe step of a negligible stage per rank over its 2 (m + p - 1) actions
    # zero-bubble's input- then weight-gradient passes (torch's stage_backward_input, stage_backward_weight) over
    # one full stage backward, per op of the stage's forward + backward as the workload's facts count them
    split_backward_op_s: Number | None = None


class ServerProbe(_Table):
    """A parameter server's transport round (probes._incast_probe)."""

    workers: int | None = None
    bytes: Numbers | None = None
    round_s: Numbers | None = None  # back to back
    block_alone_s: Numbers | None = None
    busy_round_s: list[Numbers] | None = None  # one list per block length
    busy_block_s: Numbers | None = None


class CalibrationProfile(_Table):
    meta: Meta | None = None
    compute: Compute
    collectives: dict[WorldSize, dict[str, CollectiveFit]]  # ws<N> -> collective -> fit
    sync: dict[WorldSize, SyncProbe] | None = None
    ddp: dict[WorldSize, DdpProbe] | None = None
    fsdp: dict[WorldSize, FsdpProbe] | None = None
    ps: dict[WorldSize, ServerProbe] | None = None
    tp: dict[WorldSize, TpProbe] | None = None
    pipeline: dict[WorldSize, PipelineProbe] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The profile as the plain dict it was made from (what the local predictor reads): the same
        keys and values; declared keys come in the declared order (calibrate's), then the others."""
        return self.model_dump(exclude_unset=True)

    @classmethod
    def coerce(cls, profile: "CalibrationProfile | Mapping[str, Any]", source: str = "the calibration"
               ) -> "CalibrationProfile":
        """A typed profile from a typed one or from its dict (a test's, the store's); an ill-typed
        one is a one-line ConfigError."""
        if isinstance(profile, CalibrationProfile):
            return profile
        try:
            return cls.model_validate(dict(profile))
        except ValidationError as exc:
            raise ConfigError(f"{source}: {_first_error(exc)}") from None

    def write(self, path: Path) -> None:
        write_profile(self.as_dict(), path)

    @classmethod
    def load(cls, path: Path) -> "CalibrationProfile":
        """Read and check a profile file; a missing, unreadable or ill-typed one is a one-line ConfigError."""

        if not path.is_file():
            raise ConfigError(f"calibration file {path} does not exist (run `ddlscope calibrate` first)")
        try:
            raw = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # garbage bytes are not UTF-8 text
            raise ConfigError(f"calibration file {path} is not valid TOML: {' '.join(str(exc).split())}") from None
        except OSError as exc:
            raise ConfigError(f"calibration file {path} cannot be read: {exc.strerror or exc}") from None
        if "compute" not in raw or "collectives" not in raw:
            raise ConfigError(f"calibration file {path} has no [compute] / [collectives] tables")
        return cls.coerce(raw, f"calibration file {path}")


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    return f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"


def write_profile(profile: Mapping[str, Any] | CalibrationProfile, path: Path) -> None:
    data = profile.as_dict() if isinstance(profile, CalibrationProfile) else dict(profile)
    with atomic_output(path, what="calibration profile") as f:
        f.write(HEADER + to_toml(data))


def load_profile(path: Path) -> dict[str, Any]:
    """The profile at `path`, checked, as the dict the local predictor reads."""
    return CalibrationProfile.load(path).as_dict()


# --------------------------------------------------------------------------- a small TOML writer
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """A small TOML writer for nested dicts of numbers, strings, bools and lists."""
    lines, tables = [], []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    out = ""
    if prefix and lines:
        out += f"[{prefix}]\n"
    out += "\n".join(lines) + ("\n" if lines else "")
    for k, v in tables:
        sub = to_toml(v, f"{prefix}.{k}" if prefix else k)
        out += ("\n" if out else "") + sub
    return out


# ---------------------------------------------------------------------------- which profile
def resolve_calibration(store: Store, calibration: Path | None, host: str) -> tuple[CalibrationProfile, str]:
    """The profile to predict with, and where it came from: --calibration FILE; else the newest
    calibration in the store taken on the run's host; else ./ddlscope-calibration.toml."""
    if calibration is not None:
        return CalibrationProfile.load(calibration), str(calibration)
    stored = store.latest_calibration(host)
    if stored is not None:
        source = f"calibration {stored[0]} in {store.path}"
        return CalibrationProfile.coerce(stored[1], source), source
    if DEFAULT_PROFILE.is_file():
        return CalibrationProfile.load(DEFAULT_PROFILE), str(DEFAULT_PROFILE)
    raise ConfigError(f"no calibration of host {host!r} in {store.path} and no {DEFAULT_PROFILE}: "
                      "run `ddlscope calibrate` first (or pass --calibration FILE)")


def this_machine_profile(calibration: Path | None, db: Path) -> CalibrationProfile:
    """The profile that `local:1xN` clusters describe: --calibration FILE, else the newest
    calibration of this host in the store at `db` (when it exists), else ./ddlscope-calibration.toml."""
    if calibration is None and db.is_file():
        with Store(db) as store:
            return resolve_calibration(store, None, socket.gethostname())[0]
    return CalibrationProfile.load(calibration or DEFAULT_PROFILE)
