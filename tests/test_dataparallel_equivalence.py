"""Each local-SGD-family strategy equals a known one in the case where it must, and differs where it must.

Two ranks, started once through the project's launcher (launch_processes), train every configuration
below in turn with the real training loop (runtime/loop.py) on one gloo group: mlp-digits, plain SGD,
7 steps, so that period 3 averages after steps 0, 3 and 6 (torch's schedule). The final parameters
and each rank's step rows come back to the test.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.multiprocess

STEPS = 7
COMMON = {"workload.name": "mlp-digits", "workload.steps": STEPS, "workload.batch_size": 32,
          "workload.lr": 0.2, "workload.eval_batches": 1, "cluster.world_size": 2, "seed": 3}
CONFIGS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy.name": "ddp"},
    "localsgd-1": {"strategy.name": "localsgd", "strategy.period": 1},
    "gossip-complete": {"strategy.name": "gossip", "strategy.topology": "complete"},
    "hpsgd-0": {"strategy.name": "hpsgd", "strategy.staleness": 0},
    "hpsgd-1": {"strategy.name": "hpsgd", "strategy.staleness": 1},
    "osp-1": {"strategy.name": "osp", "strategy.fraction": 1.0},
    "osp": {"strategy.name": "osp", "strategy.fraction": 0.5},
    "localsgd-3": {"strategy.name": "localsgd", "strategy.period": 3},
    "cocod-forced": {"strategy.name": "cocod", "strategy.period": 3, "strategy.overlap": False},
    "cocod": {"strategy.name": "cocod", "strategy.period": 3},
    "diloco-plain": {"strategy.name": "diloco", "strategy.period": 3, "strategy.outer_lr": 1.0,
                     "strategy.outer_momentum": 0.0},
    "diloco": {"strategy.name": "diloco", "strategy.period": 3},
    "localsgd-warmup": {"strategy.name": "localsgd", "strategy.period": 3, "strategy.warmup_steps": 2},
    "localsgd-2": {"strategy.name": "localsgd", "strategy.period": 2},
    # Hierarchical, with the group the whole (2-rank) world: every group_period steps, like localsgd-2.
    "hierarchical": {"strategy.name": "localsgd", "strategy.period": 4, "strategy.group_period": 2,
                     "strategy.group_size": 2},
    # localsgd's compressed average (docs/compression.md): the change since the last average in 16 bits
    "localsgd-3-bf16": {"strategy.name": "localsgd", "strategy.period": 3, "strategy.compression": "bf16"},
    "localsgd-3-fp16": {"strategy.name": "localsgd", "strategy.period": 3, "strategy.compression": "fp16"},
}


def train_all(out_dir: str, configs: dict[str, dict[str, Any]], world: int) -> dict[str, Any]:
    """One rank: every configuration in turn; each rank returns its final models and its step rows."""
    import torch.distributed as dist

    from rank_runs import records, train_rank

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    models, rows = {}, {}
    try:
        for label, overrides in configs.items():
            models[label], run_rows = train_rank({**COMMON, "cluster.world_size": world, **overrides}, rank, world,
                                                 Path(out_dir) / f"{label}-{rank}.jsonl", whole_model=False)
            rows[label] = records(run_rows, "step")
    finally:
        dist.destroy_process_group()
    return {"models": models, "rows": rows}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    from ddlscope.runtime.launcher import launch_processes

    out = tmp_path_factory.mktemp("dataparallel")
    return launch_processes(train_all, (str(out), CONFIGS, 2), 2, run_id=f"dp-eq-{os.getpid()}")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("label, reference", [
    ("localsgd-1", "ddp"),            # H = 1 with plain SGD: averaging models = averaging gradients
    ("hpsgd-0", "ddp"),               # staleness 0: the step's own average, at once
    ("osp-1", "ddp"),                 # everything in the first stage
    ("gossip-complete", "localsgd-1"),  # the complete graph's mean is everybody's (4 ranks: test_dataparallel_gossip)
    ("cocod-forced", "localsgd-3"),   # the average completes before the next step
    ("diloco-plain", "localsgd-3"),   # outer lr 1, no momentum: the anchor becomes the average
    ("hierarchical", "localsgd-2"),   # the group is the world: averages every group_period steps
])
def test_equals_its_reference(trained, label: str, reference: str):
    models = trained[0]["models"]
    assert max_difference(models[label], models[reference]) < 1e-6


@pytest.mark.timeout(240)
@pytest.mark.parametrize("label, reference, at_least, at_most", [
    ("localsgd-3", "ddp", 1e-4, 0.5),   # drift between averages: not DDP, but not far from it
    ("hpsgd-1", "ddp", 1e-4, 0.5),      # one step stale
    ("osp", "ddp", 1e-5, 0.5),          # the second stage's local stand-in, corrected a step later
    ("cocod", "localsgd-3", 1e-4, 0.5),  # the average lands a round late
    ("diloco", "localsgd-3", 1e-3, 5.0),  # outer Nesterov momentum moves it further
])
def test_differs_where_it_must(trained, label: str, reference: str, at_least: float, at_most: float):
    models = trained[0]["models"]
    assert at_least < max_difference(models[label], models[reference]) < at_most


@pytest.mark.timeout(240)
def test_every_rank_ends_with_the_same_model_after_a_final_average(trained):
    # Period 3 over 7 steps averages after the last step; hpsgd's models never diverge; osp's differ by the
    # local stand-in of its second stage until the correction, and its last step leaves none.
    for label in ("localsgd-3", "cocod", "diloco", "hpsgd-1", "osp"):
        assert max_difference(trained[0]["models"][label], trained[1]["models"][label]) < 1e-6, label


@pytest.mark.timeout(240)
def test_bytes_are_sent_only_when_averaging_and_counted_once(trained):
    rows = trained[1]["rows"]
    model_bytes = rows["ddp"][0]["bytes_sent"]  # DDP: one gradient all-reduce of the whole model
    assert model_bytes > 0 and all(r["bytes_sent"] == model_bytes for r in rows["ddp"])
    for label in ("localsgd-3", "cocod", "diloco"):
        assert [r["bytes_sent"] for r in rows[label]] == [model_bytes if s in (0, 3, 6) else 0 for s in range(STEPS)]
    # Warm-up: DDP's gradient all-reduce for steps 0 and 1, then averages after steps 2 and 5.
    assert [r["bytes_sent"] for r in rows["localsgd-warmup"]] == [
        model_bytes if s in (0, 1, 2, 5) else 0 for s in range(STEPS)]
    assert all(r["bytes_sent"] == model_bytes for r in rows["hpsgd-1"])
    assert all(r["bytes_sent"] == model_bytes for r in rows["osp"])  # two stages, the whole gradient once


@pytest.mark.timeout(240)
def test_warmup_steps_train_like_ddp(trained):
    """The losses of steps 0-2 follow the models after warm-up steps 0 and 1: DDP's, on every rank."""
    for rank in (0, 1):
        rows = trained[rank]["rows"]
        warm = [r["loss"] for r in rows["localsgd-warmup"][:3]]
        assert warm == pytest.approx([r["loss"] for r in rows["ddp"][:3]], abs=1e-6)
        plain = [r["loss"] for r in rows["localsgd-3"][:3]]
        assert abs(plain[2] - warm[2]) > 1e-6  # without warm-up, step 1 was already local


