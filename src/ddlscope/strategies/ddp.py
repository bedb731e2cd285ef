"""`ddp`: torch DistributedDataParallel with its own comm hooks.

Every hook (including the default all-reduce) is wrapped in a timing hook, so
the loop learns each bucket's launch and completion time and payload bytes,
and can split backward into compute and exposed communication wait.
Compression hooks live in strategies/compression.py; bucket plans (one per
layer, MG-WFBP) in strategies/bucketing.py and specs/bucketing.py.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddlscope.specs import bucketing as plans
from ddlscope.specs.strategies.ddp import DDPSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.base import AttachedCommStats
from ddlscope.strategies.batching import SplitBatch
from ddlscope.strategies.comm import CommRecorder
from ddlscope.strategies.bucketing import (
    bucket_caps_mb, gradient_layers, link_alpha_beta, probe_alpha_beta, same_on_every_rank)
from ddlscope.strategies.compression import compression_hook, timed_hook
from ddlscope.workloads import WORKLOADS

log = logging.getLogger(__name__)


@RUNTIMES.register(DDPSpec)
class DDP(SplitBatch):  # batch_split: strategies/batching.py
    spec: DDPSpec

    def wrap(self, model: nn.Module) -> nn.Module:
        on_cuda = self.ctx.device.type == "cuda"
        self.bucket_plan, self.bucket_link = self._bucket_plan(model)
        buckets: dict[str, Any] = {"bucket_cap_mb": self.spec.bucket_mb}
        self.setup_events: list[tuple[str, str]] = []
        if self.bucket_plan is not None:
            self.setup_events.append((plans.PLAN_EVENT, plans.plan_to_json(self.bucket_plan, self.bucket_link)))
            buckets = {"bucket_cap_mb_list": bucket_caps_mb(self.bucket_plan.bucket_bytes())}
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.ctx.device.index] if on_cuda else None,
            gradient_as_bucket_view=self.spec.gradient_as_bucket_view,
            static_graph=self.spec.static_graph,
            **buckets,
        )
        spec = self.spec
        chosen = compression_hook(spec.comm_hook, powersgd_rank=spec.powersgd_rank,
                                  powersgd_start_iter=spec.powersgd_start_iter, topk_ratio=spec.topk_ratio,
                                  qsgd_levels=spec.qsgd_levels, seed=self.ctx.experiment.seed * 1000 + self.ctx.rank,
                                  serialise_buckets=self.ctx.backend == "gloo")
        ddp.register_comm_hook(chosen.state, timed_hook(chosen.hook, chosen.payload_bytes, self.comm, chosen.kind))
        return ddp

    @classmethod
    def wraps(cls, model: nn.Module) -> bool:
        return isinstance(model, DistributedDataParallel)

    @classmethod
    def time_attached(cls, model: nn.Module, recorder: CommRecorder) -> tuple[AttachedCommStats, str]:
        """torch's default all-reduce inside the timing hook, unless the user registered a hook (DDP takes one)."""
        stats: AttachedCommStats = lambda backward_end_s, _forward_end_s: recorder.pop(backward_end_s)  # noqa: E731
        if getattr(model, "_comm_hooks", None):
            return stats, "the model already has a DDP comm hook: its all-reduces are not timed"
        hook = compression_hook("none", group=model.process_group)
        model.register_comm_hook(hook.state, timed_hook(hook.hook, hook.payload_bytes, recorder, hook.kind))
        return stats, ""

    def _bucket_plan(self, model: nn.Module) -> tuple[plans.BucketPlan | None, plans.AlphaBeta | None]:
        """The spec's plan over measured layers (rank 0's, on every rank), or None for DDP's size buckets."""
        if self.spec.buckets == "size":
            return None, None
        link = (link_alpha_beta(self.ctx.link, self.ctx.workers) if self.ctx.link is not None
                else probe_alpha_beta())  # a collective: every rank probes
        plan = None
        if self.ctx.rank == 0:  # rank 0's layer times decide; the others wait for its plan
            exp = self.ctx.experiment
            task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
            x, y = task.train.get(torch.arange(exp.per_rank_batch()) % max(len(task.train), 1))  # the first batch
            layers = gradient_layers(model, task.loss_fn, x.to(self.ctx.device), y.to(self.ctx.device))
            plan = (plans.optimal_plan(layers, link) if self.spec.buckets == "mgwfbp"
                    else plans.per_layer_plan(layers, link))
        plan, link = same_on_every_rank((plan, link))
        log.info("bucket plan %s: %d buckets, predicted exposed %.4f s", plan.name, len(plan.buckets), plan.exposed_s)
        return plan, link
