"""HTML reports: self-contained pages, valid embedded PNGs, escaping, sections, study page, atomic writes."""

import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddlscope.store import OutputError, Store

pytest.importorskip("matplotlib")

from ddlscope.report import figures  # noqa: E402
from ddlscope.report.html import runs_report, study_report, write_report  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EVIL = "<script>alert(1)</script>"
WORKLOAD = {"name": "mlp-digits", "batch_size": 64, "steps": 6, "lr": 0.1, "eval_every": 2}


def _config(strategy: str, world: int, name: str, **cluster) -> dict:
    return {"name": name, "seed": 0, "workload": dict(WORKLOAD), "strategy": {"name": strategy},
            "cluster": {"world_size": world, "nnodes": 1, "slowdown": [], "network": {"profile": "local"}, **cluster}}


def _add_run(store: Store, n: int, strategy: str, world: int, name: str, *, steps: int = 6, comm: float = 0.0, server: bool = False, status: str = "finished", error: str | None = None,
             accuracy_gain: float = 0.1, **cluster) -> int:
    run_id = store.create_run(uuid=f"{n:032x}", name=name, workload="mlp-digits", strategy=strategy, world_size=world,
                              config=_config(strategy, world, name, **cluster), code_version="test", seed=0,
                              environment={"cores": 2, "torch": "test"})
    store.mark_running(run_id)
    per_rank = 64 if strategy == "single" else 64 // world
    records = []
    for rank in range(world):
        for step in range(steps):
            parts = {"data_s": 0.001, "forward_s": 0.003, "backward_s": 0.003, "comm_wait_s": comm,
                     "optimizer_s": 0.001 * (rank + 1)}
            total = sum(parts.values())
            records.append({"kind": "step", "rank": rank, "step": step, "t_s": step * total, **parts,
                            "step_s": total, "comm_s": comm * 1.5, "compute_cpu_s": 0.006, "samples": per_rank,
                            "loss": 2.0 - 0.1 * step, "bytes_sent": 1000 if world > 1 else 0})
        records.append({"kind": "memory", "rank": rank, "bytes": {
            "parameters": 100_000 // (world if strategy == "fsdp" else 1), "gradients": 100_000,
            "optimizer": 0, "activations": 40_000, "peak_rss": 400_000_000}})
    for step in range(1, steps, 2):
        records.append({"kind": "eval", "rank": 0, "step": step, "wall_s": 0.05 * step,
                        "samples_seen": 64 * (step + 1), "metric_name": "accuracy",
                        "metric": min(1.0, 0.1 + accuracy_gain * step), "loss": 2.0 - 0.1 * step})
    if server:
        srank = world
        records.append({"kind": "memory", "rank": srank, "bytes": {"parameters": 100_000, "peak_rss": 300_000_000}})
        for seq in range(steps * world):
            records.append({"kind": "update", "rank": srank, "seq": seq, "t_s": 0.001 * seq, "worker": seq % world,
                            "worker_step": seq // world, "staleness": seq % 3, "queue_s": 0.0001,
                            "apply_s": 0.0005, "cpu_s": 0.0004, "bytes": 1000})
        records.append({"kind": "event", "rank": srank, "seq": 0, "t": 1.0, "event": "server_start",
                        "message": "shard of 1 server(s)"})
        records.append({"kind": "event", "rank": srank, "seq": 1, "t": 2.0, "event": "server_end",
                        "message": f"wall_s=0.050000 busy_cpu_s=0.010000 updates={steps * world}"})
    store.ingest(run_id, records)
    store.mark_done(run_id, status, error)
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "s.db"
    with Store(path) as s:
        _add_run(s, 1, "single", 1, "single")
        _add_run(s, 2, "ddp", 2, "ddp2", comm=0.001)
        _add_run(s, 3, "fsdp", 2, "fsdp2", comm=0.004)
        _add_run(s, 4, "ps-async", 2, "psasync", comm=0.002, server=True, accuracy_gain=0.05, slowdown=[1, 2])
        _add_run(s, 5, "ddp", 2, EVIL, comm=0.001, status="failed", error='<img src=x onerror="alert(2)">',
                 steps=3, network={"profile": "<b>slow</b>"})
        yield s


