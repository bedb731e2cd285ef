"""The ingest's readers of rank files (runtime/rows.py): the CSV reader of step lines reads exactly
what read_records reads or refuses the chunk, a bad file part-way through leaves the store as it was,
and the files go in rank order. Small synthetic runs (benchmarks/synthetic_rows.py), in-process."""

from __future__ import annotations

import os
import shutil
from contextlib import closing
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from ddlscope.runtime import rows as rowfiles
from ddlscope.runtime.rows import chunk_batch, ingest_run_dir, read_records, run_files
from ddlscope.store import RowBatch, Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synthetic_rows import Shape, write_synthetic_run  # noqa: E402


def _line_by_line(chunk: bytes) -> RowBatch:
    """What read_records makes of the chunk, as a batch."""
    batch = RowBatch()
    for line in chunk.splitlines():
        record = rowfiles._decode(line)
        if record is not None:
            batch.add(record)
    return batch


def _rows(batch: RowBatch) -> dict[str, list[tuple]]:
    """A batch's rows by table, step rows as tuples whatever the batch holds them in (NaN as None)."""
    steps = [tuple(row) for row in batch.steps]
    if batch.step_matrix is not None:
        steps += [tuple(None if v != v else (int(v) if i in (0, 1, 11, 13) else v) for i, v in enumerate(row))
                  for row in batch.step_matrix.tolist()]
    return {"steps": sorted(steps), "evals": batch.evals, "memory": batch.memory, "events": batch.events,
            "updates": batch.updates}


# More than one statement's worth of rows a file (store.ROWS_PER_INSERT, 256): both kinds of insert.
STEPS = 300


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """(store, run id, run dir) of 3 ranks x STEPS steps, not yet ingested: tests that ingest copy it."""
    db = tmp_path_factory.mktemp("ingest") / "s.db"
    run_id, run_dir = write_synthetic_run(db, Shape(3, STEPS, eval_every=50, checkpoint_every=100))
    return db, run_id, run_dir


def test_the_csv_reader_reads_the_workers_lines_exactly_as_read_records_does(small_run):
    _, _, run_dir = small_run
    for path in run_files(run_dir):
        chunk = path.read_bytes()
        fast = rowfiles._csv_batch(chunk)
        assert fast is not None, f"{path.name}: the CSV reader refused the workers' own lines"
        assert fast.counts == _line_by_line(chunk).counts
        assert fast.counts["step"] == STEPS and fast.counts["event"] >= 5
        assert _rows(fast) == _rows(_line_by_line(chunk))  # exact floats, ints as ints


def _swap_fields(line: bytes, a: bytes, b: bytes) -> bytes:
    """The line with the fields "a":.. and "b":.. (adjacent, a first) in the other order."""
    start = line.index(b'"' + a + b'":')
    middle = line.index(b',"' + b + b'":', start)
    end = line.index(b",", middle + 1)
    return line[:start] + line[middle + 1:end] + b"," + line[start:middle] + line[end:]


@pytest.mark.parametrize("change", ["swap", "swap same length", "rename", "kind"])
def test_a_step_line_of_the_same_shape_but_other_keys_is_never_read_into_the_wrong_column(small_run, change):
    _, _, run_dir = small_run
    lines = rowfiles.rank_file(run_dir, 1).read_bytes().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if b'"step":7,' in line)
    if change == "swap":  # same fields, another order: JSON reads it by name, a fixed column order must not
        lines[at] = _swap_fields(lines[at], b"forward_s", b"backward_s")
    elif change == "swap same length":  # keys of one length: only their bytes tell them apart
        lines[at] = _swap_fields(lines[at], b"step_s", b"comm_s")
    elif change == "rename":
        lines[at] = lines[at].replace(b'"loss":', b'"lost":')
    else:
        lines[at] = lines[at].replace(b'"kind":"step"', b'"kind":"stop"')
    chunk = b"".join(lines)
    assert rowfiles._csv_batch(chunk) is None
    assert _rows(chunk_batch(chunk)) == _rows(_line_by_line(chunk))


