"""Predict a stored local run (CPU, gloo) from its config and this machine's calibration.

Torch-free, like the rest of ddlscope.predict: the workload's FLOPs, op count
and parameter sizes come in as `facts` (ddlscope.calibrate.workload_facts,
which needs torch), the machine as a calibration profile (ddlscope calibrate).

Per step and rank:

- compute (forward + backward) = ops x per-op overhead + each matmul's FLOPs
  / the calibrated FLOP/s at its size + the other ops' bytes / memory
  bandwidth, split 1:2 between forward and backward as the FLOPs are; times
  the calibrated `compute_stretch` (what running beside the other ranks costs).
- oversubscription: when more ranks compute than there are cores, each waits
  its turn for a core: the step lasts at least busy CPU time x ranks / cores;
  the turn-taking shows up as waiting (comm_wait), as it does in the runs.
- communication, from what the strategy sends, each message timed from the
  calibrated table of typical (median) gloo times at that world size,
  interpolated between measured sizes (gloo's cost is not one straight line
  in the size: it changes algorithm and falls out of cache), or the alpha-beta
  fit where the profile has no table; max'd with the emulated link's alpha +
  wire_bytes / bandwidth when the run emulated a network (LinkModel waits out
  the emulated time but the real transfer still happens):
  ddp: the calibrated DDP cost at the model's size (hooks, bucket copies and
  the all-reduces as a step pays them on this machine), interpolated between
  the probed model sizes; with an emulated link at least the smallest
  model's cost plus the link's time for one all-reduce per bucket_mb bucket
  (on CPU/gloo DDP's all-reduce ends after backward's last bucket, so it
  counts as exposed); without the probe, the all-reduces from the table;
  fsdp: per unit the calibrated FSDP cost at its size (hooks, copies, its
  all-gather in forward, again in backward, and the reduce-scatter of its
  gradients, as fully_shard pays them on this machine), interpolated between
  the probed unit sizes; with an emulated link, at least the smallest unit's
  cost plus the link's time for those three collectives;
  ps-*: each worker flattens its gradients, pushes them (a header and a data
  message) and pulls the parameters through the server's link, which
  serialises the workers: a round of all pushes and answers from the
  calibrated transport probe (ps_round_s; sync: the round, one update;
  async: workers of equal speed arrive together and are served in turn, so
  the mean one queues behind half of the others, and a step lasts at least
  workers x (its share of the round + update)), then unflattens them. The
  server's update costs the passes over its shard that runtime/ps_server.py
  makes (server_apply_passes).
- synchronisation: a rank that finishes its compute waits for the slowest and
  for gloo's threads to wake: the calibrated `sync_overhead_s` per step
  wherever no probe of the strategy holds that wait already: ddp/fsdp
  without their probes (which time whole steps), parameter servers without
  the transport probe's rounds with compute (which hold the wait for the
  other workers' pushes; it also gives PS workers their compute stretch).
- optimizer: 3 passes over the parameters at memory bandwidth plus per-tensor
  op overheads (none on PS workers: the server steps).
- model states per rank: parameters / gradients / optimizer bytes (ddp
  replicated; fsdp dim-0 shards padded to ceil(dim0 / world); ps workers hold
  parameters + gradients, each server its shard and the optimizer state).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

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


def nearest_world(tables: dict[str, Any], ranks: int) -> str:
    """The key ("wsN") of the calibrated world size nearest `ranks` (the larger on a tie)."""
    sizes = sorted(int(k.removeprefix("ws")) for k in tables)
    return f"ws{min(sizes, key=lambda s: (abs(s - ranks), -s))}"


def collective_fit(profile: dict[str, Any], kind: str, ranks: int) -> dict[str, Any]:
    """The calibrated entry for `kind` at `ranks` members: that world size or the nearest calibrated."""
    tables = profile["collectives"]
    if not tables:
        raise ConfigError("the calibration has no collective measurements")
    if kind == "p2p" and "ws2" in tables:
        ranks = 2
    return tables[nearest_world(tables, ranks)][kind]


def measured_message_s(fit: dict[str, Any], payload_bytes: float) -> float:
    """Typical gloo time of one message: log-log interpolation in the calibrated table, the
    alpha-beta fit's slope beyond its largest size, the fit alone when there is no table."""
    alpha, beta = float(fit["alpha_s"]), float(fit["beta_bytes_per_s"])
    sizes, seconds = fit.get("sizes"), fit.get("seconds")
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
    wire = payload_bytes * WIRE_FACTORS[kind](max(ranks, 1)) if ranks > 1 or kind == "p2p" else 0.0
    return link[0] + wire / link[1]


