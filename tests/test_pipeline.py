"""`pipeline` on torch.distributed.pipelining: every schedule trains like one process, and GPipe's and
1F1B's in-flight activations follow REFERENCE.md; `tp` (DTensor tensor parallel) trains like one
process too and holds 1/t of each block's weights. The schedules' bubbles are timed by
benchmarks/pipeline_bubble.py, not here: on a shared machine a timed bubble fails on noise.

Two ranks run the runtime's own loop (runtime/loop.py: train) with the Pipeline strategy, all schedules
one after another in one process group, so the suite starts processes once; the one-process reference
runs here. One launcher run (`ddlscope run`) is in tests/test_partition.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddlscope.runtime.config import load_experiment
from ddlscope.workloads import WORKLOADS
from phase_checks import assert_step_phases
from rank_runs import spawn_runs
from rank_runs import train_rank as _train

pytestmark = pytest.mark.multiprocess

WORLD = 2
# A small GPT for equality: 4 blocks -> 6 layers, 4 stages when interleaved (2 chunks per rank).
EQUAL = {"workload.name": "gpt-synthetic", "workload.layers": 4, "workload.hidden": 32, "workload.heads": 4,
         "workload.seq_len": 16, "workload.batch_size": 8, "workload.steps": 2, "workload.optimizer": "sgd",
         "workload.lr": 0.5, "workload.eval_batches": 1, "seed": 5}
# In-flight activations, counted (not timed): stage 0 keeps all m micro-batches' under GPipe, p under 1F1B.
INFLIGHT = {**EQUAL, "workload.hidden": 64, "workload.seq_len": 32, "workload.batch_size": 16, "workload.steps": 2}
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero-bubble": 2}
INFLIGHT_SCHEDULES = ("gpipe", "1f1b")
MICRO_BATCHES = 4


# Recompute (workload.recompute) under a schedule and under tp: the same training, to the same tolerance.
RECOMPUTED = ["1f1b+full", "interleaved+selective", "tp+full"]


def _overrides(base: dict, schedule: str | None) -> dict:
    if schedule is not None and "+" in schedule:
        schedule, recompute = schedule.split("+")
        base = {**base, "workload.recompute": recompute}
    if schedule is None:
        return {**base, "strategy.name": "single", "cluster.world_size": 1}
    if schedule == "tp":
        return {**base, "strategy.name": "tp", "cluster.world_size": WORLD}
    return {**base, "strategy.name": "pipeline", "cluster.world_size": WORLD, "strategy.schedule": schedule,
            "strategy.chunks": SCHEDULES[schedule], "strategy.micro_batches": MICRO_BATCHES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    spawn_runs(out, WORLD, [(f"{kind}-{schedule}", _overrides(base, schedule), None)
                            for kind, base in (("equal", EQUAL), ("inflight", INFLIGHT))
                            for schedule in ((*SCHEDULES, "tp", *RECOMPUTED) if kind == "equal" else INFLIGHT_SCHEDULES)])
    state, records = _train(_overrides(EQUAL, None), 0, 1, out / "single.jsonl")
    torch.save(state, out / "single.pt")
    (out / "single.json").write_text(json.dumps(records))
    return out


def _records(out: Path, name: str, kind: str) -> list[dict]:
    return [r for r in json.loads((out / f"{name}.json").read_text()) if r.get("kind") == kind]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", [*SCHEDULES, "tp", *RECOMPUTED])
def test_every_schedule_trains_like_one_process(runs: Path, schedule: str):
    """Every pipeline schedule, and tensor parallelism (`tp`), with and without recompute, on the same
    batches as one process."""
    single, piped = torch.load(runs / "single.pt"), torch.load(runs / f"equal-{schedule}.pt")
    assert list(piped) == list(single)  # the whole model, under the single-process names, in order
    initial = WORKLOADS.get("gpt-synthetic").build(load_experiment(None, _overrides(EQUAL, None)).workload, 5)
    moved = 0.0
    for name, before in initial.model.state_dict().items():
        # Two SGD steps at lr 0.5: parameters differ from the start by 0.5 x (sum of two gradients),
        # so equal parameters mean equal gradients (to 1e-5 / 0.5).
        torch.testing.assert_close(piped[name], single[name], atol=1e-5, rtol=0)
        moved = max(moved, (single[name] - before).abs().max().item())
    assert moved > 1e-2  # training moved the parameters: equality is not trivially true
    single_losses = [r["loss"] for r in _records(runs, "single", "step")]
    strategy = _overrides(EQUAL, schedule)["strategy.name"]
    for rank in range(WORLD):  # the last stage's loss, shared with every rank
        losses = [r["loss"] for r in _records(runs, f"equal-{schedule}-{rank}", "step")]
        assert losses == pytest.approx(single_losses, abs=1e-5)
        for kind in ("equal", "inflight") if schedule in INFLIGHT_SCHEDULES else ("equal",):
            assert_step_phases(_records(runs, f"{kind}-{schedule}-{rank}", "step"), strategy)
    # Evaluation runs the whole model across the stages: the same test loss as one process.
    single_eval = _records(runs, "single", "eval")[-1]["loss"]
    assert _records(runs, f"equal-{schedule}-0", "eval")[-1]["loss"] == pytest.approx(single_eval, abs=1e-5)


@pytest.mark.timeout(240)
def test_in_flight_activations_gpipe_m_1f1b_p_minus_stage(runs: Path):
    """Stage 0 holds all m micro-batches under GPipe, p under 1F1B; the last stage 1 under 1F1B."""
    peak = {(s, rank): next(r for r in _records(runs, f"inflight-{s}-{rank}", "memory"))["bytes"]["activations_peak"]
            for s in ("gpipe", "1f1b") for rank in range(WORLD)}
    assert peak[("gpipe", 0)] / peak[("1f1b", 0)] == pytest.approx(MICRO_BATCHES / WORLD, rel=0.05)
    assert peak[("gpipe", 1)] / peak[("1f1b", 1)] == pytest.approx(MICRO_BATCHES / 1, rel=0.05)


@pytest.mark.timeout(240)
def test_tensor_parallel_shards_the_blocks(runs: Path):
    """Each rank holds 1/t of every block's weights and all of the embeddings, norms and head."""
    single = torch.load(runs / "single.pt")
    # split: the QKV and fc weights and biases (colwise), the projections' weights (rowwise); their
    # biases are added after the all-reduce, so replicated, like the norms
    blocks = sum(t.numel() for n, t in single.items()
                 if n.startswith("blocks.") and ".ln_" not in n and not n.endswith("proj.bias"))
    rest = sum(t.numel() for n, t in single.items()) - blocks
    for rank in range(WORLD):
        memory = _records(runs, f"equal-tp-{rank}", "memory")[0]["bytes"]
        assert memory["parameters"] == 4 * (blocks // WORLD + rest)


@pytest.mark.timeout(240)
def test_tensor_parallel_activations_follow_korthikanti(runs: Path):
    """A rank keeps the replicated part of each block's activations whole and the rest 1/t: REFERENCE.md's
    s b h (10 + 24/t) against 34 s b h without parallelism, applied to the blocks' measured activations
    (embedding and head are replicated)."""
    from ddlscope.runtime.profiler import first_batch, profile_layers

    exp = load_experiment(None, _overrides(EQUAL, None))
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    layers = profile_layers(task.model, task.loss_fn, *first_batch(task.train, exp.workload.batch_size), repeats=1)
    blocks = sum(layer.activation_bytes for layer in layers[1:-1])
    rest = sum(layer.activation_bytes for layer in layers) - blocks
    single = _records(runs, "single", "memory")[0]["bytes"]["activations"]
    assert single == blocks + rest  # the profile counts what the one-process run measured
    predicted = rest + blocks * (10 + 24 / WORLD) / 34
    for rank in range(WORLD):
        measured = _records(runs, f"equal-tp-{rank}", "memory")[0]["bytes"]["activations"]
        assert 0.95 <= measured / predicted <= 1.05, (measured, predicted)
