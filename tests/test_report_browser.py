"""The HTML report as a person sees it: Debian's chromium, headless, driven by Playwright.

Real runs go through `ddlscope report`; the page is opened from a local file and
must render its tables and every figure (images decoded, non-zero size) with no
console errors. A screenshot is saved next to the report (and under
$DDLSCOPE_ARTIFACTS when set) so a person can look at it.
"""

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a sandbox without a session bus or network: no background traffic, no first-run work.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-quic"]

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)"),
]


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
    sync_api = pytest.importorskip("playwright.sync_api")
    console_errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        # A fresh profile per test: launch_persistent_context owns --user-data-dir.
        context = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                        args=CHROMIUM_ARGS, viewport={"width": 1300, "height": 900})
        page = context.new_page()
        page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: console_errors.append(str(exc)))
        page.goto(report.resolve().as_uri())
        page.wait_for_load_state("load")
        images = page.evaluate("""() => Array.from(document.images).map(img => ({
            ok: img.complete && img.naturalWidth > 0 && img.naturalHeight > 0,
            width: img.getBoundingClientRect().width, height: img.getBoundingClientRect().height,
            src: img.src.slice(0, 22)}))""")
        tables = page.evaluate("() => Array.from(document.querySelectorAll('table')).map(t => t.rows.length)")
        title = page.title()
        body = page.inner_text("body")
        shot = report.with_suffix(".png")
        page.screenshot(path=str(shot), full_page=True)
        context.close()

    assert not console_errors, console_errors
    assert len(images) >= 6, images
    assert all(img["ok"] and img["width"] > 0 and img["height"] > 0 for img in images), images
    assert all(img["src"].startswith("data:image/png") for img in images)
    assert len(tables) >= 3 and all(rows >= 2 for rows in tables[:3]), tables
    assert title == "browser <check>"  # escaped in the source, shown as text
    assert "base <b>line</b>" in body  # a user string shows as text, not markup
    assert shot.stat().st_size > 10_000
    artifacts = os.environ.get("DDLSCOPE_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / "report.png")
