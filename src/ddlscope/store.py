"""The results store: SQLite (stdlib), WAL, a busy timeout.

Workers never write here. Each rank appends rows to its own line-buffered
JSONL file while it trains (see runtime/rows.py); the launcher ingests those
files into this store keyed by (run, rank, step), so ingesting twice, or after
a crash, neither loses nor duplicates rows. A run's status moves
created -> running -> finished | failed | interrupted, and only the launcher,
after the workers returned and the rows are in, marks it finished.

A write that finds the store locked by another process waits and retries (sqlite's busy
timeout per try, `busy_timeout_s`, within a total bound, `lock_wait_s`; the environment
variables DDLSCOPE_STORE_BUSY_TIMEOUT_S and DDLSCOPE_STORE_LOCK_WAIT_S set the defaults);
only past the bound does it give up, with a StoreError. A file that is not a store, is
damaged, read-only or unreadable, or a directory, is a StoreError too: one line saying
what and how to fix it. Each call that writes is one transaction: a process killed
half-way leaves nothing half-written. A file that is not a regular file (a FIFO, a device such
as /dev/null), or an SQLite database that is not a ddlscope store (its own tables, no ddlscope
`meta`), is refused before anything is written to it.

`atomic_output` is how every file ddlscope writes for a user (exports, reports, traces, scripts,
profiles) is written: to a temporary name in the same folder, fsynced, then renamed over the
target, so a full disk or a crash leaves the old file or none, never a truncated one. It lives
here, in the lowest layer, so that every layer can use it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sqlite3
import stat
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Sequence, TypeVar

SCHEMA_VERSION = 1
T = TypeVar("T")

# Where runs are kept when no --db names another store: the one default every command and layer uses.
DEFAULT_DB = Path("ddlscope.db")

# How long one try waits on a locked store (sqlite's busy timeout), and how long a write keeps
# retrying in all before it gives up; environment variables override the defaults.
BUSY_TIMEOUT_ENV, LOCK_WAIT_ENV = "DDLSCOPE_STORE_BUSY_TIMEOUT_S", "DDLSCOPE_STORE_LOCK_WAIT_S"
DEFAULT_BUSY_TIMEOUT_S, DEFAULT_LOCK_WAIT_S = 30.0, 600.0
SQLITE_HEADER = b"SQLite format 3\x00"
PAGE_BYTES = 16384  # of a new store (sqlite fixes it when the first table is made)
TABLES = ("meta", "runs", "steps", "evals", "memory", "updates", "calibrations", "events")

STEP_COLUMNS = (
    "t_s", "data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s", "step_s",
    "comm_s", "compute_cpu_s", "samples", "loss", "bytes_sent",
)
EVAL_COLUMNS = ("wall_s", "samples_seen", "metric_name", "metric", "loss")
# One row per update a parameter server applied (rank = the server).
UPDATE_COLUMNS = ("t_s", "worker", "worker_step", "staleness", "queue_s", "apply_s", "cpu_s", "bytes")

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    uuid TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL DEFAULT '',
    workload TEXT NOT NULL,
    strategy TEXT NOT NULL,
    world_size INTEGER NOT NULL,
    config_json TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('created', 'running', 'finished', 'failed', 'interrupted')),
    error TEXT,
    code_version TEXT NOT NULL,
    host TEXT NOT NULL,
    launcher_pid INTEGER,
    seed INTEGER NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    environment_json TEXT NOT NULL DEFAULT '{{}}'
);
CREATE TABLE IF NOT EXISTS steps (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    step INTEGER NOT NULL,
    {", ".join(f"{c} {'INTEGER' if c in ('samples', 'bytes_sent') else 'REAL'}" for c in STEP_COLUMNS)},
    PRIMARY KEY (run_id, rank, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS evals (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    step INTEGER NOT NULL,
    wall_s REAL, samples_seen INTEGER, metric_name TEXT, metric REAL, loss REAL,
    PRIMARY KEY (run_id, rank, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS memory (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    category TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (run_id, rank, category)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS updates (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    {", ".join(f"{c} {'INTEGER' if c in ('worker', 'worker_step', 'staleness', 'bytes') else 'REAL'}" for c in UPDATE_COLUMNS)},
    PRIMARY KEY (run_id, rank, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS calibrations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    host TEXT NOT NULL,
    quick INTEGER NOT NULL,
    world_sizes TEXT NOT NULL,
    profile_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    t REAL NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL,
    PRIMARY KEY (run_id, rank, seq)
) WITHOUT ROWID;
"""


@dataclass
class Run:
    id: int
    uuid: str
    name: str
    workload: str
    strategy: str
    world_size: int
    config: dict[str, Any]
    status: str
    error: str | None
    code_version: str
    host: str
    launcher_pid: int | None
    seed: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    environment: dict[str, Any]

    @property
    def shown_status(self) -> str:
        """A created or running run whose launcher on this host is gone died without saying so."""
        if self.status in ("created", "running") and self.host == socket.gethostname() and self.launcher_pid:
            if not pid_alive(self.launcher_pid):
                return "died"
        return self.status


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StoreError(RuntimeError):
    """The store cannot be opened or does not hold what was asked for."""


