"""The hardware catalogue: devices, links and named clusters, read from catalogue.toml.

A cluster on the command line reads `NAME:NODESxGPUS_PER_NODE`, e.g.
`a100-80gb:64x8`; `parse_cluster` turns it into a `Cluster` or raises
`ClusterStringError` (a `ConfigError`, hence a `ValueError`) with one line
saying what was wrong and what is allowed.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

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

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency


@dataclass(frozen=True)
class NodeShape:
    gpus: int
    intra: Link
    inter: Link
    nics: int

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


@dataclass(frozen=True)
class Catalogue:
    devices: dict[str, Device]
    links: dict[str, Link]
    clusters: dict[str, dict[str, Any]]  # raw cluster tables; `cluster()` resolves them


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
    return Catalogue(devices, links, clusters)


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
        ),
        framework_overhead_bytes=eff["framework_overhead_gib"] * GIB,
    )


def _link(key: str, d: dict[str, Any]) -> Link:
    return Link(key=key, description=d["description"], bandwidth_bytes_per_s=d["bandwidth_gb_per_s"] * GB,
                alpha_s=d["alpha_us"] * 1e-6, efficiency=d["efficiency"])


_CLUSTER_STRING = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*:\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_cluster(text: str, catalogue: Catalogue | None = None) -> Cluster:
    """`a100-80gb:64x8` -> 64 nodes of 8 A100-80GB. Bad strings raise ClusterStringError."""
    catalogue = catalogue or load_catalogue()
    names = ", ".join(sorted(catalogue.clusters))
    match = _CLUSTER_STRING.match(text or "")
    if not match:
        raise ClusterStringError(f"cluster = {text!r}: expected NAME:NODESxGPUS_PER_NODE, "
                                 f"e.g. a100-80gb:64x8; names: {names}")
    name, nodes, gpus = match.group(1).lower(), int(match.group(2)), int(match.group(3))
    if name not in catalogue.clusters:
        raise ClusterStringError(f"cluster = {text!r}: unknown cluster {name!r}; allowed: {names}")
    if nodes < 1 or gpus < 1:
        raise ClusterStringError(f"cluster = {text!r}: nodes and GPUs per node must be >= 1")
    return make_cluster(name, nodes, gpus, catalogue)


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
                     inter=catalogue.links[shape["inter"]], nics=nics_in_use)
    return Cluster(name=name, device=catalogue.devices[raw["device"]], nodes=nodes, gpus_per_node=gpus_per_node,
                   node=node)


def cluster_names() -> list[str]:
    return sorted(load_catalogue().clusters)
