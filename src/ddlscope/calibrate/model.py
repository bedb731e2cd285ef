"""The local machine model: this machine as `ddlscope calibrate` measured it, for every local estimate.

Torch-free. A calibration profile (as calibrate/profile.py reads it) gives
gloo's message times by size and world size, the compute rates, and the
probes of whole DDP/FSDP steps, of the synchronisation between ranks and of
a parameter server's rounds; these functions read them. The per-strategy
use of them is in predict/estimators/, the step assembly in predict/local.py,
and `local:1xN` clusters in predict/catalogue.py (local_cluster).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ddlscope.calibrate.profile import CalibrationProfile, CollectiveFit, Compute, ServerProbe, SyncProbe
from ddlscope.specs import ConfigError
from ddlscope.specs.wire import wire_bytes

OPS_PER_PARAM_OPTIMIZER = {"sgd": 2, "sgd-momentum": 4, "adamw": 12}
STATE_TENSORS = {"sgd": 0, "sgd-momentum": 1, "adamw": 2}


def optimizer_kind(facts: dict[str, Any]) -> str:
    if facts.get("optimizer") == "adamw":
        return "adamw"
    return "sgd-momentum" if facts.get("momentum", 0.0) > 0 else "sgd"


def required(value: float | list[Any] | None, what: str) -> Any:
    """A figure the model cannot do without; an older or partial calibration says so in one line."""
    if value is None:
        raise ConfigError(f"the calibration has no {what}: rerun `ddlscope calibrate`")
    return value


def nearest_world(tables: dict[str, Any], ranks: int) -> str:
    """The key ("wsN") of the calibrated world size nearest `ranks` (the larger on a tie)."""
    sizes = sorted(int(k.removeprefix("ws")) for k in tables)
    return f"ws{min(sizes, key=lambda s: (abs(s - ranks), -s))}"


def collective_fit(profile: CalibrationProfile, kind: str, ranks: int) -> CollectiveFit:
    """The calibrated entry for `kind` at `ranks` members: that world size or the nearest calibrated."""
    tables = profile.collectives
    if not tables:
        raise ConfigError("the calibration has no collective measurements")
    if kind == "p2p" and "ws2" in tables:
        ranks = 2
    key = nearest_world(tables, ranks)
    return required(tables[key].get(kind), f"{kind} measurement at {key}")


def measured_message_s(fit: CollectiveFit, payload_bytes: float) -> float:
    """Typical gloo time of one message: log-log interpolation in the calibrated table, the
    alpha-beta fit's slope beyond its largest size, the fit alone when there is no table."""
    alpha, beta = float(required(fit.alpha_s, "alpha_s")), float(required(fit.beta_bytes_per_s, "beta_bytes_per_s"))
    sizes, seconds = fit.sizes, fit.seconds
    if not sizes or not seconds or len(sizes) != len(seconds):
        return alpha + payload_bytes / beta
    # A larger message is never faster: a median above a larger size's is interference, so take
    # the lower envelope (each size's time is at most that of any larger size).
    seconds = list(seconds)
    for i in range(len(seconds) - 2, -1, -1):
        seconds[i] = min(seconds[i], seconds[i + 1])
    if payload_bytes <= sizes[0]:
        return float(seconds[0])
    if payload_bytes >= sizes[-1]:
        return float(seconds[-1]) + (payload_bytes - sizes[-1]) / beta
    return float(np.exp(np.interp(np.log(payload_bytes), np.log(sizes), np.log(seconds))))


def emulated_s(link: tuple[float, float], kind: str, payload_bytes: float, ranks: int) -> float:
    """What the emulated link makes one message wait: its alpha + wire bytes / bandwidth (LinkModel)."""
    return link[0] + wire_bytes(kind, payload_bytes, ranks) / link[1]


def message_s(profile: CalibrationProfile, kind: str, payload_bytes: float, ranks: int,
              link: tuple[float, float] | None) -> float:
    """One message's time: calibrated gloo time, or the emulated link's if that is longer."""
    measured = measured_message_s(collective_fit(profile, kind, ranks), payload_bytes)
    return measured if link is None else max(measured, emulated_s(link, kind, payload_bytes, ranks))


