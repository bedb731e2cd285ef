"""The hardware catalogue: devices, links and named clusters, read from catalogue.toml.

A cluster on the command line reads `NAME:NODESxGPUS_PER_NODE`, e.g.
`a100-80gb:64x8`; `parse_cluster` turns it into a `Cluster` or raises
`ClusterStringError` (a `ConfigError`, hence a `ValueError`) with one line
saying what was wrong and what is allowed.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

from ddlscope.calibrate.model import collective_fit, nearest_world, required
from ddlscope.calibrate.profile import CalibrationProfile
from ddlscope.specs import ConfigError

GIB = 2**30
GB = 1e9


class ClusterStringError(ConfigError):
    """A cluster string that is not NAME:NODESxGPUS_PER_NODE with a known NAME."""


class CatalogueError(ConfigError):
    """The catalogue file itself is inconsistent (a packaging bug, not user input)."""


@dataclass(frozen=True)
class Efficiency:
    """How much of a device's datasheet peak a training job gets; see catalogue.toml."""

    gemm_kernel_fraction: float
    gemm_half_dim: float
    sustained_fraction: float
    flash_attention_fraction: float
    memory_fraction: float
    kernel_overhead_s: float
    # tile/wave quantisation (0 SMs: a calibrated CPU, the smooth half-dimension curve instead)
    sms: int = 0
    l2_bytes_per_s: float = 0.0
    # (low, high) of each measured fraction over its published sources: the prediction's range
    gemm_kernel_fraction_range: tuple[float, float] | None = None
    flash_attention_fraction_range: tuple[float, float] | None = None
    memory_fraction_range: tuple[float, float] | None = None

    def bound(self, side: str) -> "Efficiency":
        """The fractions at the `low` or `high` end of their sources' spread (the others unchanged)."""
        index = {"low": 0, "high": 1}[side]
        changes = {name: getattr(self, f"{name}_range")[index]
                   for name in ("gemm_kernel_fraction", "flash_attention_fraction", "memory_fraction")
                   if getattr(self, f"{name}_range") is not None}
        return replace(self, **changes)

    @property
    def max_sustained_fraction(self) -> float:
        """The most `sustained_fraction` can be: kernel fraction x it may not pass the datasheet peak."""
        return 1.0 / self.gemm_kernel_fraction


@dataclass(frozen=True)
class Device:
    key: str
    description: str
    peak_flops: dict[str, float]  # FLOP/s by dtype, dense
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    power_w: float
    price_usd_per_hour: float  # on-demand, per GPU
    spot_price_usd_per_hour: float
    efficiency: Efficiency
    framework_overhead_bytes: float

    def peak(self, dtype: str) -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ConfigError(f"dtype = {dtype!r}: {self.key} has no peak for it; "
                              f"allowed: {', '.join(sorted(self.peak_flops))}") from None


@dataclass(frozen=True)
class Link:
    key: str
    description: str
    bandwidth_bytes_per_s: float  # per direction, per GPU (intra) or per NIC (inter)
    alpha_s: float  # latency of one collective step
    efficiency: float  # achieved bus bandwidth / peak
    nccl: bool = True  # NCCL's protocols and latencies (collectives.py); False: plain alpha-beta (gloo)

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency


@dataclass(frozen=True)
class NodeShape:
    gpus: int
    intra: Link
    inter: Link
    nics: int
    # the host CPU's memory bandwidth (one socket; 0: not in the catalogue) and the GPU-host link,
    # for a parameter server on the node (catalogue.toml, clusters)
    host_memory_bytes_per_s: float = 0.0
    host_link: Link | None = None

    @property
    def inter_bytes_per_s_per_gpu(self) -> float:
        """Each GPU's share of the node's network when every GPU talks at once."""
        return self.nics * self.inter.achieved_bytes_per_s / self.gpus


