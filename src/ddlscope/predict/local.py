"""Predict a stored local run (CPU, gloo) from its config and this machine's calibration.

Torch-free, like the rest of ddlscope.predict: the workload's FLOPs, op count
and parameter sizes come in as `facts` (ddlscope.calibrate.workload_facts,
which needs torch), the machine as a calibration profile (ddlscope calibrate).

Per step and rank:

- compute (forward + backward) = ops x per-op overhead + each matmul's FLOPs
  / the calibrated FLOP/s at its size + the other ops' bytes / memory
  bandwidth, split 1:2 between forward and backward as the FLOPs are; stretched by ranks / cores when the
  run's processes outnumber the cores.
- communication, from what the strategy sends, each message timed as
  max(calibrated alpha + bytes / beta, the emulated link's alpha +
  wire_bytes / bandwidth) when the run emulated a network (LinkModel waits out
  the emulated time but the real transfer still happens), else the
  calibrated time alone:
  ddp: one all-reduce per bucket_mb bucket of gradients (on CPU/gloo DDP's
  all-reduce ends after backward's last bucket, so it counts as exposed);
  fsdp: per unit an all-gather of its shard in forward, again in backward
  (reshard after forward; not the root) and a reduce-scatter of its gradients;
  ps-*: each worker pushes its gradient and pulls the parameters through the
  server's link, which serialises the workers (sync: all pushes, one update,
  all answers; async: the server link is a shared queue, a step lasts at
  least workers x (push + pull)).
- optimizer: 3 passes over the parameters at memory bandwidth plus per-tensor
  op overheads (none on PS workers: the server steps).
- model states per rank: parameters / gradients / optimizer bytes (ddp
  replicated; fsdp dim-0 shards padded to ceil(dim0 / world); ps workers hold
  parameters + gradients, each server its shard and the optimizer state).
"""

from __future__ import annotations

import math
from typing import Any

from ddlscope.specs import ConfigError

WIRE_FACTORS = {  # the same forms as ddlscope.strategies.comm.WIRE_FACTORS (which imports torch)
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}
OPS_PER_PARAM_OPTIMIZER = {"sgd": 2, "sgd-momentum": 4, "adamw": 12}
STATE_TENSORS = {"sgd": 0, "sgd-momentum": 1, "adamw": 2}
PHASES = ("data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s")


def _optimizer_kind(facts: dict[str, Any]) -> str:
    if facts.get("optimizer") == "adamw":
        return "adamw"
    return "sgd-momentum" if facts.get("momentum", 0.0) > 0 else "sgd"


def collective_fit(profile: dict[str, Any], kind: str, ranks: int) -> tuple[float, float]:
    """(alpha_s, beta_bytes_per_s) for `kind` at `ranks` members: that world size or the nearest calibrated."""
    tables = profile["collectives"]
    if not tables:
        raise ConfigError("the calibration has no collective measurements")
    sizes = sorted(int(k.removeprefix("ws")) for k in tables)
    if kind == "p2p":
        ranks = 2 if 2 in sizes else ranks
    nearest = min(sizes, key=lambda s: (abs(s - ranks), -s))
    fit = tables[f"ws{nearest}"][kind]
    return float(fit["alpha_s"]), float(fit["beta_bytes_per_s"])


def message_s(profile: dict[str, Any], kind: str, payload_bytes: float, ranks: int,
              link: tuple[float, float] | None) -> float:
    """One message's time: calibrated gloo time, or the emulated link's if that is longer."""
    alpha, beta = collective_fit(profile, kind, ranks)
    measured = alpha + payload_bytes / beta
    if link is None:
        return measured
    wire = payload_bytes * WIRE_FACTORS[kind](max(ranks, 1)) if ranks > 1 or kind == "p2p" else 0.0
    return max(measured, link[0] + wire / link[1])


