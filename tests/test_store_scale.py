"""The store at scale, small: 64 ranks x 500 steps of synthetic rank files (the workers' format,
benchmarks/synthetic_rows.py) through the columnar ingest, the SQL summary, the streaming exports and
the report; and the streaming trace merge. Every figure is checked against one computed directly from
the generated rows, in plain Python, the way the summary defines it. The speed and memory goals are
benchmarks/store_scale.py's, not these tests'."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

from ddlscope.runtime import rows as rowfiles
from ddlscope.runtime.rows import ingest_run_dir, read_records, run_files
from ddlscope.store import STEP_COLUMNS, Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synthetic_rows import STRAGGLER, Shape, config_of, write_synthetic_run, write_synthetic_traces  # noqa: E402

RANKS, STEPS = 64, 500
PHASES = ("data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s")


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory):
    """(store path, run id, baseline id, the generated records): the big run and a one-rank baseline."""
    home = tmp_path_factory.mktemp("scale")
    db = home / "scale.db"
    run_id, run_dir = write_synthetic_run(db, Shape(RANKS, STEPS), name="scale")
    base_id, base_dir = write_synthetic_run(db, Shape(1, STEPS, strategy="single"), name="base",
                                            workload=config_of(Shape(RANKS, STEPS))["workload"])
    records = [r for path in run_files(run_dir) for r in read_records(path)]
    with Store(db) as store:
        for rid, folder in ((run_id, run_dir), (base_id, base_dir)):
            ingest_run_dir(store, rid, folder)
            store.mark_done(rid, "finished")
    return db, run_id, base_id, records


def expected_summary(records: list[dict]) -> dict:
    """The summary's definitions, computed from the rank files' records without the store."""
    steps = [r for r in records if r["kind"] == "step"]
    first = sorted({r["step"] for r in steps})[1]
    steady = [r for r in steps if r["step"] >= first]
    by_rank: dict[int, list[dict]] = {}
    by_step: dict[int, list[dict]] = {}
    for r in steady:
        by_rank.setdefault(r["rank"], []).append(r)
        by_step.setdefault(r["step"], []).append(r)
    mean_step_s = max(statistics.fmean(x["step_s"] for x in rs) for rs in by_rank.values())
    stragglers: dict[int, int] = {}
    for rs in by_step.values():
        slowest = max(sorted(rs, key=lambda x: x["rank"]), key=lambda x: x["step_s"] - x["comm_wait_s"])["rank"]
        stragglers[slowest] = stragglers.get(slowest, 0) + 1
    cpu = {}
    for r in steps:
        cpu[r["rank"]] = cpu.get(r["rank"], 0.0) + r["step_s"] - r["forward_s"] - r["backward_s"] + r["compute_cpu_s"]
    last = max(r["step"] for r in steps)
    return {
        "steps_recorded": len({r["step"] for r in steps}), "ranks_recorded": len({r["rank"] for r in steps}),
        "mean_step_s": mean_step_s,
        "throughput_samples_per_s": statistics.fmean(sum(x["samples"] for x in rs) for rs in by_step.values())
        / mean_step_s,
        "breakdown_mean_s": {p: statistics.fmean(r[p] for r in steady) for p in PHASES},
        "comm_s": statistics.fmean(r["comm_s"] for r in steady),
        "bytes_sent_per_step": statistics.fmean(r["bytes_sent"] for r in steady),
        "final_loss": statistics.fmean(r["loss"] for r in steps if r["step"] == last),
        "train_wall_s": max(r["t_s"] + r["step_s"] for r in steps),
        "cpu_derived_step_s": statistics.fmean(
            max(x["step_s"] - x["forward_s"] - x["backward_s"] + x["compute_cpu_s"] for x in rs)
            for rs in by_step.values()),
        "cpu_derived_wall_s": max(cpu.values()),
        "straggler_steps": dict(sorted(stragglers.items())),
        "slowest_step_s": [max(x["step_s"] for x in by_step[s]) for s in sorted(by_step)],
        "rank_means": {rank: {p: statistics.fmean(x[p] for x in rs) for p in PHASES} for rank, rs in by_rank.items()},
    }


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


def test_ingest_keeps_every_row_of_the_rank_files_exactly(scale_run):
    db, run_id, _, records = scale_run
    steps = {(r["rank"], r["step"]): r for r in records if r["kind"] == "step"}
    with Store(db) as store:
        stored = store.steps(run_id)
        assert len(stored) == len(steps) == RANKS * STEPS
        for row in stored:
            rec = steps[(row["rank"], row["step"])]
            assert all(row[c] == rec[c] for c in STEP_COLUMNS), (row["rank"], row["step"])  # exact: no rounding
        assert isinstance(stored[0]["rank"], int) and isinstance(stored[0]["samples"], int)
        assert len(store.evals(run_id)) == STEPS // 100
        assert len(store.events(run_id)) == sum(r["kind"] == "event" for r in records)
        assert len(store.memory(run_id)) == 5 * RANKS


def test_summary_equals_the_one_computed_from_the_generated_rows(scale_run):
    from ddlscope.analysis.summary import aggregate_steps, summarize

    db, run_id, base_id, records = scale_run
    want = expected_summary(records)
    with Store(db) as store:
        run = store.get_run(run_id)
        got = summarize(store, run)
        agg = aggregate_steps(store, run)
        base = summarize(store, store.get_run(base_id))
    assert got.steps_recorded == want["steps_recorded"] == STEPS
    assert got.ranks_recorded == want["ranks_recorded"] == RANKS
    for key in ("mean_step_s", "throughput_samples_per_s", "final_loss", "train_wall_s", "cpu_derived_step_s",
                "cpu_derived_wall_s"):
        assert close(getattr(got, key), want[key]), key
    for phase in PHASES:
        assert close(got.breakdown_mean_s[phase], want["breakdown_mean_s"][phase]), phase
    assert close(got.comm["comm_s"], want["comm_s"]) and close(got.comm["bytes_sent_per_step"], want["bytes_sent_per_step"])
    assert got.straggler_steps == want["straggler_steps"]
    assert max(got.straggler_steps, key=got.straggler_steps.get) == STRAGGLER  # the generator's slow rank
    assert agg.slowest_step_s() == pytest.approx(want["slowest_step_s"], rel=1e-12)
    for rank, means in want["rank_means"].items():
        got_means = agg.rank_means("data_s_or_zero")[rank], agg.rank_means("comm_wait_s_or_zero")[rank]
        assert close(got_means[0], means["data_s"]) and close(got_means[1], means["comm_wait_s"])
    assert got.baseline_run_id == base_id
    assert close(got.speedup_vs_single, got.throughput_samples_per_s / base.throughput_samples_per_s)
    assert got.mfu is not None and len(got.mfu_by_rank) == RANKS
    assert got.final_params_sha256 == "ab" * 32 and got.eval_curve[-1]["step"] == STEPS - 1


def test_a_torn_line_and_a_nan_loss_take_the_line_by_line_path_with_the_same_rows(tmp_path):
    """pyarrow refuses both; the chunk is then read as read_records reads it: the torn line skipped,
    the NaN loss stored as NULL, every other row kept."""
    db = tmp_path / "s.db"
    run_id, run_dir = write_synthetic_run(db, Shape(3, 40))
    path = rowfiles.rank_file(run_dir, 1)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[10] = lines[10][:40]  # cut short, the next record then begins on the same line
    nan_line = next(i for i, line in enumerate(lines) if b'"step":20,' in line)
    lines[nan_line] = lines[nan_line].replace(b'"loss":', b'"loss":NaN,"was":')
    path.write_bytes(b"".join(lines))
    expected = [r for p in run_files(run_dir) for r in read_records(p)]
    with Store(db) as store:
        counts = ingest_run_dir(store, run_id, run_dir)
        assert counts["step"] == sum(r["kind"] == "step" for r in expected) == 3 * 40 - 2  # the torn row, and the one that went on its line
        assert counts["event"] == sum(r["kind"] == "event" for r in expected)
        loss = store.conn.execute("SELECT loss FROM steps WHERE rank=1 AND step=20").fetchone()[0]
        assert loss is None
        assert store.count_steps(run_id) == 3 * 40 - 2  # the torn row, and the one that went on its line
        again = ingest_run_dir(store, run_id, run_dir)  # idempotent on either path
        assert again == counts and store.count_steps(run_id) == 3 * 40 - 2  # the torn row, and the one that went on its line


def test_exports_stream_every_row_with_the_stores_types(scale_run, tmp_path):
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from ddlscope.cli import app

    db, run_id, _, records = scale_run
    runner = CliRunner()
    out = runner.invoke(app, ["export", str(run_id), "--db", str(db), "--format", "csv"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert len(rows) == RANKS * STEPS and rows[0]["rank"] == "0" and rows[1]["step"] == "1"  # key order
    target = tmp_path / "steps.parquet"
    out = runner.invoke(app, ["export", str(run_id), "--db", str(db), "-f", "parquet", "-o", str(target)])
    assert out.exit_code == 0, out.output
    table = pq.read_table(target)
    assert table.num_rows == RANKS * STEPS and table.column_names == list(rows[0])
    assert str(table.schema.field("bytes_sent").type) == "int64" and str(table.schema.field("loss").type) == "double"
    assert table.column("step_s").to_pylist()[:3] == [float(r["step_s"]) for r in rows[:3]]
    events = pq.read_table(tmp_path / "e.parquet") if runner.invoke(app, [
        "export", str(run_id), "--db", str(db), "-f", "parquet", "--table", "events", "-o", str(tmp_path / "e.parquet")
    ]).exit_code == 0 else None
    assert events is not None and events.num_rows == sum(r["kind"] == "event" for r in records)
    out = runner.invoke(app, ["export", str(run_id), "--db", str(db), "-f", "json"], catch_exceptions=False)
    data = json.loads(out.stdout)
    assert len(data["steps"]) == RANKS * STEPS and data["run"]["name"] == "scale" and len(data["memory"]) == 5 * RANKS


def test_report_of_many_ranks_shows_distributions_and_stays_small(scale_run, monkeypatch):
    from ddlscope.report import figures, html

    db, run_id, base_id, _ = scale_run
    drawn: dict[str, list] = {"distribution": [], "bars": []}

    def spy(name, kind, title_at):
        original = getattr(figures, name)
        monkeypatch.setattr(figures, name, lambda *a, **k: drawn[kind].append(
            a[title_at] if kind == "distribution" else len(a[0])) or original(*a, **k))

    spy("rank_distribution", "distribution", 1)
    spy("breakdown_bars", "bars", 0)
    spy("memory_bars", "bars", 0)
    with Store(db) as store:
        page = html.runs_report(store, [store.get_run(run_id), store.get_run(base_id)], "scale")
    assert any(f"each of {RANKS} ranks" in t for t in drawn["distribution"])  # phases over the ranks
    assert any(f"over {RANKS} ranks" in t for t in drawn["distribution"])  # memory categories over the ranks
    assert drawn["bars"] and max(drawn["bars"]) <= html.RANK_BARS  # no figure with a bar per rank
    assert len(page) < 2_000_000 and page.count("data:image/png;base64,") >= 6


# ---------------------------------------------------------------------------- trace merge
def test_streaming_trace_reader_yields_the_events_whole_across_tiny_blocks(tmp_path, monkeypatch):
    from ddlscope.analysis import trace_merge

    written = write_synthetic_traces(tmp_path / "t", 2, 0.3)
    whole = json.loads(written[0][1].read_text())["traceEvents"]
    monkeypatch.setattr(trace_merge, "BLOCK_CHARS", 7)  # every event, number and string split across blocks
    assert list(trace_merge.iter_trace_events(written[0][1])) == whole
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(whole[::-1]))  # a bare list, the anchor near its end
    assert list(trace_merge.iter_trace_events(bare)) == whole[::-1]
    late = tmp_path / "late.json"
    late.write_text(json.dumps({"schemaVersion": 1234567890123, "deviceProperties": [{"x": [1, {"y": "]}"}]}],
                                "traceEvents": whole[::-1], "traceName": "z"}))
    assert list(trace_merge.iter_trace_events(late)) == whole[::-1]
    anchor = trace_merge._find_anchor(late)
    assert anchor is not None and anchor["ts"] == 1_000_000.0


def test_merge_of_streamed_traces_shifts_every_event_of_every_rank(tmp_path, monkeypatch):
    from ddlscope.analysis import trace_merge

    written = write_synthetic_traces(tmp_path / "t", 3, 0.2)
    source = json.loads(written[0][1].read_text())["traceEvents"]  # every rank's trace is this one
    monkeypatch.setattr(trace_merge, "BLOCK_CHARS", 4096)
    result = trace_merge.merge_traces([trace_merge.RankTrace(r, p) for r, p in written], tmp_path / "m.json")
    merged = json.loads((tmp_path / "m.json").read_text())["traceEvents"]
    kept = [e for e in source if not (e["ph"] == "M" and e["name"] in ("process_name", "process_sort_index"))]
    assert result.events == len(merged) == 3 * (2 + len(kept))
    for rank in range(3):
        mine = [e for e in merged if e["pid"] == rank and e["ph"] == "X"]
        original = [e for e in kept if e["ph"] == "X"]
        shift = 1000.0 * rank - 1_000_000.0  # sidecar anchors 1 ms apart; the anchor event at ts 1e6
        assert [e["ts"] for e in mine] == [round(e["ts"] + shift, 3) for e in original]
        flows = [e["id"] for e in merged if e["pid"] == rank and e["ph"] in ("s", "f")]
        assert flows and min(flows) > rank * 10**12 and max(flows) < (rank + 1) * 10**12


def test_throughput_counts_the_batch_once_where_every_rank_takes_all_of_it(tmp_path):
    """The same rows as a data-parallel run (each rank its share: the ranks' samples add up) and as a
    tensor-parallel one (every rank the whole batch: counted once)."""
    from ddlscope.analysis.summary import summarize

    throughput = {}
    for strategy in ("ddp", "tp"):
        db = tmp_path / f"{strategy}.db"
        run_id, run_dir = write_synthetic_run(db, Shape(4, 20, strategy=strategy), name=strategy)
        with Store(db) as store:
            ingest_run_dir(store, run_id, run_dir)
            store.mark_done(run_id, "finished")
            throughput[strategy] = summarize(store, store.get_run(run_id)).throughput_samples_per_s
    assert throughput["tp"] == pytest.approx(throughput["ddp"] / 4)