def message_s(profile: dict[str, Any], kind: str, payload_bytes: float, ranks: int,
              link: tuple[float, float] | None) -> float:
    """One message's time: calibrated gloo time, or the emulated link's if that is longer."""
    measured = measured_message_s(collective_fit(profile, kind, ranks), payload_bytes)
    return measured if link is None else max(measured, emulated_s(link, kind, payload_bytes, ranks))


def machine_probe(profile: dict[str, Any], section: str, ranks: int) -> dict[str, Any]:
    """A calibrated probe (sync, ddp, fsdp) at `ranks` (the nearest world size), {} for an older profile."""
    tables = profile.get(section) or {}
    return tables[nearest_world(tables, ranks)] if tables else {}


def between_blocks(blocks: list[float], values: list[float], alone_s: float) -> float:
    """A probe's value for a step of `alone_s` compute: linear between its block lengths, held at
    the nearer end outside them."""
    return interpolate_linear(list(blocks), list(values), min(max(alone_s, blocks[0]), blocks[-1]))


def sync_at(sync: dict[str, Any], alone_s: float) -> tuple[float, float]:
    """(compute_stretch, sync_overhead_s) for a step of `alone_s` compute: linear between the probe's
    two block lengths, held at the nearer one outside them; (1, 0) without a probe."""
    if not sync:
        return 1.0, 0.0
    blocks = sync["block_alone_s"]
    return (between_blocks(blocks, sync["compute_stretch"], alone_s),
            between_blocks(blocks, sync["sync_overhead_s"], alone_s))


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


