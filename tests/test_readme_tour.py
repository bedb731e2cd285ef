"""The README's "A short tour", verbatim, on a fresh store, from a folder holding the checkout's configs/.

The commands are read from README.md itself (continued lines joined, comments dropped, `a && b` as two
commands), so a tour that stops working, or a README that drifts from the CLI, fails here. They run in
this process (conftest.run_cli_here: the same exit status and output as `ddlscope ...`; the runs' ranks
are processes of their own). Each report the tour writes is then opened in chromium (tests/browser.py).
"""

from __future__ import annotations

import csv
import io
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from browser import NEEDS_CHROMIUM, assert_reads_well, look_at
from conftest import CliResult, run_cli_here

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


def tour_commands(readme: str) -> list[list[str]]:
    """The argument lists of the `ddlscope` commands in the README's tour, in order."""
    section = readme.split("\n## A short tour\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1:]
    return commands


def test_the_tour_is_read_from_the_readme_as_a_shell_reads_it():
    commands = tour_commands("intro\n## A short tour\n\n```bash\nddlscope run --name a   # a comment\n"
                             "ddlscope run --x 1 \\\n    --y '2 3' && ddlscope show a\n```\nddlscope not-in-block\n")
    assert commands == [["ddlscope", "run", "--name", "a"], ["ddlscope", "run", "--x", "1", "--y", "2 3"],
                        ["ddlscope", "show", "a"]]


@pytest.fixture(scope="module")
def tour(tmp_path_factory) -> tuple[Path, dict[str, CliResult]]:
    home = tmp_path_factory.mktemp("tour")
    shutil.copytree(ROOT / "configs", home / "configs")  # the tour runs from the checkout: configs/ beside it
    results: dict[str, CliResult] = {}
    for words in tour_commands((ROOT / "README.md").read_text()):
        assert words[0] == "ddlscope", words
        result = run_cli_here(*words[1:], cwd=home)
        assert result.returncode == 0, (shlex.join(words), result.stdout[-3000:], result.stderr[-3000:])
        results[shlex.join(words[1:])] = result
    return home, results


def _output(results: dict[str, CliResult], prefix: str) -> str:
    (key,) = [k for k in results if k.startswith(prefix)]
    return results[key].stdout


@pytest.mark.timeout(600)
def test_every_command_of_the_tour_works_on_a_fresh_store_and_names_its_runs(tour):
    home, results = tour
    assert len(results) >= 14  # the whole block was read
    for command in results:  # runs are named, so the tour does not depend on what else made runs
        words = command.split()
        if words[0] in ("show", "export", "trace", "report"):
            refs = [w for w in words[1:] if not w.startswith("-")][: 1 if words[0] != "report" else 3]
            assert refs and not any(ref.isdigit() for ref in refs), command
    listed = _output(results, "runs")
    for name in ("base", "ddp4", "async"):
        assert re.search(rf"\b{name}\b", listed), name


@pytest.mark.timeout(600)
def test_the_tour_shows_what_the_readme_says_it_does(tour):
    home, results = tour
    shown = _output(results, "show ddp4")
    assert re.search(r"speedup vs single\s+\d+\.\d+x", shown), shown  # against the base run, steps aside
    steps = list(csv.DictReader(io.StringIO(_output(results, "export ddp4 --format csv"))))
    assert len(steps) == 50 * 4 and {row["rank"] for row in steps} == {"0", "1", "2", "3"}
    assert (home / "runs.html").stat().st_size > 50_000
    assert (home / "ddp-vs-fsdp-report.html").stat().st_size > 50_000
    assert "within noise" in _output(results, "sweep") or "Highest" in _output(results, "sweep")
    trace = json.loads((home / "run.json").read_text())
    assert {event.get("ph") for event in trace["traceEvents"]} >= {"X"}
    assert "[collectives" in (home / "ddlscope-calibration.toml").read_text()
    predicted = json.loads(_output(results, "predict"))
    assert 0.5 < predicted["step_time_s"] < 50 and predicted["fits"], predicted
    assert "tp" in _output(results, "plan").lower()


@NEEDS_CHROMIUM
@pytest.mark.timeout(300)
@pytest.mark.parametrize("report, images, tables", [("runs.html", 11, 4), ("ddp-vs-fsdp-report.html", 4, 1)])
def test_each_report_of_the_tour_reads_well_in_chromium(tour, report, images, tables, tmp_path):
    home, _ = tour
    page = look_at(home / report, tmp_path, f"tour-{Path(report).stem}", width=1000)
    assert_reads_well(page, min_images=images, min_tables=tables)