class OutputError(RuntimeError):
    """A file for the user cannot be written (one line naming it); nothing was left half-written."""


class Store:
    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_s: float | None = None,
                 lock_wait_s: float | None = None):
        self.path = Path(path)
        self.busy_timeout_s = _seconds(BUSY_TIMEOUT_ENV, DEFAULT_BUSY_TIMEOUT_S, busy_timeout_s)
        self.lock_wait_s = _seconds(LOCK_WAIT_ENV, DEFAULT_LOCK_WAIT_S, lock_wait_s)
        _check_file(self.path)
        try:
            self.conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(_describe(self.path, exc)) from None
        try:
            self.conn.row_factory = sqlite3.Row
            self.conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
            self.conn.execute("PRAGMA foreign_keys=ON")
            tables = {r[0] for r in self._retrying(
                lambda: self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall())}
            if tables and not self._has_schema_version(tables):  # someone else's database: never write into it
                raise StoreError(f"{self.path} is an SQLite database but not a ddlscope store (its tables: "
                                 f"{_some(sorted(tables))}): pass another --db")
            if not set(TABLES) <= tables:  # a new store (or an older one): create what is missing
                if not tables:  # an empty file: 16 KiB pages make bulk inserts ~15% cheaper than 4 KiB ones
                    self.conn.execute(f"PRAGMA page_size={PAGE_BYTES}")
                self._retrying(lambda: self.conn.execute("PRAGMA journal_mode=WAL"))
                with self.transaction():
                    for statement in _statements():
                        self.conn.execute(statement)
                    self.conn.execute(
                        "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                    )
            elif str(self.conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                self._try_journal_mode("wal")  # left in rollback mode by a large ingest that was killed
        except StoreError:
            self.conn.close()
            raise
        except sqlite3.Error as exc:
            self.conn.close()
            raise StoreError(_describe(self.path, exc)) from None
        self._identity = _file_identity(self.path)

    def _has_schema_version(self, tables: set[str]) -> bool:
        if "meta" not in tables:
            return False
        try:
            return self.conn.execute("SELECT 1 FROM meta WHERE key='schema_version'").fetchone() is not None
        except sqlite3.OperationalError:  # a `meta` table of another shape
            return False

    def still_at_path(self) -> bool:
        """Whether the store's path still names the file this connection opened: renaming another file
        over it (or deleting it) during a run would leave this connection writing to a file nobody sees."""
        return self._identity is not None and _file_identity(self.path) == self._identity

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic write: all of it lands, or none of it does. A locked store is waited for
        (see the module's docstring); an error of the store itself becomes a one-line StoreError."""
        try:
            self._retrying(lambda: self.conn.execute("BEGIN IMMEDIATE"))
            try:
                yield self.conn
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise
            self._retrying(lambda: self.conn.execute("COMMIT"))  # a busy COMMIT keeps the transaction: retry it
        except StoreError:  # locked past the bound (at BEGIN, or at a COMMIT that then never landed)
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, (sqlite3.IntegrityError, sqlite3.ProgrammingError)):
                raise
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise StoreError(_describe(self.path, exc)) from None

    def _retrying(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, tried again while the store is locked by another process, for up to lock_wait_s."""
        started = time.monotonic()
        pause = 0.05
        try:
            while True:
                left = self.lock_wait_s - (time.monotonic() - started)
                self.conn.execute(f"PRAGMA busy_timeout={int(max(0.0, min(self.busy_timeout_s, left)) * 1000)}")
                try:
                    return attempt()
                except sqlite3.OperationalError as exc:
                    if not is_busy(exc):
                        raise
                    if time.monotonic() - started >= self.lock_wait_s:
                        raise StoreError(
                            f"store {self.path} stayed locked by another process for {self.lock_wait_s:.0f} s: "
                            f"let that process finish (or stop it) and try again; {LOCK_WAIT_ENV} sets how long "
                            "to wait") from None
                    time.sleep(min(pause, max(0.0, self.lock_wait_s - (time.monotonic() - started))))
                    pause = min(pause * 2, 2.0)
        finally:
            self.conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")

    # -- runs ---------------------------------------------------------------
    def create_run(self, *, uuid: str, name: str, workload: str, strategy: str, world_size: int,
                   config: dict[str, Any], code_version: str, seed: int,
                   environment: dict[str, Any]) -> int:
        with self.transaction() as c:
            cur = c.execute(
                "INSERT INTO runs(uuid, name, workload, strategy, world_size, config_json, status, code_version,"
                " host, launcher_pid, seed, created_at, environment_json)"
                " VALUES (?, ?, ?, ?, ?, ?, 'created', ?, ?, ?, ?, ?, ?)",
                (uuid, name, workload, strategy, world_size, json.dumps(config, sort_keys=True), code_version,
                 socket.gethostname(), os.getpid(), seed, time.time(), json.dumps(environment, sort_keys=True)),
            )
            return int(cur.lastrowid)

    def mark_running(self, run_id: int) -> None:
        with self.transaction() as c:
            c.execute("UPDATE runs SET status='running', started_at=? WHERE id=?", (time.time(), run_id))

    def mark_done(self, run_id: int, status: str, error: str | None = None) -> None:
        if status not in ("finished", "failed", "interrupted"):
            raise ValueError(f"not a final status: {status}")
        with self.transaction() as c:
            c.execute("UPDATE runs SET status=?, error=?, finished_at=? WHERE id=?",
                      (status, error, time.time(), run_id))

    def get_run(self, ref: str | int) -> Run:
        """A run by numeric id, uuid (or a unique uuid prefix of 6+ characters), or name."""
        ref = str(ref)
        if ref.isdigit():
            rows = self.conn.execute("SELECT * FROM runs WHERE id=?", (int(ref),)).fetchall()
        else:
            rows = self.conn.execute("SELECT * FROM runs WHERE uuid=? OR name=? ORDER BY id DESC", (ref, ref)).fetchall()
            if not rows and len(ref) >= 6:  # a prefix, matched literally (no LIKE: _ and % are not wildcards)
                rows = self.conn.execute("SELECT * FROM runs WHERE substr(uuid, 1, ?) = ? ORDER BY id",
                                         (len(ref), ref)).fetchall()
                if len(rows) > 1:
                    raise StoreError(f"{ref!r} begins the uuids of {len(rows)} runs ({', '.join(str(r['id']) for r in rows[:5])}"
                                     f"{', ...' if len(rows) > 5 else ''}): give more of it, or the run's id")
        if not rows:
            raise StoreError(f"no run {ref!r} in {self.path}")
        return _run_from_row(rows[0])

    def unfinished_runs(self) -> list[Run]:
        """Runs still `created` or `running` (their launcher may be alive, or may have died)."""
        rows = self.conn.execute("SELECT * FROM runs WHERE status IN ('created', 'running') ORDER BY id").fetchall()
        return [_run_from_row(r) for r in rows]

    def list_runs(self, limit: int = 50) -> list[Run]:
        rows = self.conn.execute("SELECT * FROM runs ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [_run_from_row(r) for r in rows]

    # -- rows ----------------------------------------------------------------
    def ingest(self, run_id: int, records: Iterable[dict[str, Any]]) -> dict[str, int]:
        """Insert worker records idempotently, in one transaction. Returns counts by kind."""
        return self.ingest_batches(run_id, batches_of_records(records))

    def ingest_batches(self, run_id: int, batches: Iterable["RowBatch"], *, large: bool = False) -> dict[str, int]:
        """Insert batches of rows idempotently (keyed by run, rank and step or seq), all of them in one
        transaction: executemany per table and batch, so that millions of rows go in at C speed.

        The run must exist (sqlite3.IntegrityError otherwise, nothing written). `large` (hundreds of
        megabytes of rows) lets the store write them through a rollback journal rather than the WAL
        when nothing else has it open. See `_bulk_load` for what this connection does differently
        meanwhile."""
        counts = {kind: 0 for kind in RECORD_KINDS}
        with self._bulk_load(large), self.transaction() as c:
            if c.execute("SELECT 1 FROM runs WHERE id=?", (run_id,)).fetchone() is None:
                raise sqlite3.IntegrityError(f"FOREIGN KEY constraint failed: no run {run_id} in {self.path}")
            for batch in batches:
                for sql, rows in batch.statements(run_id):
                    c.executemany(sql, rows)
                for kind, n in batch.counts.items():
                    counts[kind] += n
        return counts

    @contextmanager
    def _bulk_load(self, large: bool = False) -> Iterator[None]:
        """foreign_keys off on this connection for one big insert whose caller checks the one parent
        row (the run) once, rather than sqlite on every row (a lookup in `runs` per row, about a fifth
        of the insert's cost). Set around the transaction (the pragma is a no-op inside one) and back
        on after it, whether it commits or not.

        A `large` insert also leaves the WAL for a rollback journal while it runs, if no other
        connection has the store open (leaving WAL needs the store to itself; otherwise it stays in
        WAL, as fast as before). In WAL every new page is written twice, to the WAL and then by the
        commit's checkpoint into the store (rows/s +25% without it at 10 million rows, docs/scale.md); with a
        rollback journal a new page is written once and the journal keeps only the few old pages the
        insert changes, so a crash or an error still rolls the whole insert back. The cost: other
        processes that open the store meanwhile wait for the insert's commit (their busy timeout)
        instead of reading the last snapshot. Back to WAL afterwards, whether it commits or not.

        synchronous stays as the store has it: off during the ingest saved about 1 s of fsync at 10
        million rows here, but the launcher's next commit (the run's status) then waited for those
        same writes, so it bought nothing end to end and would have risked the store on a power loss."""
        self.conn.execute("PRAGMA foreign_keys=OFF")
        left_wal = large and self._try_journal_mode("delete")
        try:
            yield
        finally:
            self.conn.execute("PRAGMA foreign_keys=ON")
            if left_wal:
                self._retrying(lambda: self._set_wal_or_busy())

    def _try_journal_mode(self, mode: str) -> bool:
        """Switch this store's journal to `mode` now if nothing is in the way (sqlite needs the store to
        itself to leave WAL, and no reader in it to enter WAL); whether it switched. No wait: sqlite
        refuses to leave WAL at once anyway, but would wait out the busy timeout to enter it."""
        self.conn.execute("PRAGMA busy_timeout=0")
        try:
            row = self.conn.execute(f"PRAGMA journal_mode={mode}").fetchone()
            return row is not None and str(row[0]).lower() == mode
        except sqlite3.OperationalError:  # busy, or a store this process may not write: it stays as it was
            return False
        finally:
            self.conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")

    def _set_wal_or_busy(self) -> None:
        """Back to WAL; a reader that opened the store meanwhile is waited for by `_retrying`."""
        row = self.conn.execute("PRAGMA journal_mode=WAL").fetchone()
        if row is None or str(row[0]).lower() != "wal":
            raise sqlite3.OperationalError("database is locked (journal mode not switched back to WAL)")

    def forget_rows_from(self, run_id: int, step: int) -> None:
        """Drop a run's rows of steps >= `step` (and its memory rows, measured at the end): a resumed run
        writes them again from its checkpoint. Events stay: they are the run's history."""
        with self.transaction() as c:
            c.execute("DELETE FROM steps WHERE run_id=? AND step>=?", (run_id, step))
            c.execute("DELETE FROM evals WHERE run_id=? AND step>=?", (run_id, step))
            c.execute("DELETE FROM updates WHERE run_id=? AND worker_step>=?", (run_id, step))
            c.execute("DELETE FROM memory WHERE run_id=?", (run_id,))

    def add_event(self, run_id: int, kind: str, message: str, rank: int = -1) -> None:
        """An event from the launcher itself (rank -1)."""
        with self.transaction() as c:
            _insert_event(c, run_id, kind, message, rank)

    def finish_orphan(self, run_id: int, launcher_pid: int | None, status: str, error: str, event: str,
                      finished_at: float | None = None) -> bool:
        """Mark a run whose launcher died without saying `status` (failed or interrupted; finished only
        for a run whose launcher saw it finish but could not store its rows, once they all are) and
        record a `recovered` event (rank -1), in one transaction, unless it is no longer created or
        running, or another launcher owns it now (another process recovered it first). True when this
        call marked it."""
        if status not in ("finished", "failed", "interrupted"):
            raise ValueError(f"not the status of a run whose launcher died: {status}")
        with self.transaction() as c:
            cur = c.execute("UPDATE runs SET status=?, error=?, finished_at=? WHERE id=? AND launcher_pid IS ?"
                            " AND status IN ('created', 'running')",
                            (status, error, finished_at or time.time(), run_id, launcher_pid))
            if cur.rowcount != 1:
                return False
            _insert_event(c, run_id, "recovered", event, -1)
        return True

    # -- resume and checkpoints (runtime/checkpoint.py, runtime/launcher.py) ----------------------------
    def checkpoint_secret(self) -> bytes:
        """This store's secret, made on first use, that runs' checkpoint manifests are signed with
        (checkpoint.run_key): a checkpoint folder cannot vouch for itself, the store can. In `meta`, so
        older stores need no migration; whoever can read the store can sign."""
        with self.transaction() as c:
            c.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('checkpoint_secret', ?)",
                      (secrets.token_hex(32),))
            return bytes.fromhex(c.execute("SELECT value FROM meta WHERE key='checkpoint_secret'").fetchone()[0])

    def take_over_run(self, run_id: int, seen_status: str, seen_pid: int | None) -> bool:
        """A resuming launcher makes the run its own: this process's pid and host recorded, unless the run
        changed since it was read as (`seen_status`, `seen_pid`). True when it took it."""
        with self.transaction() as c:
            cur = c.execute("UPDATE runs SET launcher_pid=?, host=? WHERE id=? AND status=? AND launcher_pid IS ?",
                            (os.getpid(), socket.gethostname(), run_id, seen_status, seen_pid))
            return cur.rowcount == 1
    # -- end of resume and checkpoints ---------------------------------------------------------------

    def steps(self, run_id: int) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM steps WHERE run_id=? ORDER BY step, rank", (run_id,)).fetchall()

    def evals(self, run_id: int) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM evals WHERE run_id=? ORDER BY step, rank", (run_id,)).fetchall()

    def memory(self, run_id: int) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM memory WHERE run_id=? ORDER BY rank, category", (run_id,)).fetchall()

    def updates(self, run_id: int) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM updates WHERE run_id=? ORDER BY rank, seq", (run_id,)).fetchall()

    def events(self, run_id: int) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM events WHERE run_id=? ORDER BY t, rank, seq", (run_id,)).fetchall()

    def iter_rows(self, table: str, run_id: int, batch_rows: int = 50_000) -> Iterator[list[tuple[Any, ...]]]:
        """A table's rows of one run in batches of plain tuples (the columns of `column_names`), in its key
        order (no sort: the primary key's order), so that an export holds one batch at a time."""
        if table not in ("steps", "evals", "memory", "events", "updates"):
            raise ValueError(f"not a table of run rows: {table}")
        cur = self.conn.cursor()
        cur.row_factory = None  # tuples: about 15% less CPU than sqlite3.Row over millions of rows
        cur.execute(f"SELECT * FROM {table} WHERE run_id=?", (run_id,))
        while rows := cur.fetchmany(batch_rows):
            yield rows

    def column_types(self, table: str) -> list[tuple[str, str]]:
        """(name, declared type) of each column of a table, in order."""
        if table not in TABLES:
            raise ValueError(f"not a table of the store: {table}")
        return [(r["name"], r["type"].upper()) for r in self.conn.execute(f"PRAGMA table_info({table})")]

    def column_names(self, table: str) -> list[str]:
        return [name for name, _ in self.column_types(table)]

    def step_ranks(self, run_id: int) -> list[int]:
        """The ranks that wrote step rows, found by seeking the primary key rank to rank (a 1,024-rank
        run of 10 million rows costs 1,024 seeks, not a scan)."""
        ranks: list[int] = []
        rank = self.conn.execute("SELECT MIN(rank) FROM steps WHERE run_id=?", (run_id,)).fetchone()[0]
        while rank is not None:
            ranks.append(rank)
            rank = self.conn.execute("SELECT MIN(rank) FROM steps WHERE run_id=? AND rank>?", (run_id, rank)).fetchone()[0]
        return ranks

    def step_range(self, run_id: int, ranks: Iterable[int]) -> tuple[int | None, int | None, int | None]:
        """(smallest step, the next larger step any rank recorded, largest step), by seeks per rank."""
        ranks = list(ranks)
        lows = [self.conn.execute("SELECT MIN(step), MAX(step) FROM steps WHERE run_id=? AND rank=?",
                                  (run_id, r)).fetchone() for r in ranks]
        if not lows:
            return None, None, None
        first = min(low for low, _ in lows)
        seconds = [self.conn.execute("SELECT MIN(step) FROM steps WHERE run_id=? AND rank=? AND step>?",
                                     (run_id, r, first)).fetchone()[0] for r in ranks]
        second = min((s for s in seconds if s is not None), default=None)
        return first, second, max(high for _, high in lows)

    def step_sums_by_rank(self, run_id: int, steady_from: int, last_step: int) -> list[sqlite3.Row]:
        """Per rank, in one pass in key order: counts, sums of the steady steps' (step >= steady_from)
        phases, and of all steps' CPU-derived time, the last step end, and the last step's losses."""
        steady = "CASE WHEN step >= :first THEN {} END"
        phases = ", ".join(f"SUM({steady.format(c)}) AS {c}" for c in (
            "data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s", "step_s", "comm_s", "bytes_sent",
            "samples", "compute_cpu_s"))
        zeroed = ", ".join(f"SUM({steady.format(f'COALESCE({c}, 0.0)')}) AS {c}_or_zero" for c in (
            "data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s"))
        return self.conn.execute(
            f"SELECT rank, COUNT(*) AS rows, COUNT({steady.format(1)}) AS steady_rows, {phases}, {zeroed},"
            " COUNT(CASE WHEN step >= :first AND step_s IS NOT NULL THEN 1 END) AS steady_step_s_rows,"
            " SUM(step_s - forward_s - backward_s + compute_cpu_s) AS cpu_derived_s,"
            " MAX(t_s + step_s) AS end_s,"
            " SUM(CASE WHEN step = :last AND loss IS NOT NULL THEN loss END) AS last_loss_sum,"
            " COUNT(CASE WHEN step = :last AND loss IS NOT NULL THEN 1 END) AS last_losses"
            " FROM steps WHERE run_id = :run GROUP BY rank ORDER BY rank",
            {"run": run_id, "first": steady_from, "last": last_step}).fetchall()

    def step_extremes_by_step(self, run_id: int, steady_from: int) -> list[sqlite3.Row]:
        """Per step >= steady_from, in step order: the ranks that recorded it, the slowest rank's step
        time and CPU-derived step time, and the rank the others waited for (the most time outside
        communication; the lowest such rank on a tie).

        One pass over the run's rows in key order (rank, step), each folded into a small temporary
        table keyed by step: no sort of millions of rows."""
        c = self.conn
        c.execute("CREATE TEMP TABLE IF NOT EXISTS step_extremes (step INTEGER PRIMARY KEY, ranks INTEGER,"
                  " max_step_s REAL, max_cpu_derived_s REAL, max_busy_s REAL, straggler INTEGER)")
        try:
            c.execute("DELETE FROM temp.step_extremes")
            # SET reads the row's values before the update, so the straggler is compared with the old maximum.
            c.execute("INSERT INTO temp.step_extremes SELECT step, 1, step_s,"
                      " step_s - forward_s - backward_s + compute_cpu_s, step_s - comm_wait_s, rank"
                      " FROM steps WHERE run_id = ? AND step >= ? ORDER BY rank, step"
                      " ON CONFLICT(step) DO UPDATE SET ranks = ranks + 1,"
                      f" max_step_s = {_max_ignoring_null('max_step_s')},"
                      f" max_cpu_derived_s = {_max_ignoring_null('max_cpu_derived_s')},"
                      " straggler = CASE WHEN excluded.max_busy_s > max_busy_s THEN excluded.straggler"
                      " ELSE straggler END,"
                      " max_busy_s = max(max_busy_s, excluded.max_busy_s)", (run_id, steady_from))
            return c.execute("SELECT * FROM temp.step_extremes ORDER BY step").fetchall()
        finally:
            c.execute("DELETE FROM temp.step_extremes")

    def count_steps(self, run_id: int) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM steps WHERE run_id=?", (run_id,)).fetchone()[0]

    def runs_named(self, name: str) -> list[Run]:
        rows = self.conn.execute("SELECT * FROM runs WHERE name=? ORDER BY id DESC", (name,)).fetchall()
        return [_run_from_row(r) for r in rows]

    def find_runs(self, *, workload: str, strategy: str, status: str = "finished") -> list[Run]:
        rows = self.conn.execute(
            "SELECT * FROM runs WHERE workload=? AND strategy=? AND status=? ORDER BY id DESC",
            (workload, strategy, status),
        ).fetchall()
        return [_run_from_row(r) for r in rows]


    # ------------------------------------------------------------------ calibrations (ddlscope calibrate)
    def add_calibration(self, profile: dict[str, Any]) -> int:
        """Keep one machine profile (calibrate's dict); returns its id."""
        meta = profile.get("meta", {})
        sizes = ",".join(sorted((k.removeprefix("ws") for k in profile.get("collectives", {})), key=int))
        with self.transaction() as conn:
            cur = conn.execute(
                "INSERT INTO calibrations(created_at, host, quick, world_sizes, profile_json) VALUES (?,?,?,?,?)",
                (float(meta.get("created_at", time.time())), str(meta.get("host", "")), int(bool(meta.get("quick"))),
                 sizes, json.dumps(profile)))
            return int(cur.lastrowid)

    def latest_calibration(self, host: str | None = None) -> tuple[int, dict[str, Any]] | None:
        """(id, profile) of the newest calibration (of `host`, when given), or None."""
        query, args = "SELECT id, profile_json FROM calibrations", ()
        if host is not None:
            query, args = query + " WHERE host=?", (host,)
        row = self.conn.execute(query + " ORDER BY id DESC LIMIT 1", args).fetchone()
        return (int(row["id"]), json.loads(row["profile_json"])) if row else None


RECORD_KINDS = ("step", "eval", "memory", "event", "update")
_STEP_KEYS = ("rank", "step", *STEP_COLUMNS)
_EVAL_KEYS = ("rank", "step", *EVAL_COLUMNS)
_UPDATE_KEYS = ("rank", "seq", *UPDATE_COLUMNS)
_INSERTS = {
    "steps": f"INSERT OR REPLACE INTO steps(run_id, {', '.join(_STEP_KEYS)}) VALUES (?{', ?' * len(_STEP_KEYS)})",
    "evals": f"INSERT OR REPLACE INTO evals(run_id, {', '.join(_EVAL_KEYS)}) VALUES (?{', ?' * len(_EVAL_KEYS)})",
    "updates": f"INSERT OR REPLACE INTO updates(run_id, {', '.join(_UPDATE_KEYS)}) VALUES (?{', ?' * len(_UPDATE_KEYS)})",
    "memory": "INSERT OR REPLACE INTO memory(run_id, rank, category, bytes) VALUES (?, ?, ?, ?)",
    "events": "INSERT OR REPLACE INTO events(run_id, rank, seq, t, kind, message) VALUES (?, ?, ?, ?, ?, ?)",
}
# How many records one batch holds when built from dicts: executemany's unit of work.
RECORDS_PER_BATCH = 50_000


# Step rows inserted per statement on the columnar path: one multi-row INSERT binds this many rows
# (x 14 values, well under sqlite's 32,766 variables): per row, 256 costs about a third less than 64
# (fewer statements, and 4x fewer Python lists to make), and much less than executemany row by row.
ROWS_PER_INSERT = 256


@dataclass
class RowBatch:
    """Rows for the store's tables, without their run id. `steps` holds tuples in `_STEP_KEYS` order
    (rank, step, then STEP_COLUMNS); or `step_matrix`, a float64 array of the same columns, one row per
    step row (a columnar reader's output; an integral float lands as an integer in the INTEGER columns
    and NaN as NULL, as sqlite stores them). `counts` are records by kind."""

    steps: list[tuple[Any, ...]] = field(default_factory=list)
    step_matrix: Any = None  # numpy.ndarray (n, len(_STEP_KEYS)) of float64
    evals: list[tuple[Any, ...]] = field(default_factory=list)
    updates: list[tuple[Any, ...]] = field(default_factory=list)
    memory: list[tuple[Any, ...]] = field(default_factory=list)
    events: list[tuple[Any, ...]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in RECORD_KINDS})
    _prepared: Any = field(default=None, init=False, repr=False, compare=False)  # (run id, statements)

    def add(self, rec: dict[str, Any]) -> None:
        """One worker record (a dict as a rank wrote it); records of other kinds are ignored. A memory
        record without its `bytes`, or an event without rank, seq or t, raises KeyError."""
        kind = rec.get("kind")
        if kind == "step":
            self.steps.append(tuple(rec.get(k) for k in _STEP_KEYS))
        elif kind == "eval":
            self.evals.append(tuple(rec.get(k) for k in _EVAL_KEYS))
        elif kind == "update":
            self.updates.append(tuple(rec.get(k) for k in _UPDATE_KEYS))
        elif kind == "memory":
            self.memory.extend((rec["rank"], cat, int(b)) for cat, b in rec["bytes"].items())
        elif kind == "event":
            self.events.append((rec["rank"], rec["seq"], rec["t"], rec["event"], rec.get("message", "")))
        else:
            return
        self.counts[kind] += 1

    def __len__(self) -> int:
        return sum(self.counts.values())

    def prepare(self, run_id: int) -> "RowBatch":
        """Make the inserts' parameter rows now (Python objects: a parsing thread's work, not the
        inserting thread's); `statements(run_id)` then hands them out. Returns the batch."""
        self._prepared = (run_id, [(sql, rows if isinstance(rows, list) else list(rows))
                                   for sql, rows in self._statements(run_id)])
        return self

    def statements(self, run_id: int) -> Iterator[tuple[str, Iterable[Sequence[Any]]]]:
        """Each insert and its parameter rows, the run id put in front of each row."""
        prepared = self._prepared
        if prepared is not None and prepared[0] == run_id:
            return iter(prepared[1])
        return self._statements(run_id)

    def _statements(self, run_id: int) -> Iterator[tuple[str, Iterable[Sequence[Any]]]]:
        if self.step_matrix is not None and len(self.step_matrix):
            yield from _matrix_inserts(run_id, self.step_matrix)
        for table in ("steps", "evals", "updates", "memory", "events"):
            rows = getattr(self, table)
            if rows:
                yield _INSERTS[table], [(run_id, *row) for row in rows]


