"""`ddlscope study beyond`: its cells, its sections' analysis from given numbers, and adding a section."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddlscope.studies import STUDIES
from ddlscope.studies.base import CellResult
from ddlscope.studies.beyond import BeyondStudy, FederatedSection, SectionReport, predicted


def result(cell, block_evals, accuracy=0.7):
    summary = SimpleNamespace(notes=[], block_evals=block_evals, effective_step_s=0.02,
                              final_eval={"metric_name": "accuracy", "metric": accuracy})
    return CellResult(cell, SimpleNamespace(), summary, reused=False)


def evals(predictor: str, accuracies: list[float]) -> list[dict]:
    return [{"predictor": predictor, "block": b, "accuracy": a, "loss": 1.0, "samples": 10}
            for b, a in enumerate(accuracies)]


def test_quick_cells_are_the_three_federated_runs_and_the_full_study_adds_references():
    study = STUDIES.get("beyond")()
    quick = study.cells(quick=True)
    assert [c.key for c in quick] == ["federated/fedavg/block-cyclic", "federated/mm-psgd/block-cyclic",
                                      "federated/mc-psgd/block-cyclic"]
    assert all(c.labels["section"] == "federated" and c.experiment.strategy.partition == "block-cyclic"
               for c in quick)
    assert len(study.cells(quick=False)) > len(quick)


def test_per_block_headline_compares_each_block_with_fedavgs_single_model():
    cells = {c.key: c for c in FederatedSection().cells(quick=True)}
    results = [result(cells["federated/fedavg/block-cyclic"], evals("global", [0.5, 0.9])),
               result(cells["federated/mm-psgd/block-cyclic"], evals("global", [0.5, 0.9]) + evals("per-block", [0.8, 0.86])),
               result(cells["federated/mc-psgd/block-cyclic"], evals("per-block", [0.45, 0.95]))]
    findings = BeyondStudy(sections=[FederatedSection()]).analyse(results, quick=True)
    mm, mc = findings.headlines
    assert "mean +13.0 points, worst block +30.0 points" in mm["measured"] and mm["verdict"] == "agrees"
    assert mc["verdict"] == "differs here"  # a better mean, a worse worst block
    table = findings.extra["tables"]["Federated: FedAvg vs per-block predictors on block-cyclic data"]
    assert any("per-block" in line and "0.800" in line and "0.830" in line for line in table)
    assert "block 0 gets 50.0%" in findings.decisions[0]


def test_a_section_is_one_more_entry():
    def extra(quick: bool) -> SectionReport:
        return SectionReport("Extra", ["a table line"], [{"headline": "x", "paper": "-", "measured": "-",
                                                          "predicted": "1", "verdict": "ok"}])

    study = BeyondStudy(sections=[predicted("extra", extra)])
    assert study.cells(quick=True) == []
    findings = study.analyse([], quick=True)
    assert findings.extra["tables"] == {"Extra": ["a table line"]} and findings.headlines[0]["headline"] == "x"


def test_burst_section_predicts_a_gain_where_layers_scale_unevenly_and_none_elsewhere():
    study = STUDIES.get("beyond")()
    burst = next(s for s in study.sections if s.name == "burst")
    report = burst.analyse([], quick=True)
    cases = {(c["model"], c["global_batch"]): c for c in report.data["cases"]}
    assert cases[("vgg16", 64)]["fastest"]["speedup_vs_uniform"] > 1.2
    assert cases[("resnet50", 64)]["fastest"]["speedup_vs_uniform"] == pytest.approx(1.0, abs=1e-9)
    assert len(report.table) == 2 + len(cases)