@pytest.mark.timeout(240)
def test_phases_add_up_and_the_average_is_communication(trained):
    from phase_checks import assert_step_phases

    for label, overrides in CONFIGS.items():
        for rank in (0, 1):
            assert_step_phases(trained[rank]["rows"][label], overrides["strategy.name"])
    rows = trained[0]["rows"]
    # An average is in flight some time; the blocking one shows as waiting.
    assert all(r["comm_s"] > 0 for r in rows["localsgd-3"] if r["bytes_sent"])
    assert all(r["comm_wait_s"] >= r["comm_s"] * 0.5 for r in rows["localsgd-3"] if r["bytes_sent"])


# ---------------------------------------------------------------------------- localsgd's compressed average
@pytest.mark.timeout(240)
@pytest.mark.parametrize("label, at_most", [("localsgd-3-bf16", 1e-2), ("localsgd-3-fp16", 1e-3)])
def test_a_compressed_average_is_close_to_the_fp32_one_at_half_the_bytes(trained, label: str, at_most: float):
    models, rows = trained[0]["models"], trained[1]["rows"]
    assert 0 < max_difference(models[label], models["localsgd-3"]) < at_most  # 16 bits of the change, not exact
    assert max_difference(trained[0]["models"][label], trained[1]["models"][label]) < 1e-6  # one average for all
    full = [r["bytes_sent"] for r in rows["localsgd-3"]]
    assert [r["bytes_sent"] for r in rows[label]] == [b // 2 for b in full] and max(full) > 0
