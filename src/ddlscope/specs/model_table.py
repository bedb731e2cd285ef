"""The model table, torch-free: what one model is, per layer, as every memory and time estimate reads it.

One trace of the model (workloads/model_table.py: fake tensors, no memory
allocated) fills it; predict prices it (predict/model_memory.py) without
torch. A row is one module, the innermost one running when an op ran (a leaf
layer, or a block whose own forward calls functional ops such as attention);
`(loss)` holds what the loss saves. Counts follow the runtime's conventions
(runtime/instrument.py) so that an estimate and a measured run agree:

- parameters: each distinct parameter once (tied weights count once), on the
  first module that owns it, with its first dimension (what FSDP shards);
- activations: the distinct storages autograd saves for backward during the
  forward and the loss, parameters excluded, each on the first row that saved
  it, at `traced_batch` samples;
- FLOPs: forward only, per row (torch's flop formulas; CPU flash attention
  counted as the math kernel would be); backward is priced as twice the
  forward (two GEMMs per forward GEMM).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

BACKWARD_FLOPS_PER_FORWARD = 2.0  # dX and dW: two GEMMs of the forward's size per forward GEMM


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ParamEntry(_Frozen):
    """One distinct parameter tensor."""

    numel: int = Field(ge=0)
    dim0: int = Field(ge=1, description="first dimension (1 for a scalar): what FSDP's Shard(0) splits")
    element_bytes: int = Field(ge=1)
    trainable: bool = True

    @property
    def bytes(self) -> int:
        return self.numel * self.element_bytes


class Gemm(_Frozen):
    """A forward matmul or convolution as a GEMM: batch x (m, k) @ (k, n)."""

    batch: int
    m: int
    k: int
    n: int
    conv: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.k * self.n


class LayerRow(_Frozen):
    name: str = Field(description="module path in the model ('' the root, '(loss)' the loss)")
    kind: str = Field(description="module class name")
    unit: int | None = Field(None, description="index of the FSDP unit holding it (strategies/units.py); None: root")
    params: tuple[ParamEntry, ...] = ()
    buffer_bytes: int = 0
    forward_flops: float = 0.0
    gemms: tuple[Gemm, ...] = ()
    activation_bytes: int = Field(0, description="bytes saved for backward at the table's traced_batch")

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def param_bytes(self) -> int:
        return sum(p.bytes for p in self.params)


class UnitRow(_Frozen):
    """An FSDP unit (a repeated block): what recompute of it keeps (its input) and rebuilds."""

    index: int
    name: str
    input_bytes: int = Field(description="distinct storages of its tensor inputs at traced_batch: all recompute keeps")
    activation_bytes: int = Field(description="what its rows save without recompute, at traced_batch")


class ModelTable(_Frozen):
    model: str
    traced_batch: int = Field(ge=1, description="samples per rank the activation bytes were counted at")
    counted_on: str = Field("fake", description="fake (no memory), or cpu where an op had no fake kernel")
    layers: tuple[LayerRow, ...]
    units: tuple[UnitRow, ...] = ()
    activation_bytes_recompute: int = Field(
        description="distinct storages kept with every unit recomputed: the rows outside units plus each unit's "
                    "input, at traced_batch")

    # ---- totals
    @property
    def params(self) -> tuple[ParamEntry, ...]:
        return tuple(p for row in self.layers for p in row.params)

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def param_bytes(self) -> int:
        return sum(p.bytes for p in self.params)

    @property
    def trainable_bytes(self) -> int:
        return sum(p.bytes for p in self.params if p.trainable)

    @property
    def buffer_bytes(self) -> int:
        return sum(row.buffer_bytes for row in self.layers)

    @property
    def forward_flops(self) -> float:
        return sum(row.forward_flops for row in self.layers)

    @property
    def step_flops(self) -> float:
        return self.forward_flops * (1.0 + BACKWARD_FLOPS_PER_FORWARD)

    @property
    def activation_bytes(self) -> int:
        return sum(row.activation_bytes for row in self.layers)

    def activation_bytes_per_sample(self, recompute: bool = False) -> float:
        kept = self.activation_bytes_recompute if recompute else self.activation_bytes
        return kept / self.traced_batch

    @property
    def largest_unit_activation_bytes(self) -> int:
        """Recompute rebuilds one unit at a time in backward: its activations on top of what is kept."""
        return max((u.activation_bytes for u in self.units), default=0)

    def unit_param_bytes(self) -> list[int]:
        """Parameter bytes per FSDP unit, the root's (rows outside every unit) last."""
        per_unit = [0] * len(self.units)
        root = 0
        for row in self.layers:
            if row.unit is None:
                root += row.param_bytes
            else:
                per_unit[row.unit] += row.param_bytes
        return per_unit + [root]