def _matrix_inserts(run_id: int, matrix: Any) -> Iterator[tuple[str, Iterable[Sequence[Any]]]]:
    """Step rows of a float matrix: ROWS_PER_INSERT rows per statement, then the rest one by one. The
    run id (an int of ours, never text from a file) is written into the statement, not bound."""
    n, width = matrix.shape
    whole = n - n % ROWS_PER_INSERT
    columns = f"INSERT OR REPLACE INTO steps(run_id, {', '.join(_STEP_KEYS)}) VALUES "
    one_row = f"({int(run_id)}, " + ", ".join("?" * width) + ")"
    if whole:
        yield columns + ", ".join([one_row] * ROWS_PER_INSERT), matrix[:whole].reshape(whole // ROWS_PER_INSERT, -1).tolist()
    if whole < n:
        yield columns + one_row, matrix[whole:].tolist()


def batches_of_records(records: Iterable[dict[str, Any]]) -> Iterator[RowBatch]:
    """Worker records (dicts) grouped into batches of RECORDS_PER_BATCH."""
    batch = RowBatch()
    for rec in records:
        batch.add(rec)
        if len(batch) >= RECORDS_PER_BATCH:
            yield batch
            batch = RowBatch()
    yield batch


def _max_ignoring_null(column: str) -> str:
    """SQL for the larger of a row's value and the incoming one, a NULL on either side ignored (sqlite's
    two-argument max() would return NULL), as MAX() does over a column."""
    return f"max(COALESCE({column}, excluded.{column}), COALESCE(excluded.{column}, {column}))"


def _insert_event(c: sqlite3.Connection, run_id: int, kind: str, message: str, rank: int) -> None:
    seq = c.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM events WHERE run_id=? AND rank=?", (run_id, rank)).fetchone()[0]
    c.execute("INSERT INTO events(run_id, rank, seq, t, kind, message) VALUES (?, ?, ?, ?, ?, ?)",
              (run_id, rank, seq, time.time(), kind, message))


def _seconds(env: str, default: float, given: float | None) -> float:
    """A time bound: the argument, else the environment variable, else the default."""
    if given is not None:
        return float(given)
    text = os.environ.get(env)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise StoreError(f"{env}={text!r}: not a number of seconds") from None
    if value < 0:
        raise StoreError(f"{env}={text!r}: must be >= 0 seconds")
    return value


def _file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, or None when nothing is there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _some(names: Sequence[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (for a message)."""
    for test, kind in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "named pipe (FIFO)"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return kind
    return "special file"


def _check_file(path: Path) -> None:
    """Refuse, in one line, what sqlite would refuse with a less helpful message (or not at all)."""
    if path.is_dir():
        raise StoreError(f"store {path} is a directory, not a store file: pass --db FILE (a new or existing store)")
    if not path.parent.exists():
        raise StoreError(f"store folder {path.parent} does not exist")
    if not path.exists():
        return
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):  # opening a FIFO would block for ever; /dev/null reads as "disk I/O error"
        raise StoreError(f"store {path} is a {file_kind(mode)}, not a regular file, so not a ddlscope store: "
                         "pass --db FILE (a new or existing store)")
    try:
        with open(path, "rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except PermissionError:
        raise StoreError(f"cannot read store {path}: permission denied (chmod u+rw {path}, or pass another --db)") from None
    except OSError as exc:
        raise StoreError(f"cannot read store {path}: {exc.strerror or exc}") from None
    if header and header != SQLITE_HEADER[:len(header)] or 0 < len(header) < len(SQLITE_HEADER):
        raise StoreError(f"{path} is not a ddlscope store (not an SQLite database): move it away, or pass another --db")


def _describe(path: Path, exc: sqlite3.Error) -> str:
    """One line for an error of the store itself: what is wrong, and what to do."""
    message = str(exc)
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    if code == 8 or "readonly" in message:  # SQLITE_READONLY
        return f"store {path} is read-only ({message}): make it and its folder writable, or pass another --db"
    if code in (11, 26) or "malformed" in message or "not a database" in message:  # SQLITE_CORRUPT, SQLITE_NOTADB
        return (f"store {path} is damaged or not a ddlscope store ({message}): move it away, or pass another --db "
                "(`sqlite3 FILE .recover` may save its rows)")
    if code == 13:  # SQLITE_FULL
        return f"store {path}: the disk is full ({message}); free space and try again"
    if code == 14:  # SQLITE_CANTOPEN
        return f"cannot open store {path} ({message}): check that it and its folder are readable and writable"
    if code == 10:  # SQLITE_IOERR
        return f"store {path}: disk I/O error ({message})"
    return f"store {path}: {message}"


@contextmanager
def atomic_output(path: str | os.PathLike[str], *, binary: bool = False, what: str = "output") -> Iterator[IO[Any]]:
    """A file to write `path` through: a temporary file in the same folder, fsynced and renamed over
    `path` when the block ends without an error, removed when it raises. A reader (or a full disk, or a
    crash) never sees a half-written `path`: the old file stays until the new one is whole.

    An existing target that is not a regular file (a device such as /dev/null, a FIFO, a folder) is
    refused, since the rename would replace it; a symlink is followed, and its target written. A file
    that cannot be written (no space, a read-only folder, no permission) is an OutputError naming
    `what` and the path, in one line."""
    target = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise OutputError(f"{what} {path}: cannot write it ({exc.strerror or exc})") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputError(f"{what} {path} is a {file_kind(mode)}, not a regular file: give a file name to write")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise OutputError(f"{what} {path}: cannot write it ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8", "newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and not isinstance(exc, (BrokenPipeError, InterruptedError)):
            raise OutputError(f"{what} {path}: cannot write it ({exc.strerror or exc}); nothing was left there") \
                from None
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def is_busy(exc: sqlite3.OperationalError) -> bool:
    """Whether sqlite refused because another connection holds a lock (busy or locked)."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    return code in (5, 6) or "locked" in str(exc) or "busy" in str(exc)  # SQLITE_BUSY, SQLITE_LOCKED


def _statements() -> list[str]:
    return [s.strip() for s in _SCHEMA.split(";") if s.strip()]


def _run_from_row(row: sqlite3.Row) -> Run:
    d = dict(row)
    d["config"] = json.loads(d.pop("config_json"))
    d["environment"] = json.loads(d.pop("environment_json"))
    return Run(**d)
