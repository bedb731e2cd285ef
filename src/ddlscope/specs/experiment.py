"""The experiment: what to train (workload), how to distribute it (strategy), on what cluster.

Workload plugins subclass `WorkloadSpec` with their own knobs, strategies
`StrategySpec` (specs/strategy.py); extra fields are forbidden, so an unknown
knob is an error rather than silently ignored. Resolving a plugin name to its
spec class happens in `ddlscope.runtime.config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from ddlscope.specs.base import MAX_INT64, ConfigError, Spec, remember_spec_class
from ddlscope.specs.strategy import StrategySpec

# Bounds past which a run is a typo, not an experiment (a batch of 10**12 fails inside a rank, out of memory).
MAX_BATCH = 2**20
MAX_STEPS = 10**9
MAX_RANKS = 2**20
# Physical bounds, reasoned in docs/bad-input.md (Limits): each value past them was accepted, then failed (or
# hung) inside the ranks. A learning rate or decay above 1e6 multiplies float32 weights past their range in a step.
MAX_LR = 1e6
MAX_WIDTH = 65_536  # hidden sizes: the widest published model uses 16,384; hf sources take 65,536
MAX_GRAPH_EDGES = 2**28  # drawn in-edges of the generated graph: ~12 bytes each, 3 GiB in every rank
MAX_SLOWDOWN = 1_000.0  # a rank 1000x slower turns a 10 ms step into 10 s: a hang, not a straggler
MAX_START_DELAY_S = 3_600.0  # an hour, as a preemption's down_s
MAX_THREADS_PER_RANK = 1_024  # more than any node's cores
MAX_NAME_CHARS = 256  # a run's name labels tables and report titles; 100 kB made `show` spin


class WorkloadSpec(Spec):
    """Fields shared by every workload; subclasses add model/data knobs."""

    # How long a run trains and how often it evaluates, not what one step computes: runs that differ
    # only here compare step for step (a speedup's one-process baseline, analysis/summary.py).
    SCHEDULE_FIELDS: ClassVar[tuple[str, ...]] = ("steps", "eval_every", "eval_batches")

    name: str = Field(description="registered workload name")
    batch_size: int = Field(64, ge=1, description="global batch: samples per step, summed over ranks")
    steps: int = Field(100, ge=1, description="optimizer steps to train")
    eval_every: int = Field(0, ge=0, description="evaluate every N steps (0: only after the last step)")
    eval_batches: int = Field(0, ge=0, description="test batches per evaluation (0: the whole test split)")
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.05, gt=0, description="learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0)
    data: Literal["memory", "parquet"] = Field(
        "memory", description="memory: batches indexed from the in-memory split; parquet: the split as sharded "
        "Parquet files, per-rank shards read, decoded and augmented by loader workers (runtime/parquet_data.py)")
    data_workers: int = Field(2, ge=0, le=16, description="loader worker processes per rank (data = parquet)")

    @field_validator("batch_size", "steps", "eval_every", "eval_batches", check_fields=False)
    @classmethod
    def _not_absurd(cls, value: int, info) -> int:  # noqa: ANN001 (pydantic's ValidationInfo)
        # A validator here, not `le=` on the Field: workloads redeclare batch_size and steps with their defaults.
        bound = MAX_BATCH if info.field_name == "batch_size" else MAX_STEPS
        if isinstance(value, int) and value > bound:
            raise ValueError(f"{value} is more than {bound:,}" + (" samples per step" if bound == MAX_BATCH else ""))
        return value

    @field_validator("lr", "weight_decay", check_fields=False)
    @classmethod
    def _finite_step(cls, value: float, info) -> float:  # noqa: ANN001
        # A validator, not `le=`: workloads redeclare lr with their own defaults.
        if isinstance(value, float) and value > MAX_LR:
            raise ValueError(f"{value:g} is more than {MAX_LR:g} (a step that large overflows float32 weights)")
        return value

    @field_validator("hidden", check_fields=False)
    @classmethod
    def _not_too_wide(cls, value: int) -> int:
        if isinstance(value, int) and value > MAX_WIDTH:
            raise ValueError(f"{value} is more than {MAX_WIDTH:,} (the widest published model uses 16,384)")
        return value

    @model_validator(mode="after")
    def _graph_fits(self) -> "WorkloadSpec":
        # The generated graph's knobs (workloads/graph.py): each node draws degree_in + degree_out in-edges.
        nodes, d_in, d_out = (getattr(self, k, None) for k in ("nodes", "degree_in", "degree_out"))
        if None in (nodes, d_in, d_out):
            return self
        for field, degree in (("degree_in", d_in), ("degree_out", d_out)):
            if degree > nodes:
                raise ValueError(f"{field} = {degree}: at most nodes = {nodes} (a node's draws past the graph's "
                                 "nodes are duplicates, dropped)")
        if nodes * (d_in + d_out + 1) > MAX_GRAPH_EDGES:
            raise ValueError(f"nodes x (degree_in + degree_out + 1) = {nodes * (d_in + d_out + 1):,} edges: at most "
                             f"{MAX_GRAPH_EDGES:,} (about 12 bytes each, in every rank)")
        return self


@dataclass(frozen=True)
class NetworkProfile:
    """A named cluster network, per device (what one rank's link gets)."""

    alpha_us: float
    bandwidth_gbps: float
    target_device: str  # whose compute speed `scaled` mode matches
    target_flops: float  # dense bf16 peak of that device, FLOP/s (REFERENCE.md)
    source: str


# The main study's two clusters (../shared/REFERENCE.md, vendor datasheets):
# fast: DGX A100, 8x HDR InfiniBand 200 Gb/s per node = 200 Gb/s per GPU;
# slow: AWS g5.12xlarge, 4x A10G sharing 40 Gb/s Ethernet = 10 Gb/s per GPU.
# Latencies are typical values for each fabric (RDMA ~ a few us, cloud TCP ~ 50 us).
NETWORK_PROFILES: dict[str, NetworkProfile] = {
    "fast": NetworkProfile(5.0, 200.0, "a100", 312e12, "DGX A100: 8x HDR InfiniBand 200 Gb/s per node"),
    "slow": NetworkProfile(50.0, 10.0, "a10g", 125e12, "AWS g5.12xlarge: 4x A10G share 40 Gb/s Ethernet"),
}
# In `scaled` mode the target device is assumed to reach this fraction of its
# peak in training (typical MFU of well-tuned training), and this machine its
# measured matmul rate; bandwidth shrinks by the ratio of the two.
TARGET_COMPUTE_EFFICIENCY = 0.4


class NetworkSpec(Spec):
    profile: Literal["local", "fast", "slow", "custom"] = Field(
        "local", description="local: no emulation; fast/slow: the main study's clusters; custom: alpha_us + bandwidth_gbps")
    # Bounds: a message's wait alpha + bytes/bandwidth must be a time a timer can sleep (5e-324 Gb/s overflowed
    # in a rank's comm callback and hung the run). 1 Mb/s is slower than any datacenter link, 1 Pb/s faster
    # than any; 10 s of latency is past any network, even across continents.
    alpha_us: float | None = Field(None, ge=0, le=1e7, description="per-message latency, microseconds (overrides "
                                                                  "the profile's), at most 10 s")
    bandwidth_gbps: float | None = Field(None, ge=1e-3, le=1e6, description="per-rank link bandwidth, Gbit/s "
                                                                          "(overrides the profile's), 1e-3 to 1e6")
    scaled: bool = Field(False, description="divide bandwidth by (target device FLOP/s / this machine's), "
                                            "so communication-to-computation matches the target cluster")
    mode: Literal["emulated", "shaped"] = Field(
        "emulated", description="emulated: each message waits alpha + bytes/bandwidth in software; "
                                "shaped: ranks in network namespaces with tc rate limits (latency still emulated)")

    @model_validator(mode="after")
    def _complete(self) -> "NetworkSpec":
        if self.profile == "custom" and (self.alpha_us is None or self.bandwidth_gbps is None):
            raise ValueError("profile 'custom' needs both alpha_us and bandwidth_gbps")
        if self.profile == "local" and (self.alpha_us is not None or self.bandwidth_gbps is not None or self.scaled):
            raise ValueError("profile 'local' emulates nothing; pick fast, slow or custom to set alpha/bandwidth/scaled")
        if self.mode == "shaped" and self.profile == "local":
            raise ValueError("mode 'shaped' needs a profile with a bandwidth")
        return self

    def link(self) -> tuple[float, float] | None:
        """(alpha_s, bandwidth_bytes_per_s) before scaling, or None for the real network."""
        if self.profile == "local":
            return None
        named = NETWORK_PROFILES.get(self.profile)
        alpha_us = self.alpha_us if self.alpha_us is not None else named.alpha_us  # type: ignore[union-attr]
        gbps = self.bandwidth_gbps if self.bandwidth_gbps is not None else named.bandwidth_gbps  # type: ignore[union-attr]
        return alpha_us * 1e-6, gbps * 1e9 / 8

    def target_flops(self) -> float:
        """The compute speed `scaled` mode matches: the profile's device, or an A100 for custom links."""
        named = NETWORK_PROFILES.get(self.profile, NETWORK_PROFILES["fast"])
        return named.target_flops * TARGET_COMPUTE_EFFICIENCY


class Fault(Spec):
    """An injected failure, for testing what a run records when a rank dies."""

    rank: int = Field(ge=0)
    step: int = Field(ge=0, description="the rank dies at the start of this step")
    kind: Literal["crash"] = Field("crash", description="crash: the process exits at once, without cleanup")


class Preemption(Spec):
    """A worker taken away and given back (a spot instance reclaimed, then replaced), emulated: the
    rank stops at the start of `step`, discards its model, is away `down_s` seconds, then pulls the
    latest model from the servers and goes on. Asynchronous parameter-server protocols only: the
    survivors keep training meanwhile (PAPERS.md item 18, VC-ASGD)."""

    rank: int = Field(ge=0)
    step: int = Field(ge=0, description="the worker leaves at the start of this step")
    down_s: float = Field(1.0, ge=0, le=3600, description="seconds away before it comes back")


_ENDPOINT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


class ClusterSpec(Spec):
    world_size: int = Field(2, ge=1, le=MAX_RANKS, description="total ranks over all nodes")
    nnodes: int = Field(1, ge=1, description="nodes (launchers) taking part in the rendezvous")
    node_rank: int = Field(0, ge=0, description="this launcher's node rank (0 hosts the rendezvous and the store)")
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous (default: 127.0.0.1 and a free port)")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl when CUDA is present, else gloo")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads_per_rank: int = Field(1, ge=1, le=MAX_THREADS_PER_RANK,
                                  description="intra-op threads per rank (1 avoids oversubscription)")
    slowdown: list[float] = Field(default_factory=list, description="per-rank compute slowdown factors (>= 1), e.g. [1, 2]")
    start_delay_s: list[float] = Field(default_factory=list, description="per-rank start delays in seconds")
    jitter: float = Field(0.0, ge=0, le=10, description="random extra compute per step: up to this fraction, uniform, seeded per rank")
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    faults: list[Fault] = Field(default_factory=list, description="injected failures, e.g. [{rank = 1, step = 3}]")
    preemptions: list[Preemption] = Field(default_factory=list, description="workers taken away and given back, "
                                          "e.g. [{rank = 1, step = 5, down_s = 2}] (asynchronous PS only)")
    max_restarts: int = Field(0, ge=0, le=100, description="restart the ranks (from the last checkpoint) up to this "
                                                            "many times when one dies (torch's elastic agent)")
    hang_timeout_s: float = Field(60.0, gt=0, le=7 * 24 * 3600, description="end the run when a rank makes no progress for this long "
                                                          "past the slowest step so far (the hang watchdog)")

    @property
    def procs_per_node(self) -> int:
        return self.world_size // self.nnodes

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterSpec":
        if self.world_size % self.nnodes:
            raise ValueError(f"world_size {self.world_size} is not a multiple of nnodes {self.nnodes}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("a run over several nodes needs rdzv_endpoint (host:port of node 0)")
        if self.rdzv_endpoint and not _ENDPOINT.match(self.rdzv_endpoint):
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} is not host:port")
        for field in ("slowdown", "start_delay_s"):
            values = getattr(self, field)
            if values and len(values) != self.world_size:
                raise ValueError(f"{field} has {len(values)} entries; give one per rank ({self.world_size}) or none")
        if any(f < 1 for f in self.slowdown):
            raise ValueError(f"slowdown factors must be >= 1, got {self.slowdown}")
        if any(f > MAX_SLOWDOWN for f in self.slowdown):
            raise ValueError(f"slowdown factors must be at most {MAX_SLOWDOWN:g} (a straggler, not a hang), "
                             f"got {self.slowdown}")
        if any(p.rank >= self.world_size for p in self.preemptions):
            raise ValueError(f"a preemption names a rank outside the workers 0..{self.world_size - 1}")
        if len({p.rank for p in self.preemptions}) < len(self.preemptions):
            raise ValueError("give each worker one preemption at most")
        if any(f.rank >= self.world_size for f in self.faults):
            raise ValueError(f"a fault names a rank outside 0..{self.world_size - 1}")
        if any(d < 0 for d in self.start_delay_s):
            raise ValueError(f"start delays must be >= 0, got {self.start_delay_s}")
        if any(d > MAX_START_DELAY_S for d in self.start_delay_s):
            raise ValueError(f"start delays must be at most {MAX_START_DELAY_S:g} s (an hour), got {self.start_delay_s}")
        return self

    def slowdown_of(self, rank: int) -> float:
        return self.slowdown[rank] if self.slowdown else 1.0

    def start_delay_of(self, rank: int) -> float:
        return self.start_delay_s[rank] if self.start_delay_s else 0.0