def test_a_torn_line_is_skipped_by_the_csv_reader_as_read_records_skips_it(small_run):
    _, _, run_dir = small_run
    lines = rowfiles.rank_file(run_dir, 2).read_bytes().splitlines(keepends=True)
    lines[20] = lines[20][:57]  # cut short: the next record begins on the same line
    chunk = b"".join(lines)
    fast = rowfiles._csv_batch(chunk)
    assert fast is not None and _rows(fast) == _rows(_line_by_line(chunk))
    assert fast.counts["step"] == STEPS - 2
    tail = lines[-1][:30]  # the last line cut short: also the beginning of earlier lines
    assert chunk.count(tail) > 1
    fast = rowfiles._csv_batch(chunk + tail)
    assert fast is not None and _rows(fast) == _rows(_line_by_line(chunk + tail))
    lines[30] = lines[30].replace(b'"bytes_sent":', b'"extra":1,"bytes_sent":')  # a step row of other fields
    assert rowfiles._csv_batch(b"".join(lines)) is None  # which it cannot place among its rows: JSON's turn
    assert _rows(chunk_batch(b"".join(lines))) == _rows(_line_by_line(b"".join(lines)))


def _dump(db: Path) -> list[str]:
    with closing(sqlite3.connect(db)) as conn:  # closed, not only committed: an open one holds the store
        return list(conn.iterdump())


def test_a_bad_rank_file_part_way_through_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    db = tmp_path / "s.db"
    done_id, done_dir = write_synthetic_run(db, Shape(2, 20), name="done")
    run_id, run_dir = write_synthetic_run(db, Shape(3, 20, seed=1), name="bad")
    with Store(db) as store:
        ingest_run_dir(store, done_id, done_dir)
    with open(rowfiles.rank_file(run_dir, 2), "a") as f:
        f.write('{"kind":"memory","rank":2}\n')  # malformed: no "bytes"; rank 2 goes last
    monkeypatch.setattr(rowfiles, "PARSE_AHEAD", 0)  # ranks 0 and 1 are inserted before rank 2 is read
    before = _dump(db)
    with Store(db) as store:
        with pytest.raises(KeyError):
            ingest_run_dir(store, run_id, run_dir)
        assert store.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1  # back on after the bulk insert
        assert store.count_steps(run_id) == 0
    assert _dump(db) == before
    with Store(db) as store:
        with pytest.raises(sqlite3.IntegrityError):
            ingest_run_dir(store, 999, done_dir)  # no such run: refused, nothing written
    assert _dump(db) == before


def test_rank_files_are_ingested_in_rank_order(tmp_path):
    for name in ("rank-10.jsonl", "rank-2.jsonl", "remote-rank-2.jsonl", "rank-0.jsonl", "remote-rank-1.jsonl"):
        (tmp_path / name).write_text("")
    assert [p.name for p in run_files(tmp_path)] == [
        "rank-0.jsonl", "remote-rank-1.jsonl", "rank-2.jsonl", "remote-rank-2.jsonl", "rank-10.jsonl"]


def test_the_ingest_stores_what_read_records_reads(small_run, tmp_path):
    db, run_id, run_dir = small_run
    shutil.copy(db, tmp_path / "s.db")
    with Store(tmp_path / "s.db") as store:
        counts = ingest_run_dir(store, run_id, run_dir)
        expected = [r for p in run_files(run_dir) for r in read_records(p)]
        assert counts["step"] == sum(r["kind"] == "step" for r in expected) == 3 * STEPS
        stored = {(r["rank"], r["step"]): dict(r) for r in store.steps(run_id)}
        for r in expected:
            if r["kind"] == "step":
                assert all(stored[(r["rank"], r["step"])][k] == r[k] for k in r if k != "kind")
        assert len(store.events(run_id)) == counts["event"] == sum(r["kind"] == "event" for r in expected)
        assert len(store.evals(run_id)) == counts["eval"] == STEPS // 50  # rank 0's, every 50 steps
        assert len(store.memory(run_id)) == 5 * 3 and counts["memory"] == 3


_PARSED_AHEAD = rowfiles._parsed_ahead


def _journal_modes_seen(monkeypatch, store: Store) -> list[str]:
    """The store's journal mode as its connection sees it while each batch of an ingest goes in."""
    seen: list[str] = []
    parsed_ahead = _PARSED_AHEAD

    def watched(*args, **kwargs):
        for batch in parsed_ahead(*args, **kwargs):
            seen.append(store.conn.execute("PRAGMA journal_mode").fetchone()[0])
            yield batch

    monkeypatch.setattr(rowfiles, "_parsed_ahead", watched)
    return seen


