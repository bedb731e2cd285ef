"""The runs report as a person sees it, in Debian's chromium (tests/browser.py).

Real runs go through `ddlscope report`; the page is opened from a local file and
must render its tables and every figure (images decoded, non-zero size) with no
console errors. A screenshot is saved next to the report (and under
$DDLSCOPE_ARTIFACTS when set) so a person can look at it.
"""

import pytest

from browser import NEEDS_CHROMIUM, assert_reads_well, look_at

pytestmark = [pytest.mark.multiprocess, NEEDS_CHROMIUM]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from conftest import run_cli_here as run_cli  # no process of its own needed: ~2 s a run, not ~9

    home = tmp_path_factory.mktemp("browser")
    for args in (["--strategy", "single", "--world-size", "1", "--name", "base <b>line</b>"],
                 ["--strategy", "ddp", "--world-size", "2"],
                 ["--strategy", "ps-async", "--world-size", "2", "--set", "cluster.slowdown=[1, 2]"]):
        result = run_cli("run", "--steps", "12", "--quiet", "--set", "workload.eval_every=4", *args, cwd=home)
        assert result.returncode == 0, result.stderr
    result = run_cli("report", "1", "2", "3", "-o", "report.html", "--title", "browser <check>", cwd=home)
    assert result.returncode == 0, result.stderr
    return home / "report.html"


@pytest.mark.timeout(180)
def test_report_renders_in_chromium(report, tmp_path):
    page = look_at(report, tmp_path, "report")
    assert_reads_well(page, min_images=6, min_tables=3)
    assert page.title == "browser <check>"  # escaped in the source, shown as text
    assert "base <b>line</b>" in page.body  # a user string shows as text, not markup


@pytest.mark.timeout(180)
def test_on_a_narrow_window_wide_tables_scroll_under_their_row_names(report, tmp_path):
    page = look_at(report, tmp_path, "report-narrow", width=700)
    assert_reads_well(page, min_images=6, min_tables=3)
    assert page.wide_tables  # at 700 px the config and summary tables are wider than the window
