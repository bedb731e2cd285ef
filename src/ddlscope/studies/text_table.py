"""A plain-text table of dict rows, for the terminal and reports (column widths from the contents)."""

from __future__ import annotations

from typing import Any


def render_rows(rows: list[dict[str, Any]], title: str = "") -> str:
    """Columns in the first row's key order; numbers right-aligned, text left-aligned."""
    if not rows:
        return title
    headers = list(rows[0])
    cells = [[_cell(row.get(h)) for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row.get(h), (int, float)) for row in rows if row.get(h) is not None) for h in headers]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths]), *(line(c) for c in cells)]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
