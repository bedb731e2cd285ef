"""What an estimator is given and what it returns, at cluster scale and on this machine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ddlscope.calibrate.model import STATE_TENSORS, machine_probe, sync_at
from ddlscope.calibrate.profile import CalibrationProfile
from ddlscope.predict.catalogue import Cluster
from ddlscope.predict.strategies import ServerSpec, StrategyEstimate, Workload
from ddlscope.specs import StrategySpec
from ddlscope.specs.strategies.batching import HeteroBatchKnobs, step_slowdowns


@dataclass(frozen=True)
class ClusterCase:
    """One experiment's workload on a GPU cluster, as advise prices every strategy on it."""

    workload: Workload  # per-worker FLOPs, batch, bytes; achieved fraction of the device's peak
    cluster: Cluster
    stragglers: float  # one worker this many times slower (1: none)
    slowdowns: Sequence[float] | None  # per worker, or None when all are equal
    server: ServerSpec  # the parameter server(s) a server strategy would use
    activation_bytes: float  # saved for backward, per worker's batch
    weight_bytes_per_param: float
    optimizer_bytes_per_param: float

    @property
    def replicated_state_bytes(self) -> float:
        """Weights, gradients and optimizer state of the whole model."""
        return self.workload.params * (2 * self.weight_bytes_per_param + self.optimizer_bytes_per_param)


@dataclass(frozen=True)
class LocalCase:
    """One stored run's configuration on this machine, with what every local estimate shares."""

    world: int  # training ranks
    servers: int  # extra ranks (spec.extra_ranks())
    cores: int
    link: tuple[float, float] | None  # the emulated network (alpha_s, bytes/s), None for the real one
    profile: CalibrationProfile  # the calibration
    facts: dict[str, Any]  # the workload's FLOPs, ops and tensor sizes (the step profiler's)
    alone_s: float  # one rank's compute with the machine to itself
    op_s: float  # per-op overhead, seconds
    memory_bandwidth_bytes_per_s: float
    optimizer_kind: str  # sgd, sgd-momentum, adamw
    per_tensor_s: float  # the optimizer's per-tensor overhead
    kernel_stretch: float | None = None  # the workload's kernels side by side over alone, where timed
    kernel_slowest_wait_s: float = 0.0  # a synchronous step's wait for its slowest rank, from them
    steps: int | None = None  # the run's steps (workload.steps), where known: the measured mean is over them
    workload: dict[str, Any] = field(default_factory=dict)  # the run's workload config (sizes: hidden, seq_len)

    def steady_steps(self) -> range | None:
        """The steps the run's mean step time is taken over (analysis/summary.py: step 0 is left out when
        there are others); None where the run's length is not known."""
        if not self.steps:
            return None
        return range(1, self.steps) if self.steps > 1 else range(0, 1)

    @property
    def param_bytes(self) -> float:
        return float(self.facts["param_bytes"])

    def side_by_side_stretch(self) -> float:
        """How much a rank's compute stretches beside the other ranks': the workload's own kernels timed
        side by side where the facts have them (calibrate/facts.py rank_kernel_times), else the
        synchronisation probe's matmul. A lone rank runs beside no other: its kernels take what they took
        alone (stretched as if beside another, single x1 was predicted at 1.34x its kernels here)."""
        if self.world == 1:
            return 1.0
        if self.kernel_stretch is not None:
            return self.kernel_stretch
        return sync_at(machine_probe(self.profile, "sync", self.world), self.alone_s)[0]


@dataclass
class LocalComm:
    """A strategy's communication per step on this machine, and which waits its probes hold already."""

    comm_s: float = 0.0
    # A probe of this strategy holds the ranks' per-step synchronisation wait (the calibrated
    # sync_overhead_s must not be added again).
    holds_sync_wait: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LocalStep:
    """The compute part of a local step, for estimators whose communication depends on it."""

    stretch: float
    forward_s: float
    backward_s: float
    zero_grad_s: float


# A cluster note that starts with this is a knob advice (e.g. DDP's compression hooks and bucket plans on a
# slow network): advise lifts it into its reasons, whatever the strategy.
KNOB_NOTE_PREFIX = "knobs: "


