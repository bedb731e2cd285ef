"""`study paper --models`: the paper's cells on torchvision's networks beside the small model, their
headlines and predicted column, bad input, and one real (small) run of the model cells."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from ddlscope.analysis.summary import Summary
from ddlscope.cli import main
from ddlscope.runtime.config import experiment_to_dict
from ddlscope.studies import STUDIES
from ddlscope.studies import paper
from ddlscope.studies.base import CellResult
from ddlscope.studies.paper_prediction import NO_MODEL_TABLE

from browser import CAN_LOOK, assert_reads_well, look_at

QUICK_MODEL_KEYS = {"single/w1", "ddp/fast/homogeneous/w2", "memory/ddp/w2", "memory/fsdp/w2"}


def _configs(cells):
    return {c.key: experiment_to_dict(c.experiment) for c in cells}


def test_models_add_torchvision_cells_and_leave_the_small_models_cells_as_they_were():
    plain = STUDIES.get("paper")().cells(quick=True, repeats=2)
    study = STUDIES.get("paper")(models=("resnet50", "torchvision:vgg16"))
    assert study.models == ("resnet50", "vgg16")
    quick = study.cells(quick=True, repeats=2)
    own = [c for c in quick if "model" not in c.labels]
    assert _configs(own) == _configs(plain) and [c.key for c in own] == [c.key for c in plain]
    models = [c for c in quick if "model" in c.labels]
    assert {c.key for c in models} == {f"{m}/{k}" for m in ("resnet50", "vgg16") for k in QUICK_MODEL_KEYS}
    for c in models:
        workload = c.experiment.workload
        assert workload.name == f"torchvision:{c.labels['model']}" and c.labels["workload"] == workload.name
        assert (workload.image_size, workload.batch_size, workload.steps) == (32, 32, 3)
        assert c.labels["part"] in ("timing", "memory") and c.experiment.seed == 0  # no seeds: no accuracy read
        assert c.labels["model"] in c.labels["strategy"]  # the report's series never merge two models' cells
    by_key = {c.key: c for c in models}
    ddp = by_key["vgg16/ddp/fast/homogeneous/w2"].experiment.cluster
    assert (ddp.world_size, ddp.network.profile, ddp.network.scaled) == (2, "fast", True)
    assert by_key["vgg16/memory/fsdp/w2"].experiment.cluster.network.profile == "local"
    assert by_key["vgg16/single/w1"].experiment.cluster.world_size == 1


def test_the_full_study_adds_the_costly_model_cells_and_reuses_the_quick_ones():
    quick = paper.model_cells("vgg16", quick=True)
    full = paper.model_cells("vgg16", quick=False)
    assert {c.key.partition("/")[2] for c in full} - QUICK_MODEL_KEYS == {
        "ddp/fast/homogeneous/w4", "ddp/slow/homogeneous/w2", "fsdp/fast/homogeneous/w2", "fsdp/slow/homogeneous/w2",
        "ps-sync/fast/straggler/w2", "ps-async/fast/straggler/w2"}
    # the same experiment under the same key: the store's quick cells are the full study's
    full_configs = _configs(full)
    assert all(full_configs[key] == config for key, config in _configs(quick).items())
    # the expected time: the slow link's cells dominate, and VGG16's 537 MB of gradients take minutes a step
    quick_s, full_s = paper.expected_models_s(quick), paper.expected_models_s(full)
    assert 60 < quick_s < 600 < 3 * quick_s < full_s
    assert paper.expected_models_s(paper.model_cells("densenet121", quick=True)) < quick_s


@pytest.mark.parametrize("argv, names", [
    (["study", "paper", "--quick", "--models", "nosuch"], "--models nosuch: workload.name = 'torchvision:nosuch'"),
    (["study", "paper", "--models", "resnet50,,vgg16"], "--models 'resnet50,,vgg16'"),
    (["study", "paper", "--models", "resnet50,resnet50"], "resnet50 is given twice"),
    (["study", "paper", "--models", "timm:resnet18"], "--models 'timm:resnet18'"),
    (["study", "dataparallel", "--quick", "--models", "resnet50"], "only `study paper`"),
])
def test_bad_models_are_one_line_exit_2_and_write_nothing(argv, names, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--db", "s.db"]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], err
    assert "Traceback" not in out + err and list(tmp_path.iterdir()) == []


def _summary(step_s: float, memory: dict | None = None, comm_share: float = 0.0) -> Summary:
    return Summary(
        run={}, steps_recorded=3, ranks_recorded=2, warmup_steps_excluded=1, mean_step_s=step_s,
        throughput_samples_per_s=32 / step_s, baseline_run_id=None, speedup_vs_single=None, scaling_efficiency=None,
        breakdown_mean_s={}, breakdown_fraction={"comm_wait_s": comm_share}, comm={},
        memory_bytes_by_rank=memory or {}, final_eval=None, final_loss=None, train_wall_s=3 * step_s,
        oversubscribed=False, cpu_derived_step_s=step_s, cpu_derived_wall_s=3 * step_s, staleness={}, eval_curve=[])


def _states(parameters: int, activations: int) -> dict:
    return {"0": {"parameters": parameters, "gradients": parameters, "optimizer": parameters,
                  "activations": activations}}


def _model_results(model: str, single_s: float, ddp_s: float, comm_share: float) -> list[CellResult]:
    """The quick study's four cells of `model`, as built by the study, with made-up measurements."""
    figures = {"single/w1": _summary(single_s), "ddp/fast/homogeneous/w2": _summary(ddp_s, comm_share=comm_share),
               "memory/ddp/w2": _summary(1.0, _states(400, 100)), "memory/fsdp/w2": _summary(1.0, _states(200, 100))}
    results = []
    for cell in paper.model_cells(model, quick=True):
        run = SimpleNamespace(config=experiment_to_dict(cell.experiment))
        results.append(CellResult(cell, run, figures[cell.key.partition("/")[2]], reused=True))
    return results