def matmul_flops_at(compute: dict[str, Any], size: float) -> float:
    """Calibrated fp32 FLOP/s of a matmul of effective square size `size` (log-linear between sizes)."""
    sizes, rates = compute["matmul"]["sizes"], compute["matmul"]["flops"]
    if size <= sizes[0]:  # below the smallest size measured: per-call overhead dominates, rate ~ size
        return float(rates[0]) * max(size / sizes[0], 0.05)
    if size >= sizes[-1]:
        return float(rates[-1])
    for (s0, r0), (s1, r1) in zip(zip(sizes, rates), zip(sizes[1:], rates[1:])):
        if s0 <= size <= s1:
            w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return float(r0 + w * (r1 - r0))
    return float(rates[-1])


def gemm_time_s(facts: dict[str, Any], compute: dict[str, Any]) -> float:
    """FLOPs / calibrated FLOP/s: each matmul at the rate of its size, the rest at the matmul peak."""
    gemm_flops, gemm_size = facts.get("gemm_flops", []), facts.get("gemm_size", [])
    peak = float(compute["matmul"]["peak_flops"])
    if "sizes" not in compute["matmul"] or not gemm_flops:
        return facts["flops"] / peak
    t = sum(f / matmul_flops_at(compute, n) for f, n in zip(gemm_flops, gemm_size))
    return t + max(0.0, facts["flops"] - sum(gemm_flops)) / peak


def _link(environment: dict[str, Any]) -> tuple[float, float] | None:
    network = environment.get("network", {})
    if not network.get("emulated"):
        return None
    bandwidth = network.get("software_bandwidth_bytes_per_s", network.get("bandwidth_bytes_per_s"))
    if network.get("mode") == "shaped":
        bandwidth = network.get("shaped_bandwidth_bytes_per_s") or bandwidth
    return float(network["alpha_s"]), float(bandwidth or math.inf)


def _shard_bytes(facts: dict[str, Any], world: int) -> int:
    total = 0
    for numel, dim0 in zip(facts["param_numel"], facts["param_dim0"]):
        per_row = numel // max(dim0, 1)
        total += math.ceil(dim0 / world) * per_row * 4
    return total


