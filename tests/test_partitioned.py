"""`partitioned` (PAPERS.md item 20): one part of the network per rank, each trained on its own loss
against synthetic targets; only forward activations travel between parts.

One part is one-process training (in-process). Two ranks run the runtime's loop twice in one process
group: as configured, and with part 0's own loss zeroed (no gradient reaches it from part 1, so its
parameters must not move).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddlscope.runtime.config import load_experiment
from ddlscope.specs import ConfigError
from ddlscope.workloads import WORKLOADS
from phase_checks import assert_step_phases
from rank_runs import records as _records
from rank_runs import spawn_runs
from rank_runs import train_rank as _train

WORLD = 2
BASE = {"workload.name": "mlp-digits", "workload.layers": 2, "workload.hidden": 32, "workload.batch_size": 32,
        "workload.steps": 40, "workload.optimizer": "sgd", "workload.lr": 0.5, "seed": 3}


def _overrides(strategy: str, world: int) -> dict:
    return {**BASE, "strategy.name": strategy, "cluster.world_size": world}


def test_one_part_is_one_process_training(tmp_path: Path):
    single, single_rows = _train(_overrides("single", 1), 0, 1, tmp_path / "single.jsonl")
    parted, parted_rows = _train(_overrides("partitioned", 1), 0, 1, tmp_path / "parted.jsonl")
    assert list(parted) == list(single)
    for name in single:
        torch.testing.assert_close(parted[name], single[name], atol=1e-6, rtol=0)
    assert ([r["loss"] for r in _records(parted_rows, "step")]
            == pytest.approx([r["loss"] for r in _records(single_rows, "step")], abs=1e-6))
    assert _records(parted_rows, "eval")[-1]["metric"] == _records(single_rows, "eval")[-1]["metric"]


def test_partition_knob_is_checked():
    with pytest.raises(ConfigError, match="cut points"):
        load_experiment(None, {**_overrides("partitioned", 2), "strategy.partition": [1, 2]})
    with pytest.raises(ConfigError, match="increase"):
        load_experiment(None, {**_overrides("partitioned", 3), "strategy.partition": [2, 2]})


def zero_part0_loss(strategy, rank: int) -> None:
    """Part 0's own loss times zero: whatever moves its parameters then came from elsewhere."""
    if rank == 0:
        local = strategy.local_loss
        strategy.local_loss = lambda out, y, classes: 0.0 * local(out, y, classes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("partitioned")
    spawn_runs(out, WORLD, [("parted", _overrides("partitioned", WORLD), None),
                            ("zeroed", _overrides("partitioned", WORLD), zero_part0_loss)])
    return out


def _rows(runs: Path, name: str, rank: int) -> list[dict]:
    return json.loads((runs / f"{name}-{rank}.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_only_forward_activations_cross_parts(runs: Path):
    """Part 0 (Linear 64->32, ReLU) sends its output, batch x 32 fp32, each step and nothing else;
    part 1 sends nothing back."""
    for name in ("parted", "zeroed"):
        steps0, steps1 = _records(_rows(runs, name, 0), "step"), _records(_rows(runs, name, 1), "step")
        assert len(steps0) == BASE["workload.steps"]
        assert {r["bytes_sent"] for r in steps0} == {BASE["workload.batch_size"] * BASE["workload.hidden"] * 4}
        assert {r["bytes_sent"] for r in steps1} == {0}
        assert_step_phases(steps0 + steps1, "partitioned")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_no_gradient_reaches_a_part_from_downstream(runs: Path):
    """With part 0's own loss zeroed, its parameters stay where they started while part 1 (same
    inputs as before the first update) trains; with it, both move."""
    exp = load_experiment(None, _overrides("single", 1))
    initial = WORKLOADS.get("mlp-digits").build(exp.workload, exp.seed).model.state_dict()
    zeroed, parted = torch.load(runs / "zeroed.pt"), torch.load(runs / "parted.pt")
    assert list(zeroed) == list(initial)
    for name in ("0.weight", "0.bias"):  # part 0
        assert torch.equal(zeroed[name], initial[name])
        assert (parted[name] - initial[name]).abs().max() > 1e-3
    for name in ("2.weight", "4.weight"):  # part 1
        assert (zeroed[name] - initial[name]).abs().max() > 1e-3


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_holds_its_part_and_the_model_learns(runs: Path):
    exp = load_experiment(None, _overrides("single", 1))
    model = WORKLOADS.get("mlp-digits").build(exp.workload, exp.seed).model
    part_bytes = [sum(p.numel() * 4 for p in model[lo:hi].parameters()) for lo, hi in ((0, 2), (2, 5))]
    for rank in range(WORLD):
        memory = _records(_rows(runs, "parted", rank), "memory")[0]["bytes"]
        assert memory["parameters"] == part_bytes[rank]
        assert memory["gradients"] == part_bytes[rank]
    losses = [r["loss"] for r in _records(_rows(runs, "parted", 0), "step")]
    assert losses == [r["loss"] for r in _records(_rows(runs, "parted", 1), "step")]  # the task's, shared
    assert losses[-1] < 0.9 * losses[0]  # 0.82 measured after 40 steps
    accuracy = _records(_rows(runs, "parted", 0), "eval")[-1]["metric"]
    assert 0.3 < accuracy <= 1.0  # 10 classes: chance is 0.1
