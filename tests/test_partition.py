"""The exact pipeline partitioner: the dynamic program against brute force, and, measured, the largest
micro-batch that fits a memory cap with the balanced partition against the equal-layer one."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from ddlscope.predict.partition import Layer, partition, plan_of_cuts, stage_cost

pytestmark = pytest.mark.cli_in_this_process  # its runs need no process of their own (conftest.cli)


def _brute_force(layers: list[Layer], stages: int, m: int, limit: float, schedule: str) -> float:
    """The smallest slowest-stage time over every cut set and every per-stage recompute choice."""
    best = math.inf
    n = len(layers)
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        for flags in itertools.product((False, True), repeat=stages):
            costs = [stage_cost(layers, a, b, k, stages, m, flags[k], schedule)
                     for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
            if all(c.memory_bytes <= limit for c in costs):
                best = min(best, max(c.time_s for c in costs))
    return best


def _random_layers(rng: random.Random, n: int) -> list[Layer]:
    return [Layer(forward_s=rng.uniform(1, 5), backward_s=rng.uniform(2, 10), param_bytes=rng.uniform(0, 50),
                  activation_bytes=rng.uniform(10, 100), input_bytes=rng.uniform(1, 10)) for _ in range(n)]


def test_exact_search_matches_brute_force():
    rng = random.Random(7)
    checked = infeasible = 0
    for _ in range(120):
        n, stages, m = rng.randint(3, 7), rng.randint(2, 3), rng.choice([2, 4, 8])
        layers = _random_layers(rng, n)
        schedule = rng.choice(["gpipe", "1f1b"])
        limit = rng.uniform(100, 900)
        expected = _brute_force(layers, stages, m, limit, schedule)
        plan = partition(layers, stages, m, limit, schedule)
        if expected == math.inf:
            assert plan is None
            infeasible += 1
            continue
        assert plan is not None and plan.slowest_s == pytest.approx(expected, rel=1e-12)
        assert plan.fullest_bytes <= limit and len(plan.stages) == stages
        assert [s.start for s in plan.stages] == [0, *plan.cuts] and plan.stages[-1].stop == n
        checked += 1
    assert checked >= 60 and infeasible >= 5  # both outcomes exercised


def test_recompute_trades_time_for_memory():
    layers = [Layer(1.0, 2.0, 0.0, 100.0, 10.0) for _ in range(4)]
    roomy = partition(layers, 2, 4, 1e9, "1f1b")
    assert roomy is not None and not any(s.recompute for s in roomy.stages) and roomy.slowest_s == 6.0
    # 1F1B: stage 0 holds 2 micro-batches of its 2 layers (400), stage 1 one (200). Under 300 stage 0
    # must recompute: 2 inputs (20) + one micro-batch rebuilt (200), one more forward (8 instead of 6).
    tight = partition(layers, 2, 4, 300.0, "1f1b")
    assert tight is not None and [s.recompute for s in tight.stages] == [True, False]
    assert tight.slowest_s == 8.0 and tight.stages[0].memory_bytes == 220.0
    gpipe = plan_of_cuts(layers, [2], 4, "gpipe")
    assert [s.memory_bytes for s in gpipe.stages] == [800.0, 800.0]  # all m micro-batches on every stage


CAP_MIB = 32
MODEL = ["--workload", "gpt-synthetic", "--set", "workload.layers=6", "--set", "workload.hidden=128",
         "--set", "workload.seq_len=64", "--set", "workload.optimizer=sgd"]
MEASURED = ("parameters", "gradients", "optimizer", "activations_peak")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_balanced_partition_fits_a_larger_micro_batch_measured(cli, db_rows):
    out = cli("partition", *MODEL, "--set", "workload.batch_size=16", "--stages", "2", "--micro-batches", "4",
              "--memory-limit", f"{CAP_MIB}MiB", "--no-recompute", "--json", timeout_s=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    largest = report["largest_micro_batch"]
    assert largest["balanced"] > largest["equal"] > 0, largest
    # The plans at the balanced partition's largest micro-batch, from the same profile scaled to it.
    factor = largest["balanced"] / report["micro_batch"]
    layers = [Layer(l["forward_s"] * factor, l["backward_s"] * factor, l["param_bytes"], l["activation_bytes"] * factor,
                    l["input_bytes"] * factor, l["name"]) for l in report["layers"]]
    cap = CAP_MIB * 2**20
    balanced = partition(layers, 2, 4, cap, "1f1b", allow_recompute=False, state_bytes_per_param_byte=2.0)
    equal = plan_of_cuts(layers, report["equal"]["cuts"], 4, "1f1b", state_bytes_per_param_byte=2.0)
    assert balanced is not None and equal.fullest_bytes > cap
    measured = {}
    for label, cuts in (("balanced", balanced.cuts), ("equal", equal.cuts)):
        run = cli("run", *MODEL, "--strategy", "pipeline", "--world-size", "2", "--steps", "2",
                  "--batch-size", str(4 * largest["balanced"]), "--set", f"strategy.partition={cuts}",
                  "--set", "workload.eval_batches=1", "--name", label, "--quiet", timeout_s=180)
        assert run.returncode == 0, run.stderr
        rows = db_rows("SELECT m.rank, m.category, m.bytes FROM memory m JOIN runs r ON r.id = m.run_id "
                       "WHERE r.name = ?", label)
        per_rank: dict[int, float] = {}
        for rank, category, nbytes in rows:
            if category in MEASURED:
                per_rank[rank] = per_rank.get(rank, 0) + nbytes
        measured[label] = [per_rank[r] for r in sorted(per_rank)]
    assert max(measured["balanced"]) <= cap < max(measured["equal"]), measured
    # The model prices each stage's memory as measured (states + in-flight activations), within 2%.
    for plan, label in ((balanced, "balanced"), (equal, "equal")):
        for predicted, got in zip((s.memory_bytes for s in plan.stages), measured[label]):
            assert 0.98 <= predicted / got <= 1.02, (label, predicted, got)


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 2)])
@pytest.mark.parametrize("ranks,micro_batches", [(2, 4), (4, 8), (4, 16)])
def test_torch_orders_played_out_give_the_formulas_bubble(schedule: str, chunks: int, ranks: int, micro_batches: int):
    """With equal stages (backward twice forward), the timeline of the order torch runs has the bubble
    of REFERENCE.md: (p - 1) / m, (p - 1) / (m v) interleaved, and a third of that for zero-bubble."""
    from ddlscope.predict.partition import bubble_fraction
    from ddlscope.predict.schedule_sim import simulate
    from ddlscope.studies.modelparallel import _durations, _orders

    stages = ranks * chunks
    orders = _orders(schedule, ranks, micro_batches, chunks)
    assert sorted(a for order in orders for a in order if a[0] == "F") == sorted(
        ("F", s, i) for s in range(stages) for i in range(micro_batches))  # every forward, once
    timeline = simulate(orders, _durations([1.0 / chunks] * stages, [2.0 / chunks] * stages), stages)
    assert timeline.bubble_fraction() == pytest.approx(bubble_fraction(ranks, micro_batches, chunks, schedule),
                                                       rel=1e-9)
    assert timeline.makespan_s == pytest.approx(3.0 * micro_batches * (1 + timeline.bubble_fraction()), rel=1e-9)


def test_an_order_that_waits_on_itself_is_refused():
    from ddlscope.predict.schedule_sim import simulate

    # rank 0 runs stage 0's backward before rank 1 has run stage 1's, which waits on stage 0's forward
    with pytest.raises(ValueError, match="deadlocks"):
        simulate([[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]], lambda a: 1.0, 2)


def test_stage_bubbles_from_measured_stage_times():
    """Equal stages give (p - 1)/m; unequal ones the critical path: GPipe on 2 stages with forward /
    backward 1 / 4 on stage 0 and 2 / 2 on stage 1, per micro-batch, m = 4: the step lasts
    f0 + m f1 + b1 + m b0 = 27 against 20 and 16 of compute. (Swapping forward and backward times gives
    the same: a GPipe step played backwards is a GPipe step.)"""
    from ddlscope.predict.partition import stage_bubbles

    for schedule in ("gpipe", "1f1b"):
        for p in (2, 3, 4):
            for m in (p, 2 * p, 8):
                got = stage_bubbles(schedule, [1.0 * m] * p, [2.0 * m] * p, m)
                assert got[-1] == pytest.approx((p - 1) / m)
    unequal = stage_bubbles("gpipe", [4.0, 8.0], [16.0, 8.0], 4)
    assert unequal == pytest.approx([7 / 20, 11 / 16])
    assert stage_bubbles("gpipe", [4.0, 8.0], [16.0, 8.0], 4, waits=5, per_wait_s=0.2) == pytest.approx(
        [8 / 20, 12 / 16])