def machine_probe(profile: CalibrationProfile, section: str, ranks: int) -> Any:
    """A calibrated probe (sync, ddp, fsdp, ps) at `ranks` (the nearest world size), None for a profile
    without it (an older calibration)."""
    tables = getattr(profile, section) or {}
    return tables[nearest_world(tables, ranks)] if tables else None


def between_blocks(blocks: list[float], values: list[float], alone_s: float) -> float:
    """A probe's value for a step of `alone_s` compute: linear between its block lengths, held at
    the nearer end outside them."""
    return interpolate_linear(list(blocks), list(values), min(max(alone_s, blocks[0]), blocks[-1]))


def sync_at(sync: SyncProbe | None, alone_s: float) -> tuple[float, float]:
    """(compute_stretch, sync_overhead_s) for a step of `alone_s` compute: linear between the probe's
    two block lengths, held at the nearer one outside them; (1, 0) without a probe."""
    if sync is None:
        return 1.0, 0.0
    blocks = required(sync.block_alone_s, "sync block_alone_s")
    return (between_blocks(blocks, required(sync.compute_stretch, "sync compute_stretch"), alone_s),
            between_blocks(blocks, required(sync.sync_overhead_s, "sync sync_overhead_s"), alone_s))


def matmul_flops_at(compute: Compute, size: float) -> float:
    """Calibrated fp32 FLOP/s of a matmul of effective square size `size` (log-linear between sizes)."""
    matmul = required(compute.matmul, "matmul")
    return rate_at(required(matmul.sizes, "matmul sizes"), required(matmul.flops, "matmul flops"), size)


def conv_flops_at(compute: Compute, channels: float, size: float) -> float:
    """Calibrated FLOP/s of a convolution GEMM with `channels` output channels per group; the matmul
    rate at its effective `size` where the calibration predates the convolution probe."""
    conv = compute.conv
    if conv is None or not conv.channels or not conv.flops:
        return matmul_flops_at(compute, size)
    return rate_at(conv.channels, conv.flops, channels)


def rate_at(sizes: list[float], rates: list[float], size: float) -> float:
    """A probe's rate at `size`: log-linear between measured sizes, proportional to size below the
    smallest (per-call overhead dominates there), the largest size's rate above."""
    if size <= sizes[0]:  # below the smallest size measured: per-call overhead dominates, rate ~ size
        return float(rates[0]) * max(size / sizes[0], 0.05)
    if size >= sizes[-1]:
        return float(rates[-1])
    for (s0, r0), (s1, r1) in zip(zip(sizes, rates), zip(sizes[1:], rates[1:])):
        if s0 <= size <= s1:
            w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return float(r0 + w * (r1 - r0))
    return float(rates[-1])


def gemm_time_s(facts: dict[str, Any], compute: Compute) -> float:
    """FLOPs / calibrated FLOP/s: each matmul at the rate of its size, each convolution's implicit GEMMs at
    the convolution rate of theirs, the rest at the matmul peak."""
    gemm_flops, gemm_size = facts.get("gemm_flops", []), facts.get("gemm_size", [])
    matmul = required(compute.matmul, "matmul")
    peak = float(required(matmul.peak_flops, "matmul peak_flops"))
    if matmul.sizes is None or not gemm_flops:
        return facts["flops"] / peak
    t = sum(f / matmul_flops_at(compute, n) for f, n in zip(gemm_flops, gemm_size))
    conv_flops = facts.get("conv_flops", [])
    t += sum(f / conv_flops_at(compute, c, n)
             for f, c, n in zip(conv_flops, facts.get("conv_channels", []), facts.get("conv_size", [])))
    return t + max(0.0, facts["flops"] - sum(gemm_flops) - sum(conv_flops)) / peak


def emulated_link(environment: dict[str, Any]) -> tuple[float, float] | None:
    network = environment.get("network", {})
    if not network.get("emulated"):
        return None
    bandwidth = network.get("software_bandwidth_bytes_per_s", network.get("bandwidth_bytes_per_s"))
    if network.get("mode") == "shaped":
        bandwidth = network.get("shaped_bandwidth_bytes_per_s") or bandwidth
    return float(network["alpha_s"]), float(bandwidth or math.inf)


