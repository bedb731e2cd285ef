"""The local predictor's terms for what issue 38 found unpriced or priced where the run pays nothing:
exact arithmetic on a synthetic calibration (no timing here; benchmarks/predict_local.py measures)."""

from __future__ import annotations

import pytest

from conftest import SRC


def _benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("predict_local_bench", SRC.parent / "benchmarks" / "predict_local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_has_a_row_for_every_strategy_and_selects_by_strategy():
    from argparse import Namespace

    from ddlscope.specs import STRATEGY_SPECS

    bench = _benchmark()
    flags = dict(only=None, all=True, cnn=False, servers=False, only_servers=False, dataparallel=False,
                 only_dataparallel=False, modelparallel=False, only_modelparallel=False)
    every = bench.selected_configs(Namespace(**flags))
    assert {strategy for strategy, _, _ in every} == set(STRATEGY_SPECS.names())
    schedules = {extra.get("strategy.schedule") for strategy, _, extra in every if strategy == "pipeline"}
    assert schedules == {"gpipe", "1f1b", "interleaved", "zero-bubble"}
    assert any(extra.get("strategy.recompute") for _, _, extra in every)
    only = bench.selected_configs(Namespace(**{**flags, "all": False, "only": ["tp", "diloco"]}))
    assert sorted({s for s, _, _ in only}) == ["diloco", "tp"]


def test_benchmark_judges_a_row_against_its_repeats_spread():
    bench = _benchmark()
    row = {"predicted": {"step_s": 0.0105}, "measured_step_s_repeats": [0.010, 0.011, 0.012],
           "error": {"step_s_error": -0.045}, "strategy": "ddp"}
    assert bench.spread_ms(row) == pytest.approx((10.0, 12.0))
    assert bench.within_noise(row) is True
    assert bench.within_noise({**row, "predicted": {"step_s": 0.0099}}) is False
    assert bench.within_noise({**row, "measured_step_s_repeats": [0.010]}) is None
    other = {**row, "strategy": "tp", "error": {"step_s_error": 0.30}}
    assert bench.per_strategy([row, other, {**other, "error": {"step_s_error": -0.1}}]) == {
        "ddp": [0.045], "tp": [0.30, 0.1]}