def ps_round_s(profile: dict[str, Any], workers: float, payload_bytes: float,
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
    probes = profile.get("ps") or {}
    if probes:
        by_workers = sorted((int(p["workers"]), _probed_round_s(p, payload_bytes, compute_s)) for p in probes.values())
        measured = interpolate_linear([w for w, _ in by_workers], [t for _, t in by_workers], workers)
    else:
        one_way = message_s(profile, "p2p", payload_bytes, 2, None) + message_s(profile, "p2p", 0.0, 2, None)
        measured = 2 * workers * one_way
    measured *= cpu_slowdown
    if link is None:
        return measured
    return max(measured, 2 * workers * emulated_s(link, "p2p", payload_bytes, 2))


def _probed_round_s(probe: dict[str, Any], payload_bytes: float, compute_s: float | None) -> float:
    idle_s = interpolate_linear(probe["bytes"], probe["round_s"], payload_bytes)
    if compute_s is None or "busy_round_s" not in probe:
        return idle_s
    rounds = [idle_s] + [interpolate_linear(probe["bytes"], busy, payload_bytes) for busy in probe["busy_round_s"]]
    return between_blocks([0.0, *probe["block_alone_s"]], rounds, compute_s)


def ps_compute_stretch(profile: dict[str, Any], workers: int, alone_s: float) -> float | None:
    """How much a PS worker's compute stretches beside the others' and the server's exchanges (the
    transport probe with compute, at the calibrated world size nearest workers + 1); None without."""
    probe = machine_probe(profile, "ps", workers + 1)
    if "busy_block_s" not in probe:
        return None
    stretch = [busy / alone for busy, alone in zip(probe["busy_block_s"], probe["block_alone_s"])]
    return between_blocks(probe["block_alone_s"], stretch, alone_s)


def concurrent_rounds_slowdown(rounds: int, clients: float, cores: int) -> float:
    """How much `rounds` server rounds at once stretch each other on `cores` cores.

    A round keeps its server and its `clients` workers' transport busy, up to
    the cores there are (as the probe measured it, one server alone); rounds
    beyond what the cores hold take turns. One round, or a machine with cores
    to spare, runs each as fast as the probe.
    """
    cores_per_round = min(clients + 1.0, max(cores, 1))
    return max(1.0, rounds * cores_per_round / max(cores, 1))


def server_apply_passes(strategy: str, workers: int, opt_kind: str) -> float:
    """Passes over a server's shard per worker step, as runtime/ps_server.py makes them.

    Synchronous rounds keep each push (a clone: read + write), stack them
    (read + write each), sum (all read, one written) and divide (read +
    write), once per round, i.e. per worker step; asynchronous pushes are
    scaled (read + write) each. Then the optimizer step: 3 passes (gradient
    read, parameter read + write) plus 2 per state tensor.
    """
    optimizer = 3 + 2 * STATE_TENSORS[opt_kind]
    if strategy == "ps-sync":
        return 2 * workers + 2 * workers + (workers + 1) + 2 + optimizer
    return 2 + optimizer


def oversubscription_of(busy_ranks: int, cores: int) -> float:
    return max(1.0, busy_ranks / max(cores, 1))


def busy_period_s(alone_s: float, stretch: float, oversubscription: float) -> float:
    """Wall time of `alone_s` of CPU work per rank when every rank does it at once: stretched by
    running beside the others, and at least ranks / cores times the work when they take turns."""
    return alone_s * max(stretch, oversubscription) if oversubscription > 1 else alone_s * stretch


def predict_local(config: dict[str, Any], environment: dict[str, Any], facts: dict[str, Any],
                  profile: dict[str, Any]) -> dict[str, Any]:
    """Predicted mean step time, its breakdown and model-state memory of one run."""
    strategy = config["strategy"]["name"]
    world = int(config["cluster"]["world_size"])
    is_ps = strategy.startswith("ps") or strategy == "ssp"
    servers = int(config["strategy"].get("servers", 1)) if is_ps else 0
    compute = profile["compute"]
    cores = int(profile.get("meta", {}).get("cores") or environment.get("cores") or 1)
    # Servers sleep in recv while the workers compute: only the workers contend for cores then.
    oversubscription = oversubscription_of(world, cores)
    link = _link(environment)
    notes: list[str] = []

    op_s = float(compute["op_overhead_s"])
    # Memory-bound work at the largest calibrated copy's rate. The calibration also records copy
    # rates by size (caches); using them, at the step's footprint, predicted the benchmark's runs
    # worse (MAPE 10.0% against 7.5% on the same runs and calibration), so they stay a record.
    mem_bw = float(compute["memory_bandwidth_bytes_per_s"])
    alone_s = facts["ops"] * op_s + gemm_time_s(facts, compute) + facts.get("other_op_bytes", 0) / mem_bw
    # The workers compute side by side (servers sleep in recv meanwhile); every process of the
    # run, servers too, meets at a step's synchronisation.
    stretch = sync_at(machine_probe(profile, "sync", world), alone_s)[0]
    sync_overhead_s = sync_at(machine_probe(profile, "sync", world + servers), alone_s)[1]
    # Beside a parameter server the workers' compute also meets the server's transport: the
    # transport probe with compute measures that stretch, and its rounds include the wait for the
    # other workers' pushes.
    ps_stretch = ps_compute_stretch(profile, world, alone_s) if is_ps else None
    if ps_stretch is not None:
        stretch = ps_stretch
    compute_s = alone_s * stretch
    forward_s, backward_s = compute_s / 3, 2 * compute_s / 3

    n_tensors = len(facts["param_numel"])
    param_bytes = float(facts["param_bytes"])
    opt_kind = _optimizer_kind(facts)
    local_params = _shard_bytes(facts, world) if strategy == "fsdp" else param_bytes
    per_tensor_s = float(compute.get("optimizer_tensor_s", 2 * op_s)) * OPS_PER_PARAM_OPTIMIZER[opt_kind] / 2
    optimizer_s = (n_tensors * per_tensor_s + (3 + 2 * STATE_TENSORS[opt_kind]) * local_params / mem_bw) * stretch
    zero_grad_s = n_tensors * op_s * stretch

    comm_s = 0.0
    # The DDP and FSDP probes time whole steps, and the PS probe's rounds with compute hold the wait
    # for the other workers, each rank's wait included; the synchronisation probe is for what has no
    # probe of its own (every PS worker blocks on its server's answer each step, async ones too).
    step_probe = strategy in ("ddp", "fsdp") and bool(machine_probe(profile, strategy, world))
    meets_every_step = (is_ps and ps_stretch is None) or (strategy in ("ddp", "fsdp") and not step_probe)
    if strategy == "ddp":
        comm_s = _ddp_comm_s(config, param_bytes, profile, world, link)
    elif strategy == "fsdp":
        comm_s = _fsdp_comm_s(config, facts, profile, world, link, notes)
    elif is_ps:
        per_server = param_bytes / servers
        apply_s = per_tensor_s + server_apply_passes(strategy, world, opt_kind) * per_server / mem_bw
        # Block-cyclic async: each step a worker exchanges one block with one server, so a server
        # hears from workers / servers of them a round (its round as the probe's with that many).
        block_cyclic = strategy == "ps-async" and bool(config["strategy"].get("block_cyclic", False))
        exchanged = per_server if block_cyclic else param_bytes
        flatten_s = 2 * 2 * exchanged / mem_bw * stretch  # gather the pushed gradients, copy the answer back
        clients = max(world / servers, 1.0) if block_cyclic else world  # PSAsyncSpec.pushes_per_round (torch side)
        # Servers are processes on the workers' machine: their rounds run side by side only while
        # cores are free (the probe's round, one server and `clients` workers, keeps that many busy).
        side_by_side = min(servers, world) if block_cyclic else servers
        rounds_slowdown = concurrent_rounds_slowdown(side_by_side, clients, cores)
        round_s = ps_round_s(profile, clients, per_server, link, alone_s, rounds_slowdown)
        if strategy == "ps-sync":
            comm_s = round_s + apply_s + flatten_s
        else:
            # Equal workers arrive together and are served in turn: the mean one waits for half of
            # the others; a saturated server (its work per round longer than a worker's cycle) more.
            service_s = round_s / clients + apply_s
            cycle = forward_s + backward_s + zero_grad_s + flatten_s + service_s
            queue_s = max((clients - 1) / 2 * service_s, clients * service_s - cycle)
            comm_s = service_s + flatten_s + max(queue_s, 0.0)
        optimizer_s = zero_grad_s
        notes.append(f"ps: the server link serialises the workers' pushes and pulls: one round ({clients:g} "
                     f"workers) {round_s * 1e3:.2f} ms, the server's update {apply_s * 1e3:.2f} ms, "
                     f"flattening a worker's gradients and parameters {flatten_s * 1e3:.2f} ms")
        if block_cyclic:
            notes.append(f"ps: block-cyclic: a worker exchanges one of {servers} blocks a step")
        if servers > 1:
            notes.append(f"ps: {side_by_side} server rounds at once share {cores} cores (x{rounds_slowdown:.2f} each)")
    elif strategy != "single":
        notes.append(f"strategy {strategy}: communication not modelled")

    sync_s = sync_overhead_s if meets_every_step and world > 1 else 0.0
    # Turn-taking for a core: the step cannot be shorter than the CPU work ranks / cores times over.
    busy_s = compute_s + optimizer_s
    turn_wait_s = busy_period_s(busy_s / stretch, stretch, oversubscription) - busy_s
    if turn_wait_s > 0 and step_probe:
        # The DDP/FSDP probe differences whole synchronised steps at this world size on these cores:
        # ranks waiting at the all-reduce for one that had no core are inside it already. Counted again
        # here, ddp x4 on 2 cores came out 10-29% slow in five benchmark runs (docs/calibrate.md).
        notes.append(f"{world} computing ranks on {cores} cores: the {strategy} probe's cost holds their "
                     f"turn-taking at the synchronisation")
        turn_wait_s = 0.0
    if turn_wait_s > 0:
        notes.append(f"{world} computing ranks on {cores} cores: each waits its turn for a core "
                     f"({turn_wait_s * 1e3:.2f} ms a step, counted as waiting)")
    breakdown = {"data_s": 0.0, "forward_s": forward_s, "backward_s": backward_s,
                 "comm_wait_s": comm_s + sync_s + max(turn_wait_s, 0.0), "optimizer_s": optimizer_s}
    memory = model_state_bytes(config, facts)
    return {
        "step_s": sum(breakdown.values()),
        "breakdown_s": breakdown,
        "compute_flops_per_step": facts["flops"],
        "ops_per_step": facts["ops"],
        "oversubscription": oversubscription,
        "compute_stretch": stretch,
        "sync_overhead_s": sync_s,
        "link": {"alpha_s": link[0], "bandwidth_bytes_per_s": link[1]} if link else None,
        "memory_bytes": memory,
        "model_state_bytes": sum(memory["worker"].values()),
        "notes": notes,
    }


def _ddp_comm_s(config: dict[str, Any], param_bytes: float, profile: dict[str, Any], world: int,
                link: tuple[float, float] | None) -> float:
    """The calibrated DDP cost at this model size (hooks, bucket copies, its all-reduces on this
    machine), or, where an emulated link is slower, the smallest model's cost + the link's time for
    each bucket's all-reduce. Without a DDP probe: the all-reduces from the collective table."""
    # ddlscope passes bucket_cap_mb explicitly, so torch does not use its 1 MiB first bucket.
    bucket = float(config["strategy"].get("bucket_mb", 25.0)) * 2**20
    buckets = max(1, math.ceil(param_bytes / bucket))
    probe = machine_probe(profile, "ddp", world)
    if not probe:
        return buckets * message_s(profile, "all_reduce", param_bytes / buckets, world, link)
    machine_s = interpolate_linear(probe["model_bytes"], probe["overhead_s"], param_bytes)
    if link is None:
        return machine_s
    return max(machine_s, float(probe["overhead_s"][0])
               + buckets * emulated_s(link, "all_reduce", param_bytes / buckets, world))


def _fsdp_comm_s(config: dict[str, Any], facts: dict[str, Any], profile: dict[str, Any], world: int,
                 link: tuple[float, float] | None, notes: list[str]) -> float:
    """Per unit: the calibrated FSDP cost at its size (hooks, copies, its collectives on this
    machine), or, where an emulated link is slower, the smallest unit's cost + the link's time for
    its all-gathers and reduce-scatter."""
    reshard = config["strategy"].get("reshard_after_forward", True)
    units = [u for u in facts["fsdp_units"] if u > 0]
    if config["strategy"].get("wrap", "block") == "model":
        units = [int(facts["param_bytes"])]
    probe = machine_probe(profile, "fsdp", world)
    if not probe:
        notes.append("fsdp: the calibration has no FSDP per-unit probe (rerun ddlscope calibrate)")
    comm_s = 0.0
    for i, unit in enumerate(units):
        gathers = 1 if (i == len(units) - 1 and len(units) > 1) or not reshard else 2
        if not probe:
            comm_s += (gathers * message_s(profile, "all_gather", unit / world, world, link)
                       + message_s(profile, "reduce_scatter", unit, world, link))
            continue
        machine_s = interpolate_linear(probe["unit_bytes"], probe["unit_overhead_s"], unit)
        if link is None:
            comm_s += machine_s
            continue
        link_s = (gathers * emulated_s(link, "all_gather", unit / world, world)
                  + emulated_s(link, "reduce_scatter", unit, world))
        # the emulated link waits out its own time; the machine's fixed cost (the smallest unit's) remains
        comm_s += max(machine_s, float(probe["unit_overhead_s"][0]) + link_s)
    return comm_s


def interpolate_linear(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys); beyond either end, the nearest segment's slope (not below 0)."""
    if len(xs) == 1:
        return float(ys[0])
    i = 0
    while i < len(xs) - 2 and x > xs[i + 1]:
        i += 1
    slope = (ys[i + 1] - ys[i]) / max(xs[i + 1] - xs[i], 1e-12)
    return max(float(ys[i] + slope * (x - xs[i])), 0.0)


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