def shard_bytes(facts: dict[str, Any], world: int) -> int:
    total = 0
    for numel, dim0 in zip(facts["param_numel"], facts["param_dim0"]):
        per_row = numel // max(dim0, 1)
        total += math.ceil(dim0 / world) * per_row * 4
    return total


def ps_round_s(profile: CalibrationProfile, workers: float, payload_bytes: float,
               link: tuple[float, float] | None, compute_s: float | None = None,
               cpu_slowdown: float = 1.0) -> float:
    """One server's round: every worker pushes a header and `payload_bytes`, the server answers each.

    From the calibrated transport probe: with the workers computing `compute_s` between rounds where
    the probe measured that (linear in the compute between no compute and its two block lengths),
    back to back otherwise; linear in the workers between the world sizes measured, in the bytes
    between its sizes. Without a probe, from the two-rank p2p table, the server taking the messages
    one at a time. `cpu_slowdown` stretches the measured round (other servers' rounds on the same
    cores); an emulated link's time is waiting, not CPU work, and is not stretched: with it the round
    takes at least the link's time for every push and answer in turn.
    """
    probes = profile.ps or {}
    if probes:
        by_workers = sorted((int(required(p.workers, "ps workers")), _probed_round_s(p, payload_bytes, compute_s))
                            for p in probes.values())
        measured = interpolate_linear([w for w, _ in by_workers], [t for _, t in by_workers], workers)
    else:
        one_way = message_s(profile, "p2p", payload_bytes, 2, None) + message_s(profile, "p2p", 0.0, 2, None)
        measured = 2 * workers * one_way
    measured *= cpu_slowdown
    if link is None:
        return measured
    return max(measured, 2 * workers * emulated_s(link, "p2p", payload_bytes, 2))


def _probed_round_s(probe: ServerProbe, payload_bytes: float, compute_s: float | None) -> float:
    sizes = required(probe.bytes, "ps bytes")
    idle_s = interpolate_linear(sizes, required(probe.round_s, "ps round_s"), payload_bytes)
    if compute_s is None or probe.busy_round_s is None:
        return idle_s
    rounds = [idle_s] + [interpolate_linear(sizes, busy, payload_bytes) for busy in probe.busy_round_s]
    return between_blocks([0.0, *required(probe.block_alone_s, "ps block_alone_s")], rounds, compute_s)


def ps_compute_stretch(profile: CalibrationProfile, workers: int, alone_s: float) -> float | None:
    """How much a PS worker's compute stretches beside the others' and the server's exchanges (the
    transport probe with compute, at the calibrated world size nearest workers + 1); None without."""
    probe = machine_probe(profile, "ps", workers + 1)
    if probe is None or probe.busy_block_s is None:
        return None
    blocks = required(probe.block_alone_s, "ps block_alone_s")
    stretch = [busy / alone for busy, alone in zip(probe.busy_block_s, blocks)]
    return between_blocks(blocks, stretch, alone_s)


def concurrent_rounds_slowdown(rounds: int, clients: float, cores: int) -> float:
    """How much `rounds` server rounds at once stretch each other on `cores` cores.

    A round keeps its server and its `clients` workers' transport busy, up to
    the cores there are (as the probe measured it, one server alone); rounds
    beyond what the cores hold take turns. One round, or a machine with cores
    to spare, runs each as fast as the probe.
    """
    cores_per_round = min(clients + 1.0, max(cores, 1))
    return max(1.0, rounds * cores_per_round / max(cores, 1))


def oversubscription_of(busy_ranks: int, cores: int) -> float:
    return max(1.0, busy_ranks / max(cores, 1))


def busy_period_s(alone_s: float, stretch: float, oversubscription: float) -> float:
    """Wall time of `alone_s` of CPU work per rank when every rank does it at once: stretched by
    running beside the others, and at least ranks / cores times the work when they take turns."""
    return alone_s * max(stretch, oversubscription) if oversubscription > 1 else alone_s * stretch


def interpolate_linear(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys); beyond either end, the nearest segment's slope (not below 0)."""
    if len(xs) == 1:
        return float(ys[0])
    i = 0
    while i < len(xs) - 2 and x > xs[i + 1]:
        i += 1
    slope = (ys[i + 1] - ys[i]) / max(xs[i + 1] - xs[i], 1e-12)
    return max(float(ys[i] + slope * (x - xs[i])), 0.0)