def _images(html: str) -> list[bytes]:
    srcs = re.findall(r"<img\b[^>]*\bsrc=\"([^\"]*)\"", html)
    assert len(srcs) == len(re.findall(r"<img\b", html))
    out = []
    for src in srcs:
        assert src.startswith("data:image/png;base64,"), src[:60]
        png = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert png.startswith(PNG_SIGNATURE) and len(png) > 1000
        out.append(png)
    return out


def _self_contained(html: str) -> None:
    lowered = html.lower()
    for bad in ("http://", "https://", 'src="//', "href=\"//", "<script", "<link", "@import", "url("):
        assert bad not in lowered, bad
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', html))


def test_runs_report_is_self_contained_with_every_section(store):
    runs = [store.get_run(ref) for ref in ("single", "ddp2", "fsdp2", "psasync")]
    html = runs_report(store, runs, "four runs")
    _self_contained(html)
    assert len(_images(html)) >= 12  # throughput, scaling, breakdown, 4 per-rank, steps, memory, curves, PS x2
    for section in ("summary", "configs", "throughput", "breakdown", "steps", "memory", "metrics", "ps"):
        assert f'<section id="{section}">' in html, section
    assert "<details>" in html and "&#34;batch_size&#34;: 64" in html  # full config JSON, escaped
    assert "speedup vs single" in html and "scaling eff." in html and "overlap" in html
    assert "server rank" in html and "apply share" in html
    assert re.search(r"\d\.\d\dx <span class=\"muted\">\(vs #1\)</span>", html)  # speedup vs the single run
    assert html == runs_report(store, runs, "four runs")  # same data, same page


def test_user_strings_are_escaped(store):
    run = store.get_run(EVIL)
    html = runs_report(store, [store.get_run("single"), run], f"title {EVIL}")
    _self_contained(html)
    assert EVIL not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=" in html  # the run's error
    assert "<b>slow</b>" not in html and "&lt;b&gt;slow&lt;/b&gt;" in html  # a config value
    assert 'class="status failed"' in html
    assert '<section id="notes">' in html  # the summary's note on a run that did not finish


def test_run_without_rows_still_renders(tmp_path):
    with Store(tmp_path / "e.db") as s:
        run_id = s.create_run(uuid="e" * 32, name="empty", workload="mlp-digits", strategy="ddp", world_size=2,
                              config=_config("ddp", 2, "empty"), code_version="test", seed=0, environment={})
        html = runs_report(s, [s.get_run(run_id)], "empty")
    _self_contained(html)
    assert "No steps recorded" in html and "No evaluations recorded" in html and "<img" not in html


def test_study_report_headlines_cells_figures_decisions(store):
    cells = []
    for ref, strategy, workers, part in (("ddp2", "ddp", "homogeneous", "accuracy"),
                                         ("fsdp2", "fsdp", "homogeneous", "accuracy"),
                                         ("psasync", "ps-async", "straggler", "accuracy"),
                                         ("ddp2", "ddp", "homogeneous", "memory"),
                                         ("fsdp2", "fsdp", "homogeneous", "memory")):
        cells.append({"key": f"{strategy}/fast/{workers}/w2/{part}", "run": store.get_run(ref),
                      "labels": {"strategy": strategy, "network": "fast", "workers": workers, "world_size": 2,
                                 "part": part, "target_metric": 0.5}})
    headlines = [{"headline": "DDP speedup", "paper": "2-3x over one GPU", "measured": "0.9x on 2 shared cores",
                  "verdict": "not reproduced <here>"},
                 {"headline": "FSDP memory", "paper": ">60% less", "measured": "50% less parameters",
                  "verdict": "partly"}]
    decisions = ["Homogeneous gang-scheduled workers: use DDP.", "Memory-bound: use FSDP & accept the cost."]
    html = study_report(store, "study <1>", cells, headlines, decisions, ["ranks oversubscribe the cores"])
    _self_contained(html)
    assert len(_images(html)) >= 7
    assert "main study reports" in html and "ddlscope measured here" in html
    assert "2-3x over one GPU" in html and "0.9x on 2 shared cores" in html and "not reproduced &lt;here&gt;" in html
    assert re.search(r'<ol class="decisions">\s*<li>Homogeneous gang-scheduled workers: use DDP.</li>', html)
    assert "accept the cost" in html and "&amp; accept" in html
    assert "study &lt;1&gt;" in html and "ranks oversubscribe the cores" in html
    for cell in cells:
        assert cell["key"] in html
    assert "time to target" in html and "not reached" in html  # ps-async climbs slower than the 0.5 target
    assert "mean staleness" in html
    for section in ("headlines", "cells", "throughput", "memory", "accuracy", "ps", "breakdown", "decisions"):
        assert f'<section id="{section}">' in html, section
    assert html.index('id="headlines"') < html.index('id="cells"') < html.index('id="decisions"')


