"""A report as a person sees it: Debian's chromium, headless, driven by Playwright (no browser download).

`look_at(report, ...)` opens a self-contained HTML report from its file, reads what a reader would check
(console errors, every figure decoded, the tables, whether the page or a wide table's row names slide out
of view), saves a full-page screenshot beside the report and, when $DDLSCOPE_ARTIFACTS is set, under it,
so a person can look at every report the suite made. `assert_reads_well` holds the checks every report
must pass.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a sandbox without a session bus or network: no background traffic, no first-run work.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-quic"]
# A test that looks at a page only in passing (after other checks) asks this, so a missing Playwright
# cannot skip the rest of it from inside `look_at`.
CAN_LOOK = CHROMIUM is not None and importlib.util.find_spec("playwright") is not None
NEEDS_CHROMIUM = pytest.mark.skipif(CHROMIUM is None,
                                    reason="chromium is not installed (apt-get install chromium; .ci/run does)")

# Every figure, decoded, with its laid-out size.
_IMAGES_JS = """() => Array.from(document.images).map(img => ({
    ok: img.complete && img.naturalWidth > 0 && img.naturalHeight > 0,
    width: img.getBoundingClientRect().width, height: img.getBoundingClientRect().height,
    src: img.src.slice(0, 22)}))"""
# Each wide table's box scrolled to its right end: does the row's name (first cell) stay in view at the
# box's left edge, as the sticky first column promises, or has it slid out with the rest?
_WIDE_TABLES_JS = """() => Array.from(document.querySelectorAll('table')).filter(t => {
        const box = t.parentElement; return box.scrollWidth > box.clientWidth + 1; }).map(t => {
    const box = t.parentElement;
    box.scrollLeft = box.scrollWidth;
    const first = t.rows[t.rows.length - 1].cells[0].getBoundingClientRect();
    const left = box.getBoundingClientRect().left;
    const kept = Math.abs(first.left - left) < 2;
    box.scrollLeft = 0;
    return {scrolls: getComputedStyle(box).overflowX, first_cell_kept: kept, header: t.rows[0].innerText.slice(0, 60)};
})"""


@dataclass
class Page:
    title: str
    body: str
    console_errors: list[str]
    images: list[dict[str, Any]]
    table_rows: list[int]
    page_overflow_px: float  # how far the page itself is wider than the window (0: no sideways scroll)
    wide_tables: list[dict[str, Any]]
    headings: list[str]
    screenshot: Path


def look_at(report: Path, tmp_path: Path, name: str, width: int = 1300) -> Page:
    """Open `report` in chromium at `width` pixels; the page's facts and a screenshot `name`.png."""
    sync_api = pytest.importorskip("playwright.sync_api")
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        # A fresh profile per page: launch_persistent_context owns --user-data-dir.
        context = pw.chromium.launch_persistent_context(str(tmp_path / f"profile-{name}"), executable_path=CHROMIUM,
                                                        args=CHROMIUM_ARGS, viewport={"width": width, "height": 900})
        try:
            page = context.new_page()
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(report.resolve().as_uri())
            page.wait_for_load_state("load")
            facts = dict(
                title=page.title(), body=page.inner_text("body"), images=page.evaluate(_IMAGES_JS),
                table_rows=page.evaluate("() => Array.from(document.querySelectorAll('table')).map(t => t.rows.length)"),
                page_overflow_px=page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth"),
                wide_tables=page.evaluate(_WIDE_TABLES_JS),
                headings=page.evaluate("() => Array.from(document.querySelectorAll('h2')).map(h => h.innerText)"))
            shot = report.with_name(f"{name}.png")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            context.close()
    artifacts = os.environ.get("DDLSCOPE_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / shot.name)
    return Page(console_errors=errors, screenshot=shot, **facts)


def assert_reads_well(page: Page, min_images: int, min_tables: int) -> None:
    """What every report owes its reader: no script errors, every figure shown, tables with rows, nothing
    pushed off the side of the window, and a wide table's row names in view however far it scrolls."""
    assert not page.console_errors, page.console_errors
    assert len(page.images) >= min_images, page.images
    assert all(img["ok"] and img["width"] > 0 and img["height"] > 0 for img in page.images), page.images
    assert all(img["src"].startswith("data:image/png") for img in page.images)  # self-contained
    assert len(page.table_rows) >= min_tables and all(rows >= 2 for rows in page.table_rows), page.table_rows
    assert page.page_overflow_px <= 0, f"the page is {page.page_overflow_px}px wider than the window"
    for table in page.wide_tables:
        assert table["scrolls"] == "auto" and table["first_cell_kept"], table
    assert page.screenshot.stat().st_size > 10_000
