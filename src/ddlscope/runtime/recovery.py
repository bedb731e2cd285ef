"""Runs whose launcher died: their rows recovered from the rank files, their status made final.

A launcher killed outright (SIGKILL, out of memory, a closed terminal that took it down) never
ingests its ranks' row files nor marks its run; the run stays `running` with its rows on disk
(`ddlscope-runs/<uuid>/rank-N.jsonl` beside the store, runtime/rows.py). Whoever next opens the
store through the CLI calls `recover_orphaned_runs`: each `created` or `running` run whose
launcher was on this host and is gone gets its rank files ingested (idempotent: keyed by run,
rank and step), a `recovered` event (rank -1), and the status `failed`, or `interrupted` when a
rank recorded an interrupt. A launcher that saw its run end but could not store the rows (a full
disk, runtime/launcher.store_rows_and_status) left its verdict in the run's folder (`outcome.json`):
such a run gets that status and cause instead, and `finished` only when every step row is in. Runs
of other hosts, and runs whose launcher is alive, are left alone.

Two processes may recover at once: both ingest (the same rows, harmlessly), and the status and the
event are written in one transaction that only changes a run still `created` or `running`
(Store.finish_orphan), so one of them marks it and the other reports nothing. The run's folder is
kept (its workers' logs are there), except a finished one's, as the launcher would have done.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddlscope.runtime.rows import ingest_run_dir, read_outcome, run_dir_for, run_files
from ddlscope.specs import ConfigError
from ddlscope.store import Run, Store

# What a rank writes when it is interrupted (runtime/worker.py records the exception as an `error` event).
INTERRUPT_PREFIXES = ("KeyboardInterrupt", "SignalException")


@dataclass
class RecoveredRun:
    run_id: int
    status: str  # failed | interrupted, or finished (its launcher's verdict, every row stored now)
    error: str
    run_dir: Path
    rows: dict[str, int] = field(default_factory=dict)

    def note(self) -> str:
        """One line for the user."""
        return f"run {self.run_id}: {self.error or f'rows stored from {self.run_dir}'}; marked {self.status}"


class RunLocked(ConfigError):
    """Another live launcher owns the run (one line)."""


def orphaned_runs(store: Store) -> list[Run]:
    """Unfinished runs whose launcher ran on this host and is gone (its pid gone, and nobody holds the
    run's launcher lock: a pid alone may have been reused, or be an older launcher's)."""
    return [run for run in store.unfinished_runs() if run.shown_status == "died"
            and not run_lock_held(run_dir_for(store.path, run.uuid))]


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
        outcome = read_outcome(run_dir)
        if outcome is not None:
            status, error = _status_from(outcome, store.count_steps(run.id))
        else:
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
            if status == "finished":
                shutil.rmtree(run_dir, ignore_errors=True)  # every row is in the store now
    return recovered


def _status_from(outcome: dict[str, Any], stored_steps: int) -> tuple[str, str]:
    """The launcher's verdict and its cause; a finished run that lacks step rows is failed."""
    status, error = str(outcome["status"]), str(outcome.get("error") or "")
    expected = outcome.get("expected_steps")
    if status == "finished" and isinstance(expected, int) and stored_steps != expected:
        return "failed", f"expected {expected} step rows, got {stored_steps}"
    return status, error


def _interrupted(store: Store, run_id: int) -> bool:
    """Whether a rank recorded an interrupt (Ctrl-C, or a signal the elastic agent forwarded)."""
    return any(e["rank"] >= 0 and (e["kind"] == "interrupted" or
                                   (e["kind"] == "error" and str(e["message"]).startswith(INTERRUPT_PREFIXES)))
               for e in store.events(run_id))


# ---------------------------------------------------------------------------- one live launcher per run
# A launcher holds an exclusive flock on this file in the run's folder for the run's whole life: a
# second launcher of the same run (two `run --resume`) is refused, and recovery leaves alone a run whose
# lock is held whatever its stored pid says. The kernel drops the lock when the holder dies, however.
RUN_LOCK = "launcher.lock"


def hold_run_lock(run_dir: Path) -> int:
    """Take the run's launcher lock; its file descriptor (close it to let go). Raises RunLocked when another
    process holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunLocked(f"run folder {run_dir} is in use by another live launcher (a run or a --resume of it); "
                        "wait for it to end") from None
    return fd


def run_lock_held(run_dir: Path) -> bool:
    """Whether a live launcher holds the run's lock (this process included)."""
    try:
        fd = os.open(run_dir / RUN_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also lets go of the shared lock just taken
