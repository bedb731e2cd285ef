"""`ddp`: torch DistributedDataParallel with its own comm hooks.

Every hook (including the default all-reduce) is wrapped in a timing hook, so
the loop learns each bucket's launch and completion time and payload bytes,
and can split backward into compute and exposed communication wait.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ddlscope.specs.strategies.ddp import DDPSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.batching import SplitBatch
from ddlscope.strategies.comm import CommRecorder

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@RUNTIMES.register(DDPSpec)
class DDP(SplitBatch):  # batch_split: strategies/batching.py
    spec: DDPSpec

    def wrap(self, model: nn.Module) -> nn.Module:
        on_cuda = self.ctx.device.type == "cuda"
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.ctx.device.index] if on_cuda else None,
            bucket_cap_mb=self.spec.bucket_mb,
            gradient_as_bucket_view=self.spec.gradient_as_bucket_view,
            static_graph=self.spec.static_graph,
        )
        state, hook, payload_bytes = self._hook()
        ddp.register_comm_hook(state, timed_hook(hook, payload_bytes, self.comm))
        return ddp

    def _hook(self) -> tuple[Any, Hook, Callable[[Any, dist.GradBucket], int]]:
        if self.spec.comm_hook == "fp16":
            return None, default_hooks.fp16_compress_hook, lambda _s, b: b.buffer().numel() * 2
        if self.spec.comm_hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.spec.powersgd_rank,
                start_powerSGD_iter=self.spec.powersgd_start_iter,
            )
            return state, powerSGD_hook.powerSGD_hook, _powersgd_payload_bytes
        return None, default_hooks.allreduce_hook, bucket_bytes


def bucket_bytes(_state: Any, bucket: dist.GradBucket) -> int:
    """What a plain all-reduce of the bucket sends."""
    return bucket.buffer().numel() * bucket.buffer().element_size()


def timed_hook(hook: Hook, payload_bytes: Callable[[Any, dist.GradBucket], int], recorder: CommRecorder) -> Hook:
    # No annotations on the hook's parameters: DDP rejects a `bucket` annotation
    # that is not the GradBucket class itself, and postponed annotations are strings.
    def hook_with_timing(state, bucket):  # type: ignore[no-untyped-def]
        pending = recorder.launched(payload_bytes(state, bucket), "all_reduce")
        return recorder.complete_future(hook(state, bucket), pending)

    return hook_with_timing


def _powersgd_payload_bytes(state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket) -> int:
    """Bytes PowerSGD all-reduces for this bucket, mirroring torch's own choice.

    Before start_powerSGD_iter the hook runs a plain all-reduce. After it,
    matrices worth compressing send their P and Q factors ((rows + cols) x
    rank), everything else (biases, small matrices) goes uncompressed.
    """
    element_bytes = bucket.buffer().element_size()
    if state.iter < state.start_powerSGD_iter:
        return bucket.buffer().numel() * element_bytes
    total = 0
    for grad in bucket.gradients():
        if grad.ndim > 1:
            rows, cols = grad.shape[0], grad.numel() // grad.shape[0]
            worth, full, compressed = powerSGD_hook._should_compress(
                rows, cols, state.matrix_approximation_rank, state.min_compression_rate)
            total += compressed if worth else full
        else:
            total += grad.numel()
    return total * element_bytes
