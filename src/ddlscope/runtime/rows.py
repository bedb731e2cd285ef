"""Per-rank row files: the workers' side of the store.

Each rank appends one JSON object per line to its own file, line-buffered, so
every row reaches the kernel as soon as it is written and survives the
process dying. The launcher ingests the files into SQLite keyed by
(run, rank, step), so reading a file twice changes nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

from ddlscope.store import Store


class RowWriter:
    """Appends to the rank's file. A restarted or resumed rank appends to the file its earlier attempt
    wrote, and its events continue that attempt's numbering, so no event replaces another."""

    def __init__(self, path: Path, rank: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.rank = rank
        self._event_seq = 1 + max((r["seq"] for r in read_records(path) if r.get("kind") == "event"), default=-1) \
            if path.exists() else 0
        self._file = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        self._file.write(json.dumps({"kind": kind, "rank": self.rank, **fields}, separators=(",", ":")) + "\n")

    def write_record(self, record: dict[str, Any]) -> None:
        """Copy a record as it is (rows another rank produced)."""
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def event(self, event: str, message: str = "") -> None:
        self.write("event", seq=self._event_seq, t=time.time(), event=event, message=message)
        self._event_seq += 1

    def drop_after(self, step: int, update_seq: int | None = None) -> int:
        """Forget rows of steps >= `step` (and server updates numbered >= `update_seq`): a rank
        restored from the checkpoint taken after `step` steps writes them again. Events stay (they
        are the run's history: the fault, the restart). Rewritten whole and renamed into place, so a
        crash meanwhile leaves the old file. Returns the number of rows dropped."""
        self.close()
        kept, dropped = [], 0
        for record in read_records(self.path) if self.path.exists() else ():
            kind = record.get("kind")
            stale = ((kind in ("step", "eval") and record.get("step", -1) >= step)
                     or (kind == "update" and update_seq is not None and record.get("seq", -1) >= update_seq)
                     or kind == "memory")  # measured at the end of training: the new attempt measures again
            dropped += stale
            if not stale:
                kept.append(json.dumps(record, separators=(",", ":")) + "\n")
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join(kept), encoding="utf-8")
        partial.replace(self.path)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        return dropped

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def rank_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank-{rank}.jsonl"


def leave_done_marker(run_dir: Path, rank: int, pid: int) -> None:
    """A rank's pid in `done-RANK.pid`, once its rows are written and every rank has finished
    (written whole: a reader never sees half of it)."""
    partial = run_dir / f"done-{rank}.partial"
    partial.write_text(str(pid))
    partial.replace(run_dir / f"done-{rank}.pid")


def done_pids(run_dir: Path) -> list[int]:
    """The pids of the ranks that left a done marker in run_dir."""
    return [int(path.read_text()) for path in sorted(run_dir.glob("done-*.pid"))]


def remote_rank_file(run_dir: Path, rank: int) -> Path:
    """Where rank 0 writes the rows a rank on another node sent it."""
    return run_dir / f"remote-rank-{rank}.jsonl"


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Records of one file; a line cut short by a dying process is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record


def run_dir_for(store_path: Path, run_uuid: str) -> Path:
    """A run's folder (row files, logs, heartbeats, checkpoints): beside the store, by uuid."""
    return store_path.resolve().parent / "ddlscope-runs" / run_uuid


def ingest_run_dir(store: Store, run_id: int, run_dir: Path) -> dict[str, int]:
    """Every row of a run's files into the store, in one transaction (idempotent)."""
    def records() -> Iterator[dict[str, Any]]:
        for path in run_files(run_dir):
            yield from read_records(path)

    return store.ingest(run_id, records())


def run_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("*rank-*.jsonl"))