@dataclass(frozen=True)
class Cluster:
    """The cluster a prediction is for: a device, how many nodes, how many GPUs in each."""

    name: str
    device: Device
    nodes: int
    gpus_per_node: int
    node: NodeShape
    # The lowest share of a prediction's throughput a published training run reached (catalogue.toml
    # [validation]): the slow end of the "stack range". None where nothing was validated (`local`).
    published_share_low: float | None = None
    # under a named stack's published figure: that stack's runs' [lowest, highest] share of the prediction
    # (Stack.validated_share); set by predictor.with_stack, and then the stack range comes from it alone
    stack_share: tuple[float, float] | None = None

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def intra_bytes_per_s(self) -> float:
        return self.node.intra.achieved_bytes_per_s

    @property
    def inter_bytes_per_s_per_gpu(self) -> float:
        return self.node.inter_bytes_per_s_per_gpu

    def __str__(self) -> str:
        return f"{self.name}:{self.nodes}x{self.gpus_per_node}"

    def with_sustained_fraction(self, value: float) -> "Cluster":
        """The same cluster with another software stack's `sustained_fraction` (see catalogue.toml)."""
        check_sustained_fraction(value, self.device)
        eff = self.device.efficiency
        return replace(self, device=replace(self.device, efficiency=replace(eff, sustained_fraction=value)))

    def at_bound(self, side: str) -> "Cluster":
        """The same cluster with every measured efficiency at the `low` or `high` end of its sources."""
        return replace(self, device=replace(self.device, efficiency=self.device.efficiency.bound(side)))


def check_sustained_fraction(value: float, device: Device) -> None:
    """Positive, and no GEMM above the datasheet peak (kernel fraction x sustained fraction <= 1)."""
    ceiling = device.efficiency.max_sustained_fraction
    if not 0.0 < value <= ceiling:
        raise ConfigError(f"sustained_fraction = {value:g}: must be above 0 and at most {ceiling:.3f} on "
                          f"{device.key} (its GEMM kernel fraction {device.efficiency.gemm_kernel_fraction:g} "
                          "times it may not pass the peak)")


PIPELINE_ENGINES = ("none", "1f1b", "interleaved", "any")


