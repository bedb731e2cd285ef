"""Runs whose launcher died: their rows recovered from the rank files, their status made final.

A launcher killed outright (SIGKILL, out of memory, a closed terminal that took it down) never
ingests its ranks' row files nor marks its run; the run stays `running` with its rows on disk
(`ddlscope-runs/<uuid>/rank-N.jsonl` beside the store, runtime/rows.py). Whoever next opens the
store through the CLI calls `recover_orphaned_runs`: each `created` or `running` run whose
launcher was on this host and is gone gets its rank files ingested (idempotent: keyed by run,
rank and step), a `recovered` event (rank -1), and the status `failed`, or `interrupted` when a
rank recorded an interrupt; never `finished`. Runs of other hosts, and runs whose launcher is
alive, are left alone.

Two processes may recover at once: both ingest (the same rows, harmlessly), and the status and the
event are written in one transaction that only changes a run still `created` or `running`
(Store.finish_orphan), so one of them marks it and the other reports nothing. The run's folder is
kept (its workers' logs are there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ddlscope.runtime.rows import ingest_run_dir, run_dir_for, run_files
from ddlscope.store import Run, Store

# What a rank writes when it is interrupted (runtime/worker.py records the exception as an `error` event).
INTERRUPT_PREFIXES = ("KeyboardInterrupt", "SignalException")


@dataclass
class RecoveredRun:
    run_id: int
    status: str  # failed | interrupted
    error: str
    run_dir: Path
    rows: dict[str, int] = field(default_factory=dict)

    def note(self) -> str:
        """One line for the user."""
        return f"run {self.run_id}: {self.error}; marked {self.status}"


def orphaned_runs(store: Store) -> list[Run]:
    """Unfinished runs whose launcher ran on this host and is gone."""
    return [run for run in store.unfinished_runs() if run.shown_status == "died"]


def recover_orphaned_runs(store: Store, store_path: Path) -> list[RecoveredRun]:
    """Ingest the rank files of every run whose launcher died and mark it failed (or interrupted).

    Returns the runs this call marked; a run another process recovered meanwhile is not among them.
    Raises StoreError when the store cannot be written (read-only, locked past the bound).
    """
    orphans = orphaned_runs(store)
    if not orphans:
        return []

    recovered = []
    for run in orphans:
        run_dir = run_dir_for(Path(store_path), run.uuid)
        files = run_files(run_dir) if run_dir.is_dir() else []
        rows = ingest_run_dir(store, run.id, run_dir) if files else {}
        steps = rows.get("step", 0)
        if files:
            error = f"launcher died (pid {run.launcher_pid}); rows recovered from the rank files: {steps} step rows"
        else:
            error = f"launcher died (pid {run.launcher_pid}); no rank files at {run_dir}"
        status = "interrupted" if _interrupted(store, run.id) else "failed"
        counts = ", ".join(f"{n} {kind}" for kind, n in rows.items() if n) or "no rows"
        event = f"launcher pid {run.launcher_pid} on {run.host} was gone; ingested {counts} from {run_dir}"
        last_write = max((f.stat().st_mtime for f in files), default=None)
        if store.finish_orphan(run.id, run.launcher_pid, status, error, event, finished_at=last_write):
            recovered.append(RecoveredRun(run.id, status, error, run_dir, rows))
    return recovered


def _interrupted(store: Store, run_id: int) -> bool:
    """Whether a rank recorded an interrupt (Ctrl-C, or a signal the elastic agent forwarded)."""
    return any(e["rank"] >= 0 and (e["kind"] == "interrupted" or
                                   (e["kind"] == "error" and str(e["message"]).startswith(INTERRUPT_PREFIXES)))
               for e in store.events(run_id))
