"""`pipeline`: torch.distributed.pipelining's knobs, and the stage-boundary arithmetic.

The model is a sequence of layers (a GPT: the embedding, each transformer
block, the final norm + head; a model source, `torchvision:NAME`, `timm:NAME`,
`hf:ARCH`, `module:...`: the layers its forward applies in order,
workloads/sequential.py); a partition cuts it into `stages x chunks`
contiguous stages. Stage s runs on rank s mod stages (torch's looped
placement: with chunks v > 1 a rank holds v stages, stages apart). The
arithmetic is torch-free so the runtime (strategies/pipeline.py), the
partitioner (predict/partition.py) and the estimator read the same cuts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, PrivateAttr, model_validator

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec

if TYPE_CHECKING:
    from ddlscope.specs.experiment import Experiment

Schedule = Literal["gpipe", "1f1b", "interleaved", "zero-bubble"]
# Schedules that run several stages (chunks) per rank.
MULTI_STAGE_SCHEDULES = ("interleaved", "zero-bubble")
# Layers a GPT adds around its blocks: the embedding before, the final norm + head after.
EXTRA_LAYERS = 2


@strategy_spec
class PipelineSpec(StrategySpec):
    # Every rank takes the whole batch (stage 0 its inputs, the last stage its targets); a forward
    # pass needs every stage, so all ranks evaluate together.
    traits = Traits(family="pipeline", simplicity=4, collective_forward=True, splits_global_batch=False)
    description = ("torch.distributed.pipelining: the model cut into stages, one per rank (v per rank interleaved), "
                   "micro-batches through a GPipe / 1F1B / interleaved / zero-bubble schedule")
    advice = "when the model's states do not fit one device: each stage holds only its layers"

    name: Literal["pipeline"] = "pipeline"
    schedule: Schedule = Field("1f1b", description="gpipe (all forwards, then all backwards), 1f1b, interleaved "
                                                   "(interleaved 1F1B, `chunks` stages per rank), zero-bubble "
                                                   "(interleaved ZB1P: weight gradients fill the bubble)")
    micro_batches: int = Field(4, ge=1, description="micro-batches per step; the global batch must divide by it")
    chunks: int = Field(1, ge=1, description="stages per rank (v); interleaved needs 2 or more")
    partition: list[int] = Field(
        default_factory=list,
        description="cut points into the layer sequence (GPT: 0 = embedding, 1..L = blocks, L+1 = head): "
                    "stages x chunks - 1 increasing indices where a stage starts; empty: equal blocks per stage")

    dp: int = Field(1, ge=1, description="data-parallel degree: world_size = dp x pipeline ranks; each pipeline "
                                         "replica takes 1/dp of the batch and the replicas average gradients "
                                         "(an all-reduce over the dp ranks of a stage) before the optimizer step")
    recompute: list[int] = Field(
        default_factory=list, description="stages (indices) that keep only their input per micro-batch and "
                                          "recompute their activations in backward (torch.utils.checkpoint)")

    # The world size check_experiment saw: a model source's layers are counted only from the built model
    # (the runtime's check_model, which is handed this spec alone), against the stages it makes.
    _world_size: int | None = PrivateAttr(None)
    _workload: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _schedule_fits_chunks(self) -> "PipelineSpec":
        if self.schedule == "interleaved" and self.chunks < 2:
            raise ValueError("schedule 'interleaved' needs chunks >= 2 (stages per rank); use 1f1b for one")
        if self.schedule in ("gpipe", "1f1b") and self.chunks > 1:
            raise ValueError(f"schedule {self.schedule!r} runs one stage per rank; chunks > 1 needs "
                             "'interleaved' or 'zero-bubble'")
        return self

    def check_experiment(self, exp: "Experiment") -> None:
        self._world_size, self._workload = exp.cluster.world_size, exp.workload.name
        source = is_model_source(exp.workload.name)
        layers = getattr(exp.workload, "layers", None)
        if not source and (not isinstance(layers, int) or not hasattr(exp.workload, "heads")):
            # docs/bad-input.md shows this line as it stands (model sources pass above)
            raise ConfigError(f"workload.name = {exp.workload.name!r}: strategy pipeline splits a transformer "
                              "into stages; use a GPT workload (gpt-char, gpt-synthetic)")
        if exp.checkpoint_every or exp.checkpoint_every_s or exp.checkpoint_dir or exp.cluster.max_restarts:
            raise ConfigError("checkpoint_every: strategy pipeline does not checkpoint yet (each rank holds other "
                              "layers); drop checkpoints and cluster.max_restarts")
        if exp.cluster.world_size % self.dp:
            raise ConfigError(f"strategy.dp = {self.dp}: cluster.world_size = {exp.cluster.world_size} must be "
                              "dp x pipeline ranks, a multiple of it")
        pp = self.pipeline_ranks(exp.cluster.world_size)
        stages = pp * self.chunks
        if source:  # its layers are counted from the built model: check_model (strategies/pipeline.py)
            if self.partition and len(self.partition) != stages - 1:
                raise ConfigError(f"strategy.partition = {self.partition}: {stages} stages need {stages - 1} cut "
                                  "points")
            self._check_batch(exp, pp, stages)
            return
        assert isinstance(layers, int)
        units = layers + EXTRA_LAYERS
        if stages > units:
            raise ConfigError(f"cluster.world_size = {exp.cluster.world_size}: {stages} stages "
                              f"({pp} {'pipeline ' if self.dp > 1 else ''}ranks x {self.chunks} per rank) but the model has only "
                              f"{units} layers ({layers} blocks + embedding + head)")
        if self.partition:
            check_cuts(self.partition, stages, units)
        elif stages > layers:
            raise ConfigError(f"cluster.world_size = {exp.cluster.world_size}: {stages} stages for {layers} blocks; "
                              "the equal-layer default needs a block per stage (give strategy.partition)")
        self._check_batch(exp, pp, stages)

    def _check_batch(self, exp: "Experiment", pp: int, stages: int) -> None:
        """What holds for any model: the recompute stages exist, the batch cuts into micro-batches."""
        if any(not 0 <= s < stages for s in self.recompute):
            raise ConfigError(f"strategy.recompute = {self.recompute}: stage indices must be within 0..{stages - 1}")
        if exp.workload.batch_size % (self.micro_batches * self.dp):
            times_dp = f" x strategy.dp = {self.micro_batches * self.dp}" if self.dp > 1 else ""
            raise ConfigError(f"workload.batch_size = {exp.workload.batch_size}: must be divisible by "
                              f"strategy.micro_batches = {self.micro_batches}{times_dp}")
        rounds = max(1, self.micro_batches // pp)
        if self.schedule in MULTI_STAGE_SCHEDULES and self.micro_batches % rounds:
            raise ConfigError(f"strategy.micro_batches = {self.micro_batches}: schedule {self.schedule!r} needs a "
                              f"multiple of micro_batches // world_size = {rounds}")

    def stages(self) -> int | None:
        """Stages in one pipeline (pipeline ranks x chunks), once check_experiment has seen the world size."""
        return None if self._world_size is None else self.pipeline_ranks(self._world_size) * self.chunks

    def pipeline_ranks(self, world_size: int) -> int:
        """Ranks in one pipeline (world_size / dp)."""
        return world_size // self.dp

    def cuts(self, layers: int, ranks: int) -> list[int]:
        """Where each stage starts, over the layer sequence of a GPT with `layers` blocks."""
        return self.partition or equal_block_cuts(layers, ranks * self.chunks)


def is_model_source(workload_name: str) -> bool:
    """`torchvision:NAME`, `timm:NAME`, `hf:ARCH`, `module:...`: a model ddlscope did not write."""
    return ":" in workload_name


def check_cuts(cuts: list[int], stages: int, units: int) -> None:
    """Cut points must be stages - 1 strictly increasing indices in 1..units-1 (no empty stage)."""
    if len(cuts) != stages - 1:
        raise ConfigError(f"strategy.partition = {cuts}: {stages} stages need {stages - 1} cut points")
    bounds = [0, *cuts, units]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ConfigError(f"strategy.partition = {cuts}: cut points must increase strictly within 1..{units - 1} "
                          f"(the model has {units} layers; every stage needs one)")


def equal_block_cuts(layers: int, stages: int) -> list[int]:
    """The naive partition: blocks split as evenly as possible, the embedding with the first stage and
    the head with the last (Megatron-LM's layout). Layer index 0 is the embedding, block i is i + 1."""
    return [1 + (s * layers) // stages for s in range(1, stages)]


def stage_ranges(cuts: list[int], units: int) -> list[tuple[int, int]]:
    """[start, stop) layer indices of each stage."""
    bounds = [0, *cuts, units]
    return list(zip(bounds, bounds[1:]))