def _study_cells(store, with_summaries: bool) -> list[dict]:
    from ddlscope.analysis.summary import summarize

    cells = []
    for ref, strategy in (("single", "single"), ("ddp2", "ddp"), ("psasync", "ps-async")):
        run = store.get_run(ref)
        cell = {"key": f"{strategy}/w{run.world_size}", "run": run,
                "labels": {"strategy": strategy, "world_size": run.world_size}}
        if with_summaries:
            cell["summary"] = summarize(store, run)
        cells.append(cell)
    return cells


def test_study_report_reads_the_summaries_it_is_given(store, monkeypatch):
    import ddlscope.report.html as html_module

    expected = study_report(store, "s", _study_cells(store, with_summaries=False), [], ["d"], ["n"])
    cells = _study_cells(store, with_summaries=True)

    def no_second_summary(*args, **kwargs):
        raise AssertionError("study_report summarised a run it was given the summary of")

    monkeypatch.setattr(html_module, "summarize", no_second_summary)
    assert study_report(store, "s", cells, [], ["d"], ["n"]) == expected
    cells[1]["summary"].throughput_samples_per_s = 12345.0  # the page shows the summary it was given
    assert "12,345" in study_report(store, "s", cells, [], ["d"], ["n"])


def test_study_report_without_headlines_has_no_headline_section(store):
    cells = _study_cells(store, with_summaries=False)
    with_empty = study_report(store, "s", cells, [], [], [])
    assert '<section id="headlines">' in with_empty and "No headlines." in with_empty
    without = study_report(store, "s", cells, None, [], [])
    assert 'id="headlines"' not in without and "main study" not in without and 'href="#headlines"' not in without
    assert '<section id="cells">' in without and "ddp/w2" in without


def test_write_report_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "r.html"
    write_report("<p>one</p>", path)
    assert path.read_text() == "<p>one</p>"

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OutputError, match="disk full"):  # one line for the user, not a traceback
        write_report("<p>two</p>", path)
    assert path.read_text() == "<p>one</p>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]  # no temp file left behind
    monkeypatch.undo()
    write_report("<p>three</p>", path)
    assert path.read_text() == "<p>three</p>" and sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


def test_figures_deterministic_and_none_without_data():
    a = figures.breakdown_bars(["a $x$", "b"], [{"forward_s": 0.002, "comm_wait_s": 0.001}, {"data_s": 0.001}])
    assert a == figures.breakdown_bars(["a $x$", "b"], [{"forward_s": 0.002, "comm_wait_s": 0.001},
                                                        {"data_s": 0.001}])
    assert base64.b64decode(a.split(",", 1)[1]).startswith(PNG_SIGNATURE)
    assert figures.throughput_speedup([], [], []) is None
    assert figures.staleness_histograms({"ps": []}) is None
    assert figures.metric_curves({}) is None
    assert figures.server_update_times(["s"], [0.001], [None], [None]) is None
    times = figures.server_update_times(["ps r2", "ps r3"], [0.004, None], [0.0002, 0.0003], [0.01, None])
    assert base64.b64decode(times.split(",", 1)[1]).startswith(PNG_SIGNATURE)
    # the queue is drawn: a longer one is another picture
    assert times != figures.server_update_times(["ps r2", "ps r3"], [0.008, None], [0.0002, 0.0003], [0.01, None])


