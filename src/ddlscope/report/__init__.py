"""Reports: self-contained HTML pages (figures as PNG data URIs) of stored runs and of studies.

Reads the store and the analysis layer; never the runtime, never torch.
`ddlscope.report.html` holds the pages, `ddlscope.report.figures` the plots
(matplotlib, Agg); the `ddlscope report` command is in `ddlscope.cli.report`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["runs_report", "study_report", "write_report"]


def __getattr__(name: str) -> Any:  # lazy: importing the package does not load matplotlib
    if name in __all__:
        from ddlscope.report import html

        return getattr(html, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