def test_a_large_ingest_writes_through_a_rollback_journal_and_leaves_the_store_in_wal(small_run, tmp_path,
                                                                                     monkeypatch):
    db, run_id, run_dir = small_run
    shutil.copy(db, tmp_path / "wal.db")
    shutil.copy(db, tmp_path / "large.db")
    with Store(tmp_path / "wal.db") as store:
        seen_small = _journal_modes_seen(monkeypatch, store)
        ingest_run_dir(store, run_id, run_dir)
    monkeypatch.setattr(rowfiles, "LARGE_INGEST_BYTES", 0)  # these few hundred KB count as large
    with Store(tmp_path / "large.db") as store:
        seen_large = _journal_modes_seen(monkeypatch, store)
        ingest_run_dir(store, run_id, run_dir)
        assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert store.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert set(seen_small) == {"wal"} and set(seen_large) == {"delete"}, (seen_small, seen_large)
    assert _dump(tmp_path / "large.db") == _dump(tmp_path / "wal.db")  # the same rows, either way
    assert _query(tmp_path / "large.db", "PRAGMA journal_mode") == [("wal",)]  # as a new connection finds it


def test_a_large_ingest_stays_in_wal_at_once_while_another_connection_has_the_store_open(small_run, tmp_path,
                                                                                         monkeypatch):
    db, run_id, run_dir = small_run
    shutil.copy(db, tmp_path / "s.db")
    monkeypatch.setattr(rowfiles, "LARGE_INGEST_BYTES", 0)
    with Store(tmp_path / "s.db") as reader, Store(tmp_path / "s.db", busy_timeout_s=20) as store:
        assert reader.list_runs()  # a reader in WAL: leaving WAL would need the store to itself
        seen = _journal_modes_seen(monkeypatch, store)
        began = time.monotonic()
        counts = ingest_run_dir(store, run_id, run_dir)
        assert time.monotonic() - began < 10  # it did not wait out the busy timeout for the switch
        assert set(seen) == {"wal"} and counts["step"] == 3 * STEPS
        assert reader.count_steps(run_id) == 3 * STEPS


def test_a_large_ingest_that_fails_part_way_leaves_the_store_as_it_was_and_in_wal(tmp_path, monkeypatch):
    db = tmp_path / "s.db"
    run_id, run_dir = write_synthetic_run(db, Shape(3, 20, seed=1), name="bad")
    with open(rowfiles.rank_file(run_dir, 2), "a") as f:
        f.write('{"kind":"memory","rank":2}\n')  # malformed: no "bytes"; rank 2 goes last
    monkeypatch.setattr(rowfiles, "PARSE_AHEAD", 0)
    monkeypatch.setattr(rowfiles, "LARGE_INGEST_BYTES", 0)
    before = _dump(db)
    with Store(db) as store:
        seen = _journal_modes_seen(monkeypatch, store)
        with pytest.raises(KeyError):
            ingest_run_dir(store, run_id, run_dir)
        assert "delete" in seen and store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert _dump(db) == before
    assert not Path(f"{db}-journal").exists()


def test_a_large_ingest_parses_in_other_processes_and_an_error_there_rolls_it_back(small_run, tmp_path,
                                                                                  monkeypatch):
    """Processes parse a large ingest (threads would share the inserting thread's GIL); an exception in
    one reaches the ingest, which leaves the store as it was. The children are forked, so they run
    the parser monkeypatched here."""
    db, run_id, run_dir = small_run
    shutil.copy(db, tmp_path / "s.db")
    before = _dump(tmp_path / "s.db")
    last = run_files(run_dir)[-1]
    file_batches = rowfiles.file_batches

    def failing_on_the_last_file(path):
        if path == last:
            raise RuntimeError(f"parsed in process {os.getpid()}")
        return file_batches(path)

    monkeypatch.setattr(rowfiles, "file_batches", failing_on_the_last_file)
    monkeypatch.setattr(rowfiles, "LARGE_INGEST_BYTES", 0)
    with Store(tmp_path / "s.db") as store, pytest.raises(RuntimeError, match="parsed in process") as failure:
        ingest_run_dir(store, run_id, run_dir)
    assert int(str(failure.value).split()[-1]) != os.getpid()
    assert _dump(tmp_path / "s.db") == before


def _query(db: Path, sql: str) -> list[tuple]:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql).fetchall()