def test_cli_report_writes_page_and_bad_ref_is_one_line(store, tmp_path):
    from typer.testing import CliRunner

    from ddlscope.cli import app
    from ddlscope.store import StoreError

    out = tmp_path / "r.html"
    result = CliRunner().invoke(app, ["report", "single", "ddp2", "--db", str(store.path), "-o", str(out),
                                      "--title", "cli <t>"])
    assert result.exit_code == 0, result.output
    html = out.read_text()
    assert "cli &lt;t&gt;" in html and "#2 ddp2" in html
    _self_contained(html)
    bad = CliRunner().invoke(app, ["report", "nope", "--db", str(store.path), "-o", str(out)])
    assert isinstance(bad.exception, StoreError)

    # through ddlscope's main(): one line on stderr, exit 2; and the report layer never loads torch
    code = ("import sys; from ddlscope import cli\n"
            "import ddlscope.report.html\n"
            "assert 'torch' not in sys.modules, 'report imported torch'\n"
            "sys.exit(cli.main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "report", "nope", "--db", str(store.path), "-o", str(out)],
                          env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: no run 'nope' in {store.path}"]


def test_study_scaling_series_starts_at_the_one_process_cell_and_uses_effective_steps():
    from types import SimpleNamespace

    from ddlscope.report.html import _study_scaling_series

    def cell(strategy, world, effective_step_s, wall_efficiency=0.1):
        run = SimpleNamespace(world_size=world, strategy=strategy,
                              config={"workload": {"name": "resnet-cifar", "batch_size": 64}})
        summary = SimpleNamespace(effective_step_s=effective_step_s, scaling_efficiency=wall_efficiency)
        labels = {"strategy": strategy, "network": "fast" if world > 1 else "none", "workers": "homogeneous",
                  "world_size": world, "part": "accuracy"}
        return {"labels": labels}, SimpleNamespace(run=run, summary=summary)

    pairs = [cell("single", 1, 0.080), cell("ddp", 2, 0.050), cell("ddp", 4, 0.025)]
    series = _study_scaling_series([c for c, _ in pairs], [d for _, d in pairs])
    # 0.080 / 0.050 / 2 and 0.080 / 0.025 / 4, not the wall-clock 0.1
    assert series == {"ddp · fast · homogeneous": {1: 1.0, 2: pytest.approx(0.8), 4: pytest.approx(0.8)}}


def test_a_figure_that_does_not_apply_gets_no_bar_label_and_axes_show_plain_values(monkeypatch):
    import matplotlib.axes

    from ddlscope.report import figures

    labels: list[str] = []
    original = matplotlib.axes.Axes.annotate
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate",
                        lambda self, text, *a, **k: (labels.append(text), original(self, text, *a, **k))[1])
    assert figures.throughput_speedup(["single", "ddp", "memory"], [100.0, 180.0, 5.0], [1.0, 1.8, None])
    assert labels == ["100", "180", "5.00", "1.00x", "1.80x"]  # the memory cell's speedup: no "n/a" bar
    # a perplexity of 27.588951 to 27.588952 reads as itself, not as "1e-6 + 2.758895e1"
    import matplotlib.pyplot as plt

    with plt.rc_context(figures._STYLE):
        fig, ax = plt.subplots()
        ax.plot([0, 1], [27.588951, 27.588952])
        fig.canvas.draw()
        assert ax.yaxis.get_major_formatter().get_offset() == ""
        plt.close(fig)


def test_a_verdict_is_its_word_and_the_details_below():
    from ddlscope.report.html import verdict_parts

    assert verdict_parts("agrees: async is faster; the loss exceeds the paper's") == (
        "agrees", "async is faster; the loss exceeds the paper's")
    assert verdict_parts("partly; accuracy recovered") == ("partly", "accuracy recovered")
    assert verdict_parts("agrees") == ("agrees", "")