@dataclass(frozen=True)
class Stack:
    """A named software stack (catalogue.toml [stacks]): what it does, as the predictor's switches, and at most
    one efficiency figure, `sustained_fraction`, taken from one named published run of that stack.

    `ideal` (no switches, no figure) is the default: every kernel at its published isolated rate. The
    switches fill what the user's input leaves unset (`defaults`) and bound what the stack can run
    (`refusal`, `allowed`): a stack without tensor parallelism refuses tp > 1, plan searches only its layouts.
    """

    name: str
    description: str
    sustained_fraction: float | None = None  # None: nothing derated (the kernel ceiling)
    figure_run: str = ""  # the one published run the figure comes from
    figure_source: str = ""  # where that run is published
    figure_device: str = ""  # the catalogue device that run used
    # validation, not a model constant: the lowest and highest published / predicted throughput among the
    # stack's published runs at its figure (benchmarks/published_runs.py); a prediction under the stack gives
    # its `stack_range` from them. None: fewer than two runs, nothing validated.
    validated_share: tuple[float, float] | None = None
    overlap_grad_reduce: bool | None = None
    fused_grad_accumulation: bool | None = None
    grad_reduce_bytes: int | None = None  # 4: gradients reduced in fp32 (FSDP2's reduce dtype under torchtitan)
    fused_rope: bool | None = None  # False: rotary embedding in eager PyTorch (torchtitan's complex multiply)
    fused_elementwise: bool | None = None  # False: eager RMSNorm and SwiGLU passes (torchtitan without compile)
    fsdp_version: int | None = None  # 1 / 2: its ZeRO-3 is PyTorch FSDP1 / FSDP2 (their copies priced)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)  # the first is the stack's default
    attention: str | None = None
    tensor_parallel: bool = True
    sequence_parallel: bool = True
    context_parallel: bool = True
    selective_recompute: bool = True
    # none | 1f1b (PipeDream-flush, no interleaving) | interleaved (1F1B and interleaved 1F1B) | any (GPipe too)
    pipeline: str = "any"

    @property
    def has_figure(self) -> bool:
        return self.sustained_fraction is not None

    def parallel_defaults(self) -> dict[str, Any]:
        """ParallelSpec fields the stack sets where the input leaves them unset."""
        out: dict[str, Any] = {"zero": self.zero_stages[0]}
        for name in ("overlap_grad_reduce", "fused_grad_accumulation", "grad_reduce_bytes", "fused_rope",
                     "fused_elementwise", "fsdp_version"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def refusal(self, tp: int, pp: int, cp: int, zero: int, recompute: str, sequence_parallel: bool,
                interleave: int, schedule: str = "1f1b") -> str | None:
        """Why this stack cannot run the layout (one line), None when it can."""
        checks = [
            (tp > 1 and not self.tensor_parallel, f"tp = {tp}", "no tensor parallelism"),
            (cp > 1 and not self.context_parallel, f"cp = {cp}", "no context parallelism"),
            (pp > 1 and self.pipeline == "none", f"pp = {pp}", "no pipeline engine"),
            (interleave > 1 and self.pipeline not in ("interleaved", "any"), f"interleave = {interleave}",
             "a pipeline engine without interleaving"),
            (pp > 1 and schedule == "gpipe" and self.pipeline != "any", "schedule = 'gpipe'",
             "a 1F1B pipeline engine (no GPipe schedule)"),
            (zero not in self.zero_stages, f"zero = {zero}",
             f"ZeRO stages {', '.join(map(str, self.zero_stages))} only"),
            (recompute == "selective" and not self.selective_recompute, "recompute = 'selective'",
             "no selective recomputation"),
            (sequence_parallel and not self.sequence_parallel, "sequence_parallel = true", "no sequence parallelism"),
        ]
        for refused, what, why in checks:
            if refused:
                return f"{what}: the {self.name} stack has {why}"
        return None

    def allowed(self, tp, pp, cp, zero, recompute_code, sequence_parallel, interleave, schedule_code=0):
        """`refusal`'s rule over arrays (plan's search): True where the stack can run the layout."""
        import numpy as np

        ok = np.isin(zero, self.zero_stages)
        ok &= (tp == 1) | self.tensor_parallel
        ok &= (cp == 1) | self.context_parallel
        ok &= (pp == 1) | (self.pipeline != "none")
        ok &= (interleave == 1) | (self.pipeline in ("interleaved", "any"))
        ok &= (pp == 1) | (schedule_code == 0) | (self.pipeline == "any")  # 0: 1F1B (specs.SCHEDULE_CODES)
        ok &= (recompute_code != 1) | self.selective_recompute  # 1: selective (specs.RECOMPUTE_CODES)
        ok &= ~np.asarray(sequence_parallel, dtype=bool) | self.sequence_parallel
        return ok

    def to_dict(self, figure_from: str | None = None, sustained_fraction: float | None = None) -> dict[str, Any]:
        """The stack as `--json` names it; `figure_from` says where the figure in use came from."""
        if figure_from is None:
            figure_from = "published run" if self.has_figure else "none"
        out: dict[str, Any] = {"name": self.name, "description": self.description, "figure_from": figure_from,
                               "sustained_fraction": sustained_fraction if sustained_fraction is not None
                               else self.sustained_fraction}
        if self.has_figure:
            out["published_figure"] = {"sustained_fraction": self.sustained_fraction, "run": self.figure_run,
                                       "source": self.figure_source, "device": self.figure_device}
        return out


DEFAULT_STACK = "ideal"


@dataclass(frozen=True)
class Catalogue:
    devices: dict[str, Device]
    links: dict[str, Link]
    clusters: dict[str, dict[str, Any]]  # raw cluster tables; `cluster()` resolves them
    published_share_low: float | None = None  # [validation]; see Cluster
    stacks: dict[str, Stack] | None = None

    def stack(self, name: str | None, flag: str = "stack") -> Stack:
        """The named stack (None: `ideal`); an unknown name raises ConfigError naming `flag` and the known ones."""
        stacks = self.stacks or {}
        key = DEFAULT_STACK if name is None else name
        if key not in stacks:
            raise ConfigError(f"{flag} = {name!r}: unknown stack; known: {', '.join(stacks)}")
        return stacks[key]


def stack_names() -> list[str]:
    return list(load_catalogue().stacks or {})


def get_stack(name: str | None, flag: str = "stack") -> Stack:
    return load_catalogue().stack(name, flag)


@cache
def load_catalogue() -> Catalogue:
    """The catalogue shipped with the package (read once)."""
    text = resources.files("ddlscope.predict").joinpath("catalogue.toml").read_text(encoding="utf-8")
    return catalogue_from_dict(tomllib.loads(text))


def catalogue_from_dict(raw: dict[str, Any]) -> Catalogue:
    devices = {key: _device(key, d) for key, d in raw.get("devices", {}).items()}
    links = {key: _link(key, d) for key, d in raw.get("links", {}).items()}
    clusters = raw.get("clusters", {})
    for key, c in clusters.items():
        if c.get("device") not in devices:
            raise CatalogueError(f"cluster {key}: unknown device {c.get('device')!r}")
        for shape in c.get("nodes", []):
            for side in ("intra", "inter"):
                if shape.get(side) not in links:
                    raise CatalogueError(f"cluster {key}: unknown {side} link {shape.get(side)!r}")
            if "host_link" in shape and shape["host_link"] not in links:
                raise CatalogueError(f"cluster {key}: unknown host link {shape['host_link']!r}")
    stacks = {key: _stack(key, d, devices) for key, d in raw.get("stacks", {}).items()}
    return Catalogue(devices, links, clusters, _published_share_low(raw.get("validation", {})), stacks)


_STACK_SWITCHES = ("overlap_grad_reduce", "fused_grad_accumulation", "grad_reduce_bytes", "fused_rope",
                   "fused_elementwise", "fsdp_version", "attention",
                   "tensor_parallel", "sequence_parallel", "context_parallel", "selective_recompute", "pipeline")


def _stack(key: str, d: dict[str, Any], devices: dict[str, Device]) -> Stack:
    unknown = set(d) - {"description", "sustained_fraction", "figure_run", "figure_source", "figure_device",
                        "validated_share", "zero_stages", *_STACK_SWITCHES}
    if unknown:
        raise CatalogueError(f"stacks.{key}: unknown keys {sorted(unknown)}")
    figure = d.get("sustained_fraction")
    if figure is not None:
        # one figure, from one named run on one catalogued device
        if not all(d.get(k) for k in ("figure_run", "figure_source", "figure_device")):
            raise CatalogueError(f"stacks.{key}: a sustained_fraction needs figure_run, figure_source, figure_device")
        if d["figure_device"] not in devices:
            raise CatalogueError(f"stacks.{key}: unknown figure_device {d['figure_device']!r}")
        check_sustained_fraction(float(figure), devices[d["figure_device"]])
    if d.get("pipeline", "any") not in PIPELINE_ENGINES:
        raise CatalogueError(f"stacks.{key}: pipeline = {d['pipeline']!r}: allowed: {', '.join(PIPELINE_ENGINES)}")
    if d.get("grad_reduce_bytes", 2) not in (2, 4):
        raise CatalogueError(f"stacks.{key}: grad_reduce_bytes = {d['grad_reduce_bytes']!r}: allowed: 2, 4")
    if d.get("fsdp_version", 0) not in (0, 1, 2):
        raise CatalogueError(f"stacks.{key}: fsdp_version = {d['fsdp_version']!r}: allowed: 0, 1, 2")
    if d.get("attention") not in (None, "flash", "unfused"):
        raise CatalogueError(f"stacks.{key}: attention = {d['attention']!r}: allowed: flash, unfused")
    share = d.get("validated_share")
    if share is not None and (figure is None or len(share) != 2 or not 0 < share[0] <= share[1]):
        raise CatalogueError(f"stacks.{key}: validated_share = {share!r}: [low, high] of a stack with a figure")
    stages = tuple(int(z) for z in d.get("zero_stages", (0, 1, 2, 3)))
    if not stages or not set(stages) <= {0, 1, 2, 3}:
        raise CatalogueError(f"stacks.{key}: zero_stages = {list(stages)}: a non-empty list of 0-3")
    return Stack(name=key, description=d["description"],
                 sustained_fraction=None if figure is None else float(figure),
                 figure_run=d.get("figure_run", ""), figure_source=d.get("figure_source", ""),
                 figure_device=d.get("figure_device", ""), zero_stages=stages,
                 validated_share=None if share is None else (float(share[0]), float(share[1])),
                 **{k: d[k] for k in _STACK_SWITCHES if k in d})


def _published_share_low(validation: dict[str, Any]) -> float | None:
    share = validation.get("published_share_low")
    if share is None:
        return None
    if not 0.0 < float(share) <= 1.0:
        raise CatalogueError(f"validation.published_share_low = {share}: must be in (0, 1]")
    return float(share)


def _device(key: str, d: dict[str, Any]) -> Device:
    eff = d["efficiency"]
    return Device(
        key=key,
        description=d["description"],
        peak_flops={dtype: tflops * 1e12 for dtype, tflops in d["peak_tflops"].items()},
        memory_bytes=d["memory_gib"] * GIB,
        memory_bandwidth_bytes_per_s=d["memory_bandwidth_tb_per_s"] * 1e12,
        power_w=float(d["power_w"]),
        price_usd_per_hour=float(d["price_usd_per_hour"]),
        spot_price_usd_per_hour=float(d["spot_price_usd_per_hour"]),
        efficiency=Efficiency(
            gemm_kernel_fraction=eff["gemm_kernel_fraction"],
            gemm_half_dim=eff["gemm_half_dim"],
            sustained_fraction=eff["sustained_fraction"],
            flash_attention_fraction=eff["flash_attention_fraction"],
            memory_fraction=eff["memory_fraction"],
            kernel_overhead_s=eff["kernel_overhead_us"] * 1e-6,
            sms=int(eff.get("sms", 0)),
            l2_bytes_per_s=float(eff.get("l2_tb_per_s", 0.0)) * 1e12,
            gemm_kernel_fraction_range=_range(eff, "gemm_kernel_fraction"),
            flash_attention_fraction_range=_range(eff, "flash_attention_fraction"),
            memory_fraction_range=_range(eff, "memory_fraction"),
        ),
        framework_overhead_bytes=eff["framework_overhead_gib"] * GIB,
    )


def _range(eff: dict[str, Any], name: str) -> tuple[float, float] | None:
    """`NAME_range = [low, high]` from the catalogue, checked to hold the central value."""
    raw = eff.get(f"{name}_range")
    if raw is None:
        return None
    low, high = (float(x) for x in raw)
    if not low <= eff[name] <= high:
        raise CatalogueError(f"{name}_range = {raw}: must hold {name} = {eff[name]}")
    return low, high


def _link(key: str, d: dict[str, Any]) -> Link:
    return Link(key=key, description=d["description"], bandwidth_bytes_per_s=d["bandwidth_gb_per_s"] * GB,
                alpha_s=d["alpha_us"] * 1e-6, efficiency=d["efficiency"])


MAX_NODES = 2**17  # past this a cluster string is a typo (and plan's search over node counts would not end)
_CLUSTER_STRING = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*:\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_cluster(text: str, catalogue: Catalogue | None = None,
                  local_profile: CalibrationProfile | dict[str, Any] | None = None) -> Cluster:
    """`a100-80gb:64x8` -> 64 nodes of 8 A100-80GB; `local:1x2` -> two ranks of this machine as
    `local_profile` (a `ddlscope calibrate` profile) describes it. Bad strings raise ClusterStringError."""
    catalogue = catalogue or load_catalogue()
    names = ", ".join(sorted(catalogue.clusters))
    match = _CLUSTER_STRING.match(text or "")
    if not match:
        raise ClusterStringError(f"cluster = {text!r}: expected NAME:NODESxGPUS_PER_NODE, "
                                 f"e.g. a100-80gb:64x8; names: {names}")
    name, nodes, gpus = match.group(1).lower(), int(match.group(2)), int(match.group(3))
    if nodes < 1 or gpus < 1:
        raise ClusterStringError(f"cluster = {text!r}: nodes and GPUs per node must be >= 1")
    if nodes > MAX_NODES:
        raise ClusterStringError(f"cluster = {text!r}: at most {MAX_NODES:,} nodes")
    if name == LOCAL:
        if local_profile is None:
            raise ClusterStringError(f"cluster = {text!r}: {LOCAL} needs this machine's calibration "
                                     "(run `ddlscope calibrate`)")
        return local_cluster(local_profile, nodes, gpus)
    if name not in catalogue.clusters:
        raise ClusterStringError(f"cluster = {text!r}: unknown cluster {name!r}; allowed: {names}, {LOCAL}")
    return make_cluster(name, nodes, gpus, catalogue)


def cluster_name(text: str) -> str | None:
    """The NAME of a NAME:NODESxGPUS string (lower case), None when it is not one."""
    match = _CLUSTER_STRING.match(text or "")
    return match.group(1).lower() if match else None


def make_cluster(name: str, nodes: int, gpus_per_node: int, catalogue: Catalogue | None = None) -> Cluster:
    catalogue = catalogue or load_catalogue()
    raw = catalogue.clusters[name]
    shapes = sorted(raw["nodes"], key=lambda s: s["gpus"])
    fitting = [s for s in shapes if s["gpus"] >= gpus_per_node]
    if not fitting:
        largest = shapes[-1]["gpus"]
        raise ClusterStringError(f"cluster = '{name}:{nodes}x{gpus_per_node}': a {name} node holds at most "
                                 f"{largest} GPUs")
    shape = fitting[0]
    # Using fewer GPUs than the node holds keeps their share of the NICs, not all of them.
    nics_in_use = max(1, round(shape["nics"] * gpus_per_node / shape["gpus"]))
    node = NodeShape(gpus=gpus_per_node, intra=catalogue.links[shape["intra"]],
                     inter=catalogue.links[shape["inter"]], nics=nics_in_use,
                     host_memory_bytes_per_s=float(shape.get("host_memory_gb_per_s", 0.0)) * GB,
                     host_link=catalogue.links[shape["host_link"]] if "host_link" in shape else None)
    return Cluster(name=name, device=catalogue.devices[raw["device"]], nodes=nodes, gpus_per_node=gpus_per_node,
                   node=node, published_share_low=catalogue.published_share_low)


def cluster_names() -> list[str]:
    return sorted(load_catalogue().clusters)


LOCAL = "local"
# What a rank's process holds before the model: torch, gloo, Python (~0.4 GB peak RSS of small runs here).
LOCAL_FRAMEWORK_OVERHEAD_BYTES = 0.4 * GIB


def local_cluster(profile: CalibrationProfile | dict[str, Any], nodes: int, ranks: int) -> Cluster:
    """`local:1xN`: N ranks of this machine, from a `ddlscope calibrate` profile.

    Peaks are the measured matmul FLOP/s (fp32, and bf16 where measured), so
    the kernel and sustained fractions are 1; the efficiency curve's half
    dimension is fitted to the measured square matmuls (rate / peak =
    sat(n)^2); FlashAttention runs at the measured rate of a 128 matmul; the
    memory bandwidth is the measured copy rate; the per-kernel gap is the
    measured per-op overhead; the ranks share the machine's memory. The link
    is gloo on loopback: the calibrated all-reduce at the nearest world size,
    time = alpha + bytes / beta, mapped onto the ring model (2(n-1) steps of
    latency, 2(n-1)/n of the bytes). Power and prices are unknown (0).
    """
    if nodes != 1:
        raise ClusterStringError(f"cluster = '{LOCAL}:{nodes}x{ranks}': {LOCAL} is this machine: use {LOCAL}:1xN")
    profile = CalibrationProfile.coerce(profile)
    compute, meta = profile.compute, profile.meta
    fp32 = float(required(compute.peak_flops, "peak_flops"))
    matmul = required(compute.matmul, "matmul")
    sizes, rates = required(matmul.sizes, "matmul sizes"), required(matmul.flops, "matmul flops")
    memory = float(required(meta.memory_bytes if meta else None, "memory_bytes"))
    peaks = {"fp32": fp32}
    if compute.bf16 and compute.bf16.flops is not None:
        peaks["bf16"] = float(compute.bf16.flops)
    half_dims = [n * (1 - (r / fp32) ** 0.5) / (r / fp32) ** 0.5 for n, r in zip(sizes, rates) if 0 < r < fp32]
    half_dim = sorted(half_dims)[len(half_dims) // 2] if half_dims else 1.0
    rate_128 = min(zip(sizes, rates), key=lambda size_rate: abs(size_rate[0] - 128))[1]
    device = Device(key=LOCAL, description=f"this machine ({meta.host or '?'}, {meta.cores or '?'} cores)",
                    peak_flops=peaks, memory_bytes=memory / ranks,
                    memory_bandwidth_bytes_per_s=float(required(compute.memory_bandwidth_bytes_per_s,
                                                                "memory_bandwidth_bytes_per_s")),
                    power_w=0.0, price_usd_per_hour=0.0, spot_price_usd_per_hour=0.0,
                    efficiency=Efficiency(gemm_kernel_fraction=1.0, gemm_half_dim=half_dim, sustained_fraction=1.0,
                                          flash_attention_fraction=min(rate_128 / fp32, 1.0), memory_fraction=1.0,
                                          kernel_overhead_s=float(required(compute.op_overhead_s, "op_overhead_s"))),
                    framework_overhead_bytes=LOCAL_FRAMEWORK_OVERHEAD_BYTES)
    link = _loopback_link(profile, ranks)
    return Cluster(name=LOCAL, device=device, nodes=1, gpus_per_node=ranks,
                   node=NodeShape(gpus=ranks, intra=link, inter=link, nics=1))


def _loopback_link(profile: CalibrationProfile, ranks: int) -> Link:
    if not profile.collectives:
        raise ConfigError("the calibration has no collective measurements: rerun `ddlscope calibrate`")
    key = nearest_world(profile.collectives, ranks)
    world, fit = int(key.removeprefix("ws")), collective_fit(profile, "all_reduce", ranks)
    steps = 2 * (world - 1)
    return Link(key="gloo-loopback", description=f"gloo on loopback (calibrated at {world} ranks)",
                bandwidth_bytes_per_s=float(required(fit.beta_bytes_per_s, "beta_bytes_per_s")) * steps / world,
                alpha_s=float(required(fit.alpha_s, "alpha_s")) / steps, efficiency=1.0, nccl=False)
