import os
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# Generated data sets (the vision workloads') are cached in one folder for the whole session, not in
# the user's ~/.cache; ranks and CLI processes inherit it.
os.environ.setdefault("DDLSCOPE_CACHE_DIR", tempfile.mkdtemp(prefix="ddlscope-test-cache-"))


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, cwd: Path, timeout_s: float = 240, columns: int = 200) -> CliResult:
    """Run `ddlscope ARGS` as a user would: a fresh process, no TTY, `columns` wide."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": str(columns)}
    proc = subprocess.run([sys.executable, "-m", "ddlscope", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def run_cli_here(*args: str, cwd: Path, columns: int = 200, timeout_s: float | None = None) -> CliResult:  # noqa: ARG001
    """`ddlscope ARGS` in this process, from `cwd`: the same exit status, standard output and error as
    run_cli, for tests that need no process of their own. The second and later runs reuse this process's
    imports and rank fork server: a short run takes ~2 s here instead of ~9 s in a fresh process.
    `timeout_s` is run_cli's, taken and ignored: the test's own timeout applies."""
    import contextlib
    import io

    from ddlscope.cli import main
    from ddlscope.cli.common import console, err_console

    out, err = io.StringIO(), io.StringIO()
    widths = console._width, err_console._width  # rich keeps the width it read from COLUMNS at import
    here = os.getcwd()
    try:
        os.chdir(cwd)
        console.width = err_console.width = columns
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
        console._width, err_console._width = widths
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli(request: pytest.FixtureRequest, tmp_path: Path):
    """`ddlscope ARGS` from the test's own folder, in a fresh process; in this one (run_cli_here) for a module
    marked `cli_in_this_process`, whose runs need no process of their own (none is signalled, none checks
    what a rank prints on the terminal)."""
    in_this_process = request.node.get_closest_marker("cli_in_this_process") is not None

    def call(*args: str, timeout_s: float = 240) -> CliResult:
        if in_this_process:
            return run_cli_here(*args, cwd=tmp_path)  # the test's own timeout applies
        return run_cli(*args, cwd=tmp_path, timeout_s=timeout_s)

    return call


@pytest.fixture
def db_rows(tmp_path: Path):
    def query(sql: str, *params: object) -> list[tuple]:
        with sqlite3.connect(tmp_path / "ddlscope.db") as conn:
            return conn.execute(sql, params).fetchall()

    return query