class Estimator:
    """A strategy's predictor. Subclasses implement `cluster`, `cluster_memory` and `local_comm`;
    the other methods have the defaults of a data-parallel strategy that replicates the model."""

    # ------------------------------------------------------------------ cluster scale (advise)
    def cluster(self, spec: StrategySpec, case: ClusterCase) -> StrategyEstimate:
        """Step time, communication and throughput on the GPU cluster."""
        raise NotImplementedError

    def cluster_memory(self, spec: StrategySpec, case: ClusterCase) -> tuple[float, float | None]:
        """(bytes per GPU, bytes per server or None): model states plus activations."""
        raise NotImplementedError

    def cluster_notes(self, spec: StrategySpec, case: ClusterCase) -> list[str]:
        """What advise should say of this strategy on this case beyond the estimate's own notes."""
        return []

    def communication_buffer_bytes(self, spec: StrategySpec, param_bytes: float, largest_unit_bytes: float) -> float:
        """Bytes per GPU the strategy's exchange holds beyond the model states (buckets, gathered units):
        none by default."""
        return 0.0

    def transformer_layout(self, spec: StrategySpec, workers: int) -> dict[str, Any] | None:
        """The transformer layout this strategy is (ParallelSpec fields), where the planner's step model
        prices it: advise then prices a transformer workload under it exactly as `plan` prices that
        layout. None: not a layout of the planner (the default)."""
        return None

    # ------------------------------------------------------------------ this machine (predict --against)
    def local_compute_stretch(self, spec: StrategySpec, case: LocalCase) -> float | None:
        """How much a rank's compute stretches beside the others, where a probe of this strategy
        measured it; None: the synchronisation probe's."""
        return None

    def local_compute_share(self, spec: StrategySpec, case: LocalCase) -> float:
        """The part of the model's forward and backward (on the batch the facts profile) one rank computes:
        all of it by default; 1/p where each rank holds 1/p of the layers (pipeline, partitioned)."""
        return 1.0

    def local_compute_extra_s(self, spec: StrategySpec, case: LocalCase) -> tuple[float, list[str]]:
        """Seconds a worker's forward and backward take beyond its kernels' (e.g. tensor parallel's DTensor
        dispatch and the all-reduces inside its layers), with notes: none by default."""
        return 0.0, []

    def local_minibatches(self, spec: StrategySpec, case: LocalCase) -> float:
        """Minibatches a worker reads, computes and steps in one run step (a federated round's local steps):
        1 by default. local_compute_factor should include it where it is not 1."""
        return 1.0

    def local_data_reads(self, spec: StrategySpec, case: LocalCase) -> float:
        """Minibatches' worth of data a worker reads in one run step: each minibatch it steps by default
        (a round that trains several models on the same samples reads them once)."""
        return self.local_minibatches(spec, case)

    def local_compute_factor(self, spec: StrategySpec, case: LocalCase) -> float:
        """A worker's compute per step over a plain forward and backward of its batch (e.g. gossip's
        per-sample gradients for differential privacy compute one more forward): 1 by default."""
        return 1.0

    def local_waits_per_step(self, spec: StrategySpec, case: LocalCase) -> float:
        """How often a rank's compute follows a wait (for a collective, a server, a neighbour), per step: once
        a step in a run of several ranks by default, none alone. Each costs the kernels' `pause_extra_s` at
        the wait's length (predict/local.py): the next forward runs slower after the rank was away."""
        return 1.0 if case.world > 1 else 0.0

    def local_optimizer_bytes(self, spec: StrategySpec, case: LocalCase) -> float:
        """Parameter bytes the optimizer steps on one worker."""
        return case.param_bytes

    def local_optimizer_tensor_s(self, spec: StrategySpec, case: LocalCase) -> float:
        """The optimizer's overhead per parameter tensor on one worker: a plain tensor's by default."""
        return case.per_tensor_s

    def local_comm(self, spec: StrategySpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """Communication per step on this machine."""
        raise NotImplementedError

    def local_memory(self, spec: StrategySpec, case: LocalCase) -> dict[str, dict[str, int]]:
        """Model-state bytes of a worker (and of a server): replicated by default."""
        full = int(case.param_bytes)
        return {"worker": {"parameters": full, "gradients": full, "optimizer": state_tensors(case) * full}}


def forward_share(facts: dict[str, Any]) -> float:
    """Forward's part of forward + backward: as timed where the kernels were, else the FLOPs' 1 in 3."""
    kernels = facts.get("kernels")
    if kernels and kernels["forward_s"] + kernels["backward_s"] > 0:
        return float(kernels["forward_s"] / (kernels["forward_s"] + kernels["backward_s"]))
    return 1 / 3


def gpt_sizes(workload: dict[str, Any]) -> tuple[int, float] | None:
    """(blocks, elements of one block's activations: batch x seq_len x hidden) from a GPT workload's config;
    None where the config does not say them (a Hugging Face model's come from its own config)."""
    try:
        return int(workload["layers"]), float(workload["batch_size"] * workload["seq_len"] * workload["hidden"])
    except (KeyError, TypeError):
        return None


def state_tensors(case: LocalCase) -> int:
    """Optimizer state tensors per parameter (SGD none, momentum one, Adam two)."""
    return STATE_TENSORS[case.optimizer_kind]


def split_slowdowns(spec: StrategySpec, case: ClusterCase) -> list[float] | None:
    """Each worker's compute time per step relative to a homogeneous equal split, when the strategy
    splits the batch by speed (batch_split: specs/strategies/batching.py); the case's slowdowns as
    they are otherwise. "cluster" speeds are the priced cluster's (1 / slowdown); declared speeds
    that do not name one per GPU of it are left out (an equal split)."""
    if not isinstance(spec, HeteroBatchKnobs):
        return list(case.slowdowns) if case.slowdowns else None
    slowdowns = list(case.slowdowns) if case.slowdowns else [1.0] * case.cluster.n_gpus
    return step_slowdowns(slowdowns, spec.declared_speeds(slowdowns))