def test_headlines_name_the_models_and_the_predicted_column_says_which_it_cannot_price(monkeypatch):
    """resnet18 is priced from its recorded layers; vit_b_16's are made to price 1.5x the FLOPs torch counts
    (as an unknown op would), so its prediction is n/a, never numbers of another network."""
    from ddlscope.cli.study import print_outcome
    from ddlscope.studies import recorded
    from ddlscope.studies.runner import StudyOutcome

    real = recorded.recorded_layers

    def off_for_vit(spec):
        layers, priced = real(spec)
        return layers, 1.5 if "vit" in spec.name else priced

    monkeypatch.setattr(recorded, "recorded_layers", off_for_vit)
    paper._LAYERS.clear()

    results = (_model_results("resnet18", 1.0, 0.8, 0.1) + _model_results("vit_b_16", 1.0, 2.0, 0.6))
    study = STUDIES.get("paper")(models=("resnet18", "vit_b_16"))
    findings = study.analyse(results, quick=True)
    rows = {h["headline"]: h for h in findings.headlines}
    assert list(rows) == ["DDP speedup over one device", "FSDP peak memory per device"]
    ddp = rows["DDP speedup over one device"]
    assert "DDP resnet18 1.25x, vit_b_16 0.50x at 2 workers" in ddp["measured"]
    assert "faster than one process for 1 of 2 (vit_b_16 slower: waiting for the gradient exchange took 60%" \
        in ddp["verdict"]
    assert f"vit_b_16 {NO_MODEL_TABLE}" in ddp["predicted"] and "resnet18 " in ddp["predicted"]
    assert f"resnet18 {NO_MODEL_TABLE}" not in ddp["predicted"]
    memory = rows["FSDP peak memory per device"]
    assert "model states per rank resnet18 0.50x, vit_b_16 0.50x DDP's; with activations resnet18 0.54x" \
        in memory["measured"]
    assert any("resnet18, vit_b_16: torchvision's networks" in n for n in findings.notes)
    console = Console(width=250, record=True)
    print_outcome(console, "study", StudyOutcome(study, "paper", results, findings, None))
    text = console.export_text()
    assert "resnet18/ddp/fast/homogeneous/w2" in text and "vit_b_16 0.50x" in text


def test_without_models_the_predicted_column_is_the_paper_models_as_before():
    from ddlscope.studies.paper_prediction import paper_prediction, predicted_column

    column = predicted_column(paper_prediction())
    assert "resnet50" in column["DDP speedup over one device"] and NO_MODEL_TABLE not in str(column)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_small_model_runs_through_the_study_its_report_names_it_and_a_rerun_reuses_it(tmp_path):
    """The quick model cells of a small torchvision network, for real (the small model's own cells take
    5 minutes and are tested elsewhere): run, analysed, reported; the second run reuses every cell."""
    from ddlscope.studies.runner import run_study

    study = STUDIES.get("paper")(models=("mobilenet_v3_small",))
    cells = [c for c in study.cells(quick=True) if "model" in c.labels]
    db, report = tmp_path / "s.db", tmp_path / "paper-report.html"
    outcome = run_study(study, "paper", cells, db, False, report, "ddlscope study paper --models mobilenet_v3_small")
    assert [r.reused for r in outcome.results] == [False] * 4
    rows = {h["headline"]: h for h in outcome.findings.headlines}
    assert "mobilenet_v3_small" in rows["DDP speedup over one device"]["measured"]
    assert "mobilenet_v3_small" in rows["FSDP peak memory per device"]["predicted"]
    html = Path(report).read_text()
    assert "mobilenet_v3_small/ddp/fast/homogeneous/w2" in html and "--models mobilenet_v3_small" in html
    if CAN_LOOK:  # the paper study's page as a reader sees it, with its headlines (tests/browser.py)
        page = look_at(Path(report), tmp_path, "paper-report", width=1000)
        assert_reads_well(page, min_images=4, min_tables=2)
        headings = [h for h in page.headings if h != "Notes"]
        assert headings[:3] == ["Headlines: the main study vs this machine", "All cells",
                                "Throughput, speedup and scaling"], page.headings
        assert "Memory by category: DDP vs FSDP" in headings  # memory cells in a chart of their own
    again = run_study(study, "paper", [c for c in study.cells(quick=True) if "model" in c.labels], db, False, report,
                      "again")
    assert [r.reused for r in again.results] == [True] * 4
    assert [r.run.id for r in again.results] == [r.run.id for r in outcome.results]
