"""`ddlscope buckets RUN`: MG-WFBP's bucket plan for a run, its predicted exposed communication, and the
baselines (DDP's size buckets, one bucket per layer), against what the run measured.

The layers and the all-reduce's alpha-beta are the run's own where DDP planned its buckets (the run's
`bucket_plan` event: layers timed on rank 0 before training, the emulated link or an all-reduce probe);
for any other run the layers are timed here, on this machine, and the link is the run's emulated network,
else this machine's calibrated all-reduce fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddlscope.analysis.summary import summarize
from ddlscope.calibrate.model import collective_fit, emulated_link, required
from ddlscope.calibrate.profile import resolve_calibration
from ddlscope.runtime.config import experiment_from_dict
from ddlscope.specs import ConfigError
from ddlscope.specs import bucketing as plans
from ddlscope.specs.wire import WIRE_FACTORS
from ddlscope.store import Run, Store
from ddlscope.strategies.bucketing import gradient_layers
from ddlscope.workloads import WORKLOADS


@dataclass
class BucketReport:
    run_id: int
    used: plans.BucketPlan | None  # the plan the run's DDP applied (None: DDP's size buckets)
    link: plans.AlphaBeta
    source: str  # where layers and link come from
    plans: list[plans.BucketPlan]  # optimal (MG-WFBP), one per layer, DDP's size buckets
    measured_exposed_s: float | None

    def to_dict(self) -> dict[str, Any]:
        def one(plan: plans.BucketPlan) -> dict[str, Any]:
            return {"name": plan.name, "buckets": [list(b) for b in plan.buckets], "bucket_bytes": plan.bucket_bytes(),
                    "predicted_exposed_s": plan.exposed_s, "backward_s": plan.backward_s}

        return {"run": self.run_id, "source": self.source, "alpha_s": self.link.alpha_s,
                "beta_s_per_byte": self.link.beta_s_per_byte,
                "layers": [{"name": l.name, "backward_s": l.backward_s, "grad_bytes": l.grad_bytes}
                           for l in self.plans[0].layers],
                "used": one(self.used) if self.used else None, "plans": [one(p) for p in self.plans],
                "measured_exposed_s": self.measured_exposed_s}


def bucket_report(store: Store, run: Run, calibration: Path | None = None) -> BucketReport:
    exp = experiment_from_dict(run.config)
    if "buckets" not in type(exp.strategy).model_fields:  # the strategies whose gradients go in DDP's buckets
        raise ConfigError(f"run {run.id} uses strategy {exp.strategy.name!r}, which has no gradient buckets to plan "
                          "(a strategy with a `buckets` knob: ddlscope strategies)")
    used, link, source = _planned_at_run(store, run)
    if used is None:
        layers = _layers_here(exp)
        link, source = _link_of(store, run, exp.cluster.world_size, calibration)
    else:
        layers = list(used.layers)
    bucket_mb = float(getattr(exp.strategy, "bucket_mb", 25.0))
    compared = [plans.optimal_plan(layers, link), plans.per_layer_plan(layers, link),
                plans.size_plan(layers, link, bucket_mb * 2**20)]
    summary = summarize(store, run)
    return BucketReport(run.id, used, link, source, compared, summary.comm.get("exposed_s") if summary.comm else None)


def _planned_at_run(store: Store, run: Run) -> tuple[plans.BucketPlan | None, Any, str]:
    for event in store.events(run.id):
        if event["kind"] == plans.PLAN_EVENT:
            plan, link = plans.plan_from_json(event["message"])
            return plan, link, "the run's own plan (layers timed on rank 0 before training)"
    return None, None, ""


def _layers_here(exp: Any) -> list[plans.Layer]:
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    x, y = task.train.get(torch.arange(exp.per_rank_batch()) % max(len(task.train), 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank computes (the launcher sets OMP_NUM_THREADS=1)
    try:
        return gradient_layers(task.model, task.loss_fn, x, y, repeats=5)
    finally:
        torch.set_num_threads(threads)


def _link_of(store: Store, run: Run, ranks: int, calibration: Path | None) -> tuple[plans.AlphaBeta, str]:
    link = emulated_link(run.environment)
    if link is not None:
        alpha_s, bandwidth = link
        return (plans.AlphaBeta(alpha_s, WIRE_FACTORS["all_reduce"](max(ranks, 2)) / bandwidth),
                "layers timed here; the run's emulated network")
    profile, where = resolve_calibration(store, calibration, run.host)
    fit = collective_fit(profile, "all_reduce", ranks)
    beta = 1.0 / float(required(fit.beta_bytes_per_s, "all_reduce beta_bytes_per_s"))
    return plans.AlphaBeta(float(required(fit.alpha_s, "all_reduce alpha_s")), beta), \
        f"layers timed here; the calibrated all-reduce ({where})"
