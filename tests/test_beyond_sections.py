"""The `beyond` study's graph and data sections (studies/beyond_graph.py, studies/beyond_data.py), run at
toy sizes: their rows, what must hold between them, and the rendered tables."""

from __future__ import annotations

import pytest

from ddlscope.studies import beyond_data, beyond_graph
from ddlscope.studies.text_table import render_rows


def test_render_rows_aligns_numbers_right_and_text_left() -> None:
    text = render_rows([{"name": "a", "n": 1.5, "k": 1200}, {"name": "bbb", "n": None, "k": 3}], "title")
    assert text.splitlines() == ["title", "name    n      k", "----  ---  -----", "a     1.5  1,200",
                                 "bbb     -      3"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_graph_section_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(beyond_graph.SIZES, True, (64, 128, 256))
    rows, table = beyond_graph.graph_section(quick=True)
    assert [(r["nodes"], r["attention"]) for r in rows] == [
        (n, a) for n in (64, 128, 256) for a in ("dense", "sparse", "nodepar x2")]
    by = {(r["nodes"], r["attention"]): r for r in rows}
    for n in (64, 128, 256):
        sparse, split = by[n, "sparse"], by[n, "nodepar x2"]
        # half the nodes per rank: about half the activations (the halo adds a little)
        assert 0.4 < split["activations MiB"] / sparse["activations MiB"] < 0.6
        assert split["sent KiB/step"] > 0 == sparse["sent KiB/step"]
    # dense grows faster than sparse as the graph grows
    assert (by[256, "dense"]["activations MiB"] / by[64, "dense"]["activations MiB"]
            > by[256, "sparse"]["activations MiB"] / by[64, "sparse"]["activations MiB"])
    assert beyond_graph.TITLE in table and "nodepar x2" in table


def test_data_section_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(beyond_data.SAMPLES, True, 400)
    rows, table = beyond_data.data_section(quick=True)
    naive, pipeline, ratio = rows
    assert naive["same batches"] == pipeline["same batches"] == "yes"
    assert naive["steps"] == pipeline["steps"] == 2 * (400 // beyond_data.BATCH)
    for row in (naive, pipeline):
        assert 0 < row["stall"] < 1 and row["samples/s"] > 0
    assert ratio["samples/s"] == pytest.approx(pipeline["samples/s"] / naive["samples/s"])
    assert "pipeline / naive" in table
