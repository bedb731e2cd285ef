"""The CLI package's shape (command modules share only `common`, one default store path) and export."""

from __future__ import annotations

import ast
import csv
import io
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ddlscope.cli import COMMANDS, app, main
from ddlscope.store import Store

SRC = Path(__file__).resolve().parents[1] / "src"
CLI_DIR = SRC / "ddlscope" / "cli"
SHARED = {"__init__", "common"}  # what command modules may import from the package


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement in `path` names, as `from a.b import c` -> a.b and a.b.c."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import run` / `from .run import x`
                base = "ddlscope.cli" + (f".{base}" if base else "")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_command_modules_import_no_sibling_command_module():
    modules = {p.stem for p in CLI_DIR.glob("*.py")}
    commands = modules - SHARED
    assert {"run", "predict", "advise", "calibrate", "report"} <= commands
    for name in sorted(commands | {"common"}):
        imported = _imported_modules(CLI_DIR / f"{name}.py")
        siblings = {m.split(".")[2] for m in imported if m.startswith("ddlscope.cli.")}
        assert siblings <= {"common"}, f"cli/{name}.py imports {sorted(siblings - {'common'})}"


def test_every_command_function_lives_in_a_command_module():
    for name, function in COMMANDS:
        module = function.__module__.removeprefix("ddlscope.cli.")
        assert module not in SHARED, f"{name} is defined in cli/{module}.py"


def test_default_store_path_is_written_once_in_src():
    hits = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if "ddlscope.db" in line]
    assert len(hits) == 1 and hits[0].startswith("ddlscope/store.py:"), hits


def test_the_cli_has_one_console_per_stream():
    made = {p.name: p.read_text().count("Console(") for p in CLI_DIR.glob("*.py") if "Console(" in p.read_text()}
    assert made == {"common.py": 2}, made


# ---------------------------------------------------------------------------- export
@pytest.fixture
def store_with_run(tmp_path: Path) -> Path:
    """A store holding one finished two-rank run of three steps, written directly (no processes)."""
    db = tmp_path / "s.db"
    with Store(db) as store:
        run_id = store.create_run(uuid="0" * 32, name="two", workload="mlp-digits", strategy="ddp", world_size=2,
                                  config={"name": "two"}, code_version="test", seed=0, environment={})
        store.mark_running(run_id)
        store.ingest(run_id, [
            {"kind": "step", "rank": rank, "step": step, "t_s": 0.01 * step, "data_s": 0.001, "forward_s": 0.002,
             "backward_s": 0.003, "comm_wait_s": 0.0005 * rank, "optimizer_s": 0.001, "step_s": 0.0075,
             "comm_s": 0.001, "compute_cpu_s": 0.005, "samples": 32, "loss": 2.0 - 0.25 * step, "bytes_sent": 1000}
            for rank in range(2) for step in range(3)])
        store.mark_done(run_id, "finished")
    return db


def _export(db: Path, *args: str) -> str:
    result = CliRunner().invoke(app, ["export", "two", "--db", str(db), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_parquet_export_holds_the_csv_exports_rows_and_columns(store_with_run: Path, tmp_path: Path):
    import pyarrow.parquet as pq

    rows = list(csv.DictReader(io.StringIO(_export(store_with_run, "--format", "csv"))))
    target = tmp_path / "steps.parquet"
    _export(store_with_run, "--format", "parquet", "-o", str(target))
    table = pq.read_table(target)
    assert len(rows) == table.num_rows == 6
    assert table.column_names == list(rows[0])
    as_csv_text = [{k: "" if v is None else str(v) for k, v in row.items()} for row in table.to_pylist()]
    assert as_csv_text == rows
    assert table.schema.field("step").type == "int64" and table.schema.field("loss").type == "double"


def test_parquet_export_to_stdout_is_the_same_file(store_with_run: Path, tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    result = CliRunner().invoke(app, ["export", "two", "--db", str(store_with_run), "-f", "parquet", "--table", "steps"])
    assert result.exit_code == 0, result.output
    from_stdout = pq.read_table(pa.BufferReader(result.stdout_bytes))
    target = tmp_path / "steps.parquet"
    _export(store_with_run, "--format", "parquet", "-o", str(target))
    assert from_stdout.equals(pq.read_table(target))


def test_parquet_export_of_an_empty_table_keeps_the_header(store_with_run: Path, tmp_path: Path):
    import pyarrow.parquet as pq

    target = tmp_path / "evals.parquet"
    _export(store_with_run, "-f", "parquet", "--table", "evals", "-o", str(target))
    assert pq.read_table(target).num_rows == 0


@pytest.mark.parametrize("args, message", [
    (["--format", "xlsx"], "error: --format = 'xlsx': allowed: csv, json, parquet"),
    (["--format", "parquet", "--table", "nope"], "error: --table = 'nope': allowed: steps, evals, memory, events"),
])
def test_bad_export_option_is_one_line_and_exit_2(store_with_run: Path, capsys, args: list[str], message: str):
    code = main(["export", "two", "--db", str(store_with_run), *args])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.strip().splitlines() == [message]


# ---------------------------------------------------------------------------- progress
def test_the_progress_line_names_every_phase_of_a_run(tmp_path: Path):
    """From the launcher's follower (rank 0's events, steps) to the bar: no phase goes unnamed."""
    import json
    import threading

    from ddlscope.cli.run import _progress
    from ddlscope.runtime.launcher import start_progress, storing_rows
    from ddlscope.runtime.rows import RowWriter, rank_file

    writer = RowWriter(rank_file(tmp_path, 0), 0)
    writer.event("started", "host=x pid=1")
    writer.event("train_start", "per_rank_batch=4")
    for step in range(3):
        writer.write("step", step=step, samples=4, step_s=0.01, loss=1.0)
    writer.event("train_end", "train_s=0.03")
    writer.close()

    seen: list[str] = []
    progress = _progress(3, enabled=True)
    with progress as update:
        def record(row: dict) -> None:
            update(row)
            seen.append(progress.bar.tasks[0].description)

        assert progress.bar.tasks[0].description == "starting ranks"
        stop = threading.Event()
        thread = start_progress(tmp_path, 0, record, stop)
        stop.set()
        thread.join(timeout=10)
        storing_rows(record)
    assert seen == ["starting ranks", "training", "training", "training", "evaluating, saving", "finishing",
                    "storing rows"], json.dumps(seen)