def model_state_bytes(config: dict[str, Any], facts: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Predicted parameters / gradients / optimizer bytes of a worker (and of a server, for PS)."""
    strategy = config["strategy"]["name"]
    world = config["cluster"]["world_size"]
    states = STATE_TENSORS[_optimizer_kind(facts)]
    full = int(facts["param_bytes"])
    if strategy == "fsdp":
        shard = _shard_bytes(facts, world)
        return {"worker": {"parameters": shard, "gradients": shard, "optimizer": states * shard}}
    if strategy.startswith("ps") or strategy == "ssp":
        servers = config["strategy"].get("servers", 1)
        server_shard = math.ceil(full / 4 / servers) * 4
        return {"worker": {"parameters": full, "gradients": full, "optimizer": 0},
                "server": {"parameters": server_shard, "optimizer": states * server_shard}}
    return {"worker": {"parameters": full, "gradients": full, "optimizer": states * full}}


def predict_local(config: dict[str, Any], environment: dict[str, Any], facts: dict[str, Any],
                  profile: dict[str, Any]) -> dict[str, Any]:
    """Predicted mean step time, its breakdown and model-state memory of one run."""
    strategy = config["strategy"]["name"]
    world = int(config["cluster"]["world_size"])
    servers = int(config["strategy"].get("servers", 1)) if strategy.startswith("ps") or strategy == "ssp" else 0
    compute = profile["compute"]
    cores = int(profile.get("meta", {}).get("cores") or environment.get("cores") or 1)
    oversubscription = max(1.0, (world + servers) / cores)
    link = _link(environment)
    notes: list[str] = []

    peak = float(compute["matmul"]["peak_flops"])
    op_s = float(compute["op_overhead_s"])
    mem_bw = float(compute["memory_bandwidth_bytes_per_s"])
    compute_s = (facts["ops"] * op_s + gemm_time_s(facts, compute)
                 + facts.get("other_op_bytes", 0) / mem_bw) * oversubscription
    forward_s, backward_s = compute_s / 3, 2 * compute_s / 3

    n_tensors = len(facts["param_numel"])
    param_bytes = float(facts["param_bytes"])
    mem_bw = float(compute["memory_bandwidth_bytes_per_s"])
    opt_kind = _optimizer_kind(facts)
    local_params = _shard_bytes(facts, world) if strategy == "fsdp" else param_bytes
    per_tensor_s = float(compute.get("optimizer_tensor_s", 2 * op_s)) * OPS_PER_PARAM_OPTIMIZER[opt_kind] / 2
    optimizer_s = (n_tensors * per_tensor_s
                   + (3 + 2 * STATE_TENSORS[opt_kind]) * local_params / mem_bw) * oversubscription
    zero_grad_s = n_tensors * op_s * oversubscription

    comm_s = 0.0
    if strategy == "ddp":
        # ddlscope passes bucket_cap_mb explicitly, so torch does not use its 1 MiB first bucket.
        bucket = float(config["strategy"].get("bucket_mb", 25.0)) * 2**20
        buckets = max(1, math.ceil(param_bytes / bucket))
        sizes = [param_bytes / buckets] * buckets
        comm_s = sum(message_s(profile, "all_reduce", size, world, link) for size in sizes)
    elif strategy == "fsdp":
        reshard = config["strategy"].get("reshard_after_forward", True)
        units = [u for u in facts["fsdp_units"] if u > 0]
        if config["strategy"].get("wrap", "block") == "model":
            units = [int(param_bytes)]
        for i, unit in enumerate(units):
            is_root = i == len(units) - 1
            gathers = 1 if is_root or not reshard else 2
            comm_s += gathers * message_s(profile, "all_gather", unit / world, world, link)
            comm_s += message_s(profile, "reduce_scatter", unit, world, link)
    elif servers:
        per_server = param_bytes / servers
        push = message_s(profile, "p2p", per_server, 2, link)
        pull = message_s(profile, "p2p", per_server, 2, link)
        apply_s = (per_tensor_s + (3 + 2 * STATE_TENSORS[opt_kind]) * per_server / mem_bw)
        if config["strategy"].get("name") == "ps-sync":
            comm_s = world * push + apply_s + world * pull
        else:
            cycle = forward_s + backward_s + zero_grad_s + push + apply_s + pull
            server_bound = world * (push + pull + apply_s)
            comm_s = push + apply_s + pull + max(0.0, server_bound - cycle)
        optimizer_s = zero_grad_s
        notes.append("ps: the server link serialises the workers' pushes and pulls")
    elif strategy != "single":
        notes.append(f"strategy {strategy}: communication not modelled")

    data_s = 0.0
    breakdown = {"data_s": data_s, "forward_s": forward_s, "backward_s": backward_s, "comm_wait_s": comm_s,
                 "optimizer_s": optimizer_s}
    memory = model_state_bytes(config, facts)
    return {
        "step_s": sum(breakdown.values()),
        "breakdown_s": breakdown,
        "compute_flops_per_step": facts["flops"],
        "ops_per_step": facts["ops"],
        "oversubscription": oversubscription,
        "link": {"alpha_s": link[0], "bandwidth_bytes_per_s": link[1]} if link else None,
        "memory_bytes": memory,
        "model_state_bytes": sum(memory["worker"].values()),
        "notes": notes,
    }


def measured_from_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures predict_local predicts, from analysis.summary's to_dict()."""
    mem = summary.get("memory_bytes_by_rank", {})
    rank0 = mem.get("0", mem.get(0, {}))
    states = {k: int(rank0.get(k, 0)) for k in ("parameters", "gradients", "optimizer")}
    return {
        "step_s": summary.get("mean_step_s"),
        "breakdown_s": {p: summary.get("breakdown_mean_s", {}).get(p) for p in PHASES},
        "memory_bytes": states,
        "model_state_bytes": sum(states.values()),
    }


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    def err(p: float | None, m: float | None) -> float | None:
        return (p - m) / m if p is not None and m else None

    return {
        "step_s_error": err(predicted["step_s"], measured["step_s"]),
        "model_state_error": err(predicted["model_state_bytes"], measured["model_state_bytes"]),
    }
