"""`fsdp`: torch's FSDP2 (`fully_shard`) on a 1-D device mesh over all ranks.

Parameters, gradients and optimizer state are sharded (dim 0) across ranks;
each FSDP unit all-gathers its parameters before its forward (and again before
its backward when resharded after forward) and reduce-scatters its gradients
after its backward. The batch is split across ranks as in DDP.

Every all-gather and reduce-scatter goes through a timed wrapper of FSDP's own
default collective (`set_custom_all_gather` / `set_custom_reduce_scatter`), so
the step records real bytes and intervals. What the step columns mean for
FSDP is in `FSDP.comm_stats`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from ddlscope.specs import ConfigError, StrategySpec
from ddlscope.specs.strategies.fsdp import FSDPSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.base import AttachedCommStats, RunContext, Strategy
from ddlscope.strategies.comm import CommRecorder, CommStats, Pending
from ddlscope.strategies.units import wrap_units

clock = time.perf_counter


@RUNTIMES.register(FSDPSpec)
class FSDP(Strategy):
    spec: FSDPSpec

    def __init__(self, spec: StrategySpec, ctx: RunContext):
        super().__init__(spec, ctx)
        self._timer = _CollectiveTimer(self.comm)
        self._root: nn.Module | None = None
        self._units: list[FSDPModule] = []
        self._forward_end_s = float("-inf")

    @classmethod
    def check_model(cls, spec: StrategySpec, model: nn.Module) -> None:
        if spec.wrap == "block":  # type: ignore[attr-defined]
            wrap_units(model, spec.wrap_class)  # type: ignore[attr-defined]

    def wrap(self, model: nn.Module) -> nn.Module:
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        mp_policy = mixed_precision_policy(self.spec.mixed_precision, self.ctx.device)
        if self.spec.wrap == "block":
            for unit in wrap_units(model, self.spec.wrap_class):
                fully_shard(unit, mesh=mesh, reshard_after_forward=self.spec.reshard_after_forward,
                            mp_policy=mp_policy)
        # The root keeps torch's default (None): it is not resharded after
        # forward, because backward would gather it again at once.
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        self._root = model
        self._units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        time_fsdp_collectives(self._units, self.comm, self._timer)
        model.register_forward_hook(self._after_forward)
        return model

    @classmethod
    def wraps(cls, model: nn.Module) -> bool:
        return any(isinstance(m, FSDPModule) for m in model.modules())

    @classmethod
    def time_attached(cls, model: nn.Module, recorder: CommRecorder) -> tuple[AttachedCommStats, str]:
        timer = time_fsdp_collectives([m for m in model.modules() if isinstance(m, FSDPModule)], recorder)
        return timer.comm_stats, ""

    def comm_stats(self, backward_end_s: float) -> CommStats:
        """Communication of the step just finished.

        FSDP communicates in forward too (all-gathers), and on CPU/gloo every
        collective FSDP issues is synchronous (it uses no async ops by default
        and there are no streams to overlap on), so none of it is hidden
        behind compute. What the step row means for FSDP:

        - bytes_sent: input bytes of every all-gather (this rank's parameter
          shards, in param dtype) and reduce-scatter (this rank's full unsharded
          gradients, in reduce dtype) of the step.
        - comm_s: wall time with at least one collective in flight (launch to
          completion, forward and backward).
        - comm_wait_s: time the training thread spent blocked on collectives,
          in forward (all-gathers) and in backward (all-gathers when resharded
          after forward, and all reduce-scatters), measured in the collective call (sync ops) or
          inside Work.wait() (async ops). FSDP has no step after backward
          (`synchronize` is a no-op), so that part is ~0.
        - backward_s: backward wall time minus that blocked time: backward
          compute (plus FSDP's local copy-in/copy-out and bookkeeping).
        - forward_s: forward wall time minus the time blocked on forward
          all-gathers, which count in comm_wait_s as well (exposed_in_forward_s).

        On CUDA/NCCL a synchronous collective only enqueues work, so blocked
        time (and the recorded completion) is host time, not GPU time; it
        understates communication there.
        """
        return self._timer.comm_stats(backward_end_s, self._forward_end_s)

    def discard_comm_stats(self) -> None:
        super().discard_comm_stats()
        self._timer.pop_blocked()

    # --- forward hooks --------------------------------------------------------

    def _after_forward(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._forward_end_s = clock()


def mixed_precision_policy(mode: str, device: torch.device) -> MixedPrecisionPolicy:
    if mode == "none":
        return MixedPrecisionPolicy()
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"strategy.mixed_precision = 'bf16': {torch.cuda.get_device_name(device)} does not support bf16; "
            "use mixed_precision = 'none'")
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# --- timed collectives ------------------------------------------------------


def time_fsdp_collectives(units: list[FSDPModule], recorder: CommRecorder,
                          timer: "_CollectiveTimer | None" = None) -> "_CollectiveTimer":
    """Time every all-gather and reduce-scatter of these FSDP2 units into `recorder` (also for a model
    the user sharded: runtime/attach.py); the timer splits each step's blocked time (`comm_stats`)."""
    timer = timer or _CollectiveTimer(recorder)
    for unit in units:
        unit.set_custom_all_gather(_TimedAllGather(timer))
        unit.set_custom_reduce_scatter(_TimedReduceScatter(timer))
    return timer


class _CollectiveTimer:
    """Records each FSDP collective in the strategy's CommRecorder, plus how
    long the calling thread was blocked on it (its exposed communication)."""

    def __init__(self, recorder: CommRecorder):
        self.recorder = recorder
        self._blocked: list[tuple[float, float]] = []  # (launch time, seconds the caller was blocked)

    def run(self, kind: str, payload_bytes: int, group: dist.ProcessGroup, async_op: bool,
            start: Callable[[bool], dist.Work | None]) -> dist.Work | None:
        pending = self.recorder.launched(payload_bytes, kind, group.size())
        work = start(async_op)
        if async_op and work is not None:
            return self.recorder.complete_work(work, pending, lambda since_s: self._blocked_since(pending, since_s))
        # A sync op has completed when it returns; what an emulated link still owes is waited
        # out in `completed`, with the caller blocked, so emulated delay counts as exposed too.
        self.recorder.completed(pending)
        self._blocked_since(pending, pending.launch_s)
        return work

    def _blocked_since(self, pending: Pending, since_s: float) -> None:
        self._blocked.append((pending.launch_s, clock() - since_s))

    def comm_stats(self, backward_end_s: float, forward_end_s: float) -> CommStats:
        """The step's communication: the recorder's bytes and in-flight time, and the blocked time
        split at the forward's end (all-gathers in forward) and backward's (see FSDP.comm_stats)."""
        stats = self.recorder.pop(backward_end_s)
        blocked = self.pop_blocked()
        in_forward = sum(s for launch_s, s in blocked if launch_s < forward_end_s)
        in_backward = sum(s for launch_s, s in blocked if forward_end_s <= launch_s <= backward_end_s)
        return CommStats(stats.bytes_sent, stats.total_s, in_backward, in_forward)

    def pop_blocked(self) -> list[tuple[float, float]]:
        blocked, self._blocked = self._blocked, []
        return blocked


class _TimedAllGather(DefaultAllGather):
    def __init__(self, timer: _CollectiveTimer):
        self._timer = timer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        # payload: this rank's shard of the unit's parameters (in param dtype)
        return self._timer.run(
            "all_gather", input_tensor.nbytes, group, async_op,
            lambda a: super(_TimedAllGather, self).__call__(output_tensor, input_tensor, group, a))


class _TimedReduceScatter(DefaultReduceScatter):
    def __init__(self, timer: _CollectiveTimer):
        self._timer = timer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        # payload: the unit's full unsharded gradients (in reduce dtype)
        return self._timer.run(
            "reduce_scatter", input_tensor.nbytes, group, async_op,
            lambda a: super(_TimedReduceScatter, self).__call__(output_tensor, input_tensor, group, op, a))