class Experiment(Spec):
    name: str = Field("", description="free-form label shown in `ddlscope runs`")
    seed: int = Field(0, ge=0, le=MAX_INT64, description="seeds model init, data order and sampling (below 2**63)")
    workload: SerializeAsAny[WorkloadSpec]
    strategy: SerializeAsAny[StrategySpec]
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    save_model_path: str | None = Field(None, description="rank 0 saves the final model's state_dict here (torch.save)")
    checkpoint_dir: str | None = Field(None, description="where checkpoints go (default: the run's folder beside the "
                                                         "store); naming it also checkpoints after the last step")
    checkpoint_every: int = Field(0, ge=0, description="checkpoint every N steps (0: off); restarts and --resume "
                                                       "continue from the newest one")
    checkpoint_every_s: float = Field(0.0, ge=0, description="checkpoint when this many seconds have passed since "
                                                             "the last one (0: off)")
    trace_steps: int = Field(0, ge=0, description="torch.profiler trace of steps 1..N on every rank (0: off); "
                             "`ddlscope trace RUN` merges them")

    @field_validator("name")
    @classmethod
    def _name_fits(cls, name: str) -> str:
        problem = run_name_problem(name)
        if problem:
            raise ValueError(problem)
        return name

    def per_rank_batch(self) -> int:
        if self.strategy.traits.splits_global_batch:
            return self.workload.batch_size // self.cluster.world_size
        return self.workload.batch_size


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot name a run (None: it can): longer than MAX_NAME_CHARS (`ddlscope launch --name` asks
    too, its runs having no Experiment of their own)."""
    if len(name) > MAX_NAME_CHARS:
        return f"{len(name):,} characters, more than {MAX_NAME_CHARS} (a name labels tables and report titles)"
    return None


def check_consistency(exp: Experiment) -> None:
    """Cross-section checks that no single section can make on its own."""
    for field in ("name", "save_model_path", "checkpoint_dir"):  # a line break would split a table row or a path
        value = getattr(exp, field) or ""
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ConfigError(f"{field} = {value!r}: holds a line break or control character; remove it")
    ws = exp.cluster.world_size
    if exp.strategy.traits.single_process and ws != 1:
        raise ConfigError(
            f"cluster.world_size = {ws}: strategy {exp.strategy.name} runs one process; use world_size 1"
        )
    if exp.strategy.extra_ranks() and exp.cluster.nnodes > 1:
        raise ConfigError(f"cluster.nnodes = {exp.cluster.nnodes}: strategy {exp.strategy.name} runs on one node for now")
    if exp.cluster.preemptions:
        traits = exp.strategy.traits
        if traits.family != "server" or traits.synchronous:
            raise ConfigError(f"cluster.preemptions: strategy {exp.strategy.name} cannot train without a worker; "
                              "preemption needs an asynchronous parameter server (ps-async, ssp, ps-stale-aware)")
        if exp.checkpoint_every or exp.checkpoint_every_s:
            raise ConfigError("cluster.preemptions cannot be combined with checkpoints yet (a checkpoint waits for "
                              "every worker); drop checkpoint_every")
        late = [p for p in exp.cluster.preemptions if p.step >= exp.workload.steps]
        if late:
            raise ConfigError(f"cluster.preemptions: step {late[0].step} is past the last step "
                              f"({exp.workload.steps - 1})")
    if exp.checkpoint_every_s and exp.strategy.extra_ranks():
        raise ConfigError(f"checkpoint_every_s: strategy {exp.strategy.name} checkpoints on a step schedule "
                          "(its servers cannot see the workers' clocks); use checkpoint_every = N steps")
    if exp.strategy.traits.splits_global_batch and exp.workload.batch_size % ws:
        raise ConfigError(
            f"workload.batch_size = {exp.workload.batch_size}: must be divisible by cluster.world_size = {ws} "
            f"for strategy {exp.strategy.name} (each rank takes batch_size / world_size samples)"
        )
    exp.strategy.check_experiment(exp)


for _cls in (WorkloadSpec, NetworkSpec, Fault, Preemption, ClusterSpec, Experiment):
    remember_spec_class(_cls)
