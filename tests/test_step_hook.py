"""The step hook: a strategy that owns its step is timed by the runtime's phase timer.

The strategy here accumulates gradients over micro-batches: it enters the
forward and backward phases once per micro-batch. The loop runs in this
process (one rank, no process group), so the test sees the rows it writes.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddlscope.runtime.config import load_experiment
from ddlscope.runtime.loop import train
from ddlscope.runtime.rows import RowWriter, read_records
from ddlscope.runtime.timer import PhaseTimer, step_phases
from ddlscope.strategies.base import RunContext, Strategy, StepTimer
from ddlscope.strategies.comm import CommStats
from ddlscope.workloads import WORKLOADS
from phase_checks import CHECKED_IN, PARTS, assert_step_phases

MICRO_BATCHES = 4
SYNC_S = 0.02  # a synchronize phase that sleeps: its time must land in comm_wait_s


class AccumulateMicroBatches(Strategy):
    """Gradient accumulation: the batch in MICRO_BATCHES slices, one optimizer step."""

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor], timer: StepTimer) -> float:
        x, y = batch
        total = 0.0
        for xs, ys in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
            with timer.phase("forward"):
                loss = self.loss_fn(self.model(xs), ys) / MICRO_BATCHES
            with timer.phase("backward"):
                loss.backward()
            total += loss.item()
        with timer.phase("synchronize"):
            time.sleep(SYNC_S)
        with timer.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return total


def _run(tmp_path: Path, strategy_class: type[Strategy], steps: int = 4) -> tuple[list[dict], torch.nn.Module]:
    exp = load_experiment(None, {"strategy.name": "single", "cluster.world_size": 1, "workload.steps": steps,
                                 "workload.batch_size": 32, "workload.eval_batches": 1})
    ctx = RunContext(0, 1, 0, 0, torch.device("cpu"), "gloo", exp)
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    writer = RowWriter(tmp_path / f"{strategy_class.__name__}.jsonl", 0)
    result = train(task, strategy_class(exp.strategy, ctx), ctx, writer)
    writer.close()
    rows = [r for r in read_records(tmp_path / f"{strategy_class.__name__}.jsonl") if r.get("kind") == "step"]
    return rows, result.model


@pytest.mark.timeout(120)
def test_a_strategy_that_owns_its_step_is_timed_and_trains_like_the_whole_batch(tmp_path: Path):
    rows, accumulated = _run(tmp_path, AccumulateMicroBatches)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert_step_phases(rows, "single")
    for r in rows:
        assert SYNC_S <= r["comm_wait_s"] < SYNC_S + 0.015  # the synchronize phase, nothing else
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["compute_cpu_s"] > 0
        assert r["samples"] == 32
    # The mean of the micro-batch gradients is the whole batch's: the same model as the default step.
    from ddlscope.strategies.single import Single

    single_rows, whole = _run(tmp_path, Single)
    assert_step_phases(single_rows, "single")
    for a, b in zip(accumulated.state_dict().values(), whole.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_phases_are_contiguous_and_repeated_phases_add_up():
    labels: list[str] = []

    class Label:
        def __init__(self, name: str):
            labels.append(name)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    forwards: list[float] = []
    timer = PhaseTimer(torch.device("cpu"), Label, after_forward=forwards.append)
    timer.start(time.perf_counter())
    for _ in range(3):
        with timer.phase("forward"):
            time.sleep(0.01)
        time.sleep(0.005)  # between phases: belongs to the next one
        with timer.phase("backward"):
            time.sleep(0.002)
    assert timer.entries["forward"] == 3 and timer.entries["backward"] == 3
    assert len(forwards) == 3 and all(0.01 <= f < 0.03 for f in forwards)
    assert 0.03 <= timer.seconds["forward"] < 0.06
    assert 0.021 <= timer.seconds["backward"] < 0.05  # 3 x (5 ms gap + 2 ms)
    assert sum(timer.seconds.values()) == pytest.approx(timer.end_s - timer.step_start_s, rel=1e-12)
    assert labels == ["forward", "backward"] * 3
    with pytest.raises(ValueError, match="unknown phase 'warmup'"):
        with timer.phase("warmup"):
            pass


def test_exposed_communication_moves_from_its_phase_to_the_wait():
    """The split every step row is written with (the loop's and an attached job's): blocked forward
    and backward communication is waiting, not compute, and nothing is counted twice."""
    seconds = {"data": 0.01, "forward": 0.30, "backward": 0.50, "synchronize": 0.02, "optimizer": 0.04}
    timer = SimpleNamespace(seconds=seconds, step_start_s=100.0, end_s=100.0 + sum(seconds.values()))
    row = step_phases(timer, CommStats(exposed_in_forward_s=0.12, exposed_in_backward_s=0.2))  # type: ignore[arg-type]
    assert row == pytest.approx({"data_s": 0.01, "forward_s": 0.18, "backward_s": 0.30, "comm_wait_s": 0.34,
                                 "optimizer_s": 0.04, "step_s": 0.87}, rel=1e-9)
    assert sum(row[p] for p in PARTS) == pytest.approx(row["step_s"], rel=1e-9)


def test_every_registered_strategy_has_a_run_whose_phases_are_checked():
    """A strategy registered without a test that passes its step rows to tests/phase_checks.py fails
    here: name the module that does in phase_checks.CHECKED_IN."""
    from ddlscope.specs import STRATEGY_SPECS

    assert set(CHECKED_IN) == set(STRATEGY_SPECS.names())
    for strategy, module in CHECKED_IN.items():
        source = (Path(__file__).parent / module).read_text()
        assert "phase_checks import" in source and f'"{strategy}"' in source, (strategy, module)
