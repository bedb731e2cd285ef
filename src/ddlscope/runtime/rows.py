"""Per-rank row files: the workers' side of the store.

Each rank appends one JSON object per line to its own file, line-buffered, so
every row reaches the kernel as soon as it is written and survives the
process dying. The launcher ingests the files into SQLite keyed by
(run, rank, step), so reading a file twice changes nothing.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

from ddlscope.store import RECORD_KINDS, STEP_COLUMNS, RowBatch, Store


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
        self.tee: Callable[[dict[str, Any]], None] | None = None  # also gets each record written (runtime/sinks.py)

    def write(self, kind: str, **fields: Any) -> None:
        self._file.write(encode_record(kind, self.rank, fields))
        if self.tee is not None:
            self.tee({"kind": kind, "rank": self.rank, **fields})

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


def encode_record(kind: str, rank: int, fields: dict[str, Any]) -> str:
    """One row as a rank writes it: a JSON object on one line, `kind` and `rank` first (the ingest's
    fast path recognises step rows by that prefix; benchmarks/synthetic_rows.py writes through here too)."""
    return json.dumps({"kind": kind, "rank": rank, **fields}, separators=(",", ":")) + "\n"


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


# The launcher's verdict on a run, kept in its folder until the run's rows are in the store: what recovery
# gives a run whose rows the launcher could not store. Made at the start at its full size, so that
# writing it at the end, over the same bytes, needs no new space on a disk that has filled up meanwhile.
OUTCOME_FILE = "outcome.json"
OUTCOME_BYTES = 4096


def reserve_outcome(run_dir: Path) -> None:
    """Make the run's outcome file at its full size (spaces: no outcome yet)."""
    (run_dir / OUTCOME_FILE).write_bytes(b" " * OUTCOME_BYTES)


def record_outcome(run_dir: Path, status: str, error: str | None, expected_steps: int) -> None:
    """Write the launcher's verdict over the reserved bytes (best effort: recovery does without it)."""
    record = {"status": status, "error": error, "expected_steps": expected_steps}
    data = json.dumps(record).encode()
    if len(data) > OUTCOME_BYTES:
        record["error"] = (error or "")[:OUTCOME_BYTES // 2] + "..."
        data = json.dumps(record).encode()
    try:
        with open(run_dir / OUTCOME_FILE, "r+b") as f:
            f.write(data.ljust(OUTCOME_BYTES))
    except OSError:
        pass


def read_outcome(run_dir: Path) -> dict[str, Any] | None:
    """The verdict record_outcome wrote, or None (none written, or unreadable)."""
    try:
        record = json.loads((run_dir / OUTCOME_FILE).read_bytes() or b"null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("status") in ("finished", "failed", "interrupted") \
        else None


def run_dir_for(store_path: Path, run_uuid: str) -> Path:
    """A run's folder (row files, logs, heartbeats, checkpoints): beside the store, by uuid."""
    return store_path.resolve().parent / "ddlscope-runs" / run_uuid


def ingest_run_dir(store: Store, run_id: int, run_dir: Path, *, serial: bool = False) -> dict[str, int]:
    """Every row of a run's files into the store, in one transaction (idempotent).

    PARSERS threads read the files (a file of up to CHUNK_BYTES whole, a larger one in chunks of whole
    lines), parse them and make the inserts' parameter rows, up to PARSE_AHEAD files or chunks ahead
    of the inserts (pyarrow parses outside the GIL, and sqlite inserts release it), so parsing and
    inserting overlap on the cores and the inserting thread does little but insert; memory holds a
    few chunks whatever the size of the run.

    Past LARGE_INGEST_BYTES of files, processes parse instead (`_parse_pool`), and the store may write
    the rows through a rollback journal (Store._bulk_load says when and why).

    `serial`: parse on this thread (at interpreter exit, where Python starts no new thread: an attached
    job's rank 0 stores its rows from an exit handler, runtime/attach.py)."""
    files = run_files(run_dir)
    large = sum(_size_bytes(path) for path in files) > LARGE_INGEST_BYTES
    if serial:
        batches = (batch for task in _parse_tasks(files, run_id) for batch in task())
        return store.ingest_batches(run_id, batches, large=large)
    return store.ingest_batches(run_id, _parsed_ahead(files, run_id, in_processes=large), large=large)


def _size_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # gone since it was listed: the reader says so, not the size
        return 0


# About 170,000 step rows, under half a second of inserts: below it the WAL's second write of each
# page costs little, and other processes keep reading the store while the rows go in.
LARGE_INGEST_BYTES = 64 << 20
PARSERS = 2
PARSE_PROCESSES = 2
PARSE_AHEAD = 4
CHUNK_BYTES = 8 << 20
_STEP_SCHEMA_KEYS = ("rank", "step", *STEP_COLUMNS)
_INT_KEYS = {"rank", "step", "samples", "bytes_sent"}
# Where a record of another kind than step begins, as encode_record writes it (after a newline).
_OTHER_START = re.compile(rb'\n\{"kind":"(?:eval|memory|event|update)"')


def _parsed_ahead(paths: list[Path], run_id: int, *, in_processes: bool = False) -> Iterator[RowBatch]:
    """The files' batches in order, read and parsed on a pool (`_parse_pool`) at most PARSE_AHEAD tasks
    ahead. Threads make the inserts' parameter rows too; processes hand back the step rows as a float
    matrix, whose rows the inserting thread makes (a list of Python floats would cost more to pickle
    and unpickle than to make from the matrix)."""
    with _parse_pool(in_processes) as pool:
        pending: deque[Future[list[RowBatch]]] = deque()
        try:
            for task in _parse_tasks(paths, run_id, prepare=not in_processes):
                pending.append(pool.submit(task))
                if len(pending) > PARSE_AHEAD:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:
            for future in pending:  # an insert failed: parse nothing more
                future.cancel()


def _parse_pool(in_processes: bool) -> Executor:
    """Threads, or for a large ingest PARSE_PROCESSES processes.

    Threads share one GIL with the inserting thread, and hold it for part of their work (the bytes'
    translation, the parameter rows): at 10 million rows on 2 cores the inserting thread, which needs
    about 11 s of CPU, then took 17-19 s (docs/scale.md). Processes hold their own GIL, so the inserting
    thread waits for nothing but sqlite; the price, well under a second, is the processes' start and
    the matrices coming back through a pipe, nothing beside a large ingest.

    Forked where the platform forks, as torch's DataLoader does its workers: a spawned process would
    import the caller's main script again, and a script that ingests without the `if __name__ ==
    "__main__"` guard would then ingest again in each one. A fork copies only this thread, so the
    children run nothing but the parsing functions, with the modules they use imported before."""
    if not in_processes:
        return ThreadPoolExecutor(PARSERS, thread_name_prefix="ddlscope-parse")
    _import_parsers()  # in the parent, so that no child takes the import lock a parent thread may hold
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return ProcessPoolExecutor(PARSE_PROCESSES, mp_context=multiprocessing.get_context(method),
                               initializer=_parsing_child, initargs=(os.getpid(),))


def _parsing_child(parent_pid: int) -> None:
    """A parsing process's start: Ctrl-C is the parent's, and the process ends with its parent.

    Ctrl-C reaches the whole process group: the ingest (the parent) stops, rolls back and shuts the
    pool down; a child that raised KeyboardInterrupt too would only print its own traceback. A parent
    killed outright (SIGKILL, the OOM killer) shuts nothing down: its children would wait on their
    task queue for ever, holding its stdout and stderr open, so each watches for its parent's end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True,
                     name="ddlscope-parent-watch").start()


def _exit_when_orphaned(parent_pid: int, poll_s: float = 0.2) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(1)


def _import_parsers() -> None:
    try:
        import numpy  # noqa: F401
        import pyarrow.compute  # noqa: F401
        import pyarrow.csv  # noqa: F401
        import pyarrow.json  # noqa: F401
    except ImportError:  # the readers fall back to json.loads
        pass


def _parse_tasks(paths: list[Path], run_id: int, *, prepare: bool = True) -> Iterator[Callable[[], list[RowBatch]]]:
    """Work for the parsing threads, in order: a whole file up to CHUNK_BYTES (the thread reads it), or
    a chunk of a larger file (read here, so that chunks split at line ends). With `prepare`, the batches
    come with their parameter rows made (RowBatch.prepare)."""
    for path in paths:
        if path.stat().st_size <= CHUNK_BYTES:
            yield partial(_parsed_file, path, run_id, prepare)
        else:
            for chunk in file_chunks(path):
                yield partial(_parsed_chunk, chunk, run_id, prepare)


def _parsed_file(path: Path, run_id: int, prepare: bool) -> list[RowBatch]:
    return [batch.prepare(run_id) if prepare else batch for batch in file_batches(path)]


def _parsed_chunk(chunk: bytes, run_id: int, prepare: bool) -> list[RowBatch]:
    batch = chunk_batch(chunk)
    return [batch.prepare(run_id) if prepare else batch]


def file_chunks(path: Path) -> Iterator[bytes]:
    """A rank file about CHUNK_BYTES at a time, in whole lines; a piece after the last newline (a line
    cut short) comes last, alone."""
    with open(path, "rb") as f:
        rest = b""
        while block := f.read(CHUNK_BYTES):
            block = rest + block
            end = block.rfind(b"\n") + 1
            rest = block[end:]
            if end:
                yield block[:end]
        if rest:
            yield rest


def file_batches(path: Path) -> Iterator[RowBatch]:
    """The rows of one rank file, ready for the store, a chunk at a time."""
    for chunk in file_chunks(path):
        yield chunk_batch(chunk)


def chunk_batch(chunk: bytes) -> RowBatch:
    """The rows of whole lines of a rank file.

    Three readers, fastest first, each refusing (None) what it cannot read exactly as the next would:
    the step lines as CSV (`_csv_batch`: lines exactly as encode_record writes them), then the whole
    chunk through pyarrow's JSON reader (`_columnar_batch`: step rows of any key order or extra
    fields), both C++ outside the GIL; the few other rows are found by how encode_record begins them
    and decoded with json.loads. When neither can be trusted - pyarrow refuses a line (cut short by a
    dying process; a NaN, which JSON proper does not allow), the lines it read disagree with the
    lines found, a step row lacks its rank or step - the chunk is read line by line as `read_records`
    does, skipping lines that do not decode: same rows, only slower."""
    for reader in (_csv_batch, _columnar_batch):
        fast = reader(chunk)
        if fast is not None:
            return fast
    batch = RowBatch()
    for line in chunk.splitlines():
        record = _decode(line)
        if record is not None:
            batch.add(record)
    return batch


# A step line as encode_record writes it, its colons and closing brace turned into commas, is one CSV
# row of fixed fields: each key (in quotes; the first after the opening brace) and its value, then '' -
#   {"kind":"step","rank":3,"step":7,"t_s":0.1,...,"bytes_sent":9}  ->  {"kind","step","rank",3,...,9,
# pyarrow's CSV reader reads that faster than its JSON reader reads the line (about 1.0 against 1.9
# microseconds a row here). Each key, the kind and the empty last field are read as bytes of their
# exact length and compared whole with the ones expected, in order, so a line of another shape is
# never read into the wrong column (a key of another length fails the read itself).
_CSV_FIXED = {"key kind": b'{"kind"', "kind": b'"step"', **{f"key {k}": f'"{k}"'.encode() for k in _STEP_SCHEMA_KEYS},
              "close": b""}
_CSV_NAMES = ("key kind", "kind", *(name for k in _STEP_SCHEMA_KEYS for name in (f"key {k}", k)), "close")
_TO_CSV = bytes.maketrans(b":}", b",,")  # same length: a line sits at the same offset in both


def _csv_batch(chunk: bytes) -> RowBatch | None:
    """The chunk's rows, read as read_records reads them, or None (let the JSON reader try).

    Lines of the step row's shape become the step matrix; every other line (another kind of record,
    a line cut short, a step row with other fields) has another number of fields, and is found in the
    chunk and decoded with json.loads like read_records does (skipped if it does not decode). None
    where one of those is a step row (its place among the others' rows would be lost) or a line of the
    step row's shape holds another key, kind or a value that is not a number.

    Numbers are read by pyarrow's CSV converter, which also reads a few spellings JSON forbids and
    json.dumps never writes (`.5`, `+1`, `01`): such a line is stored with its number rather than
    skipped as undecodable."""
    try:
        import pyarrow as pa
        import pyarrow.csv as pa_csv
    except ImportError:
        return None
    skipped: list[str] = []

    def skip(row: Any) -> str:
        skipped.append(row.text)
        return "skip"

    text = chunk.translate(_TO_CSV)
    types = {name: pa.binary(len(expected)) for name, expected in _CSV_FIXED.items()}
    types.update((k, pa.int64() if k in _INT_KEYS else pa.float64()) for k in _STEP_SCHEMA_KEYS)
    try:
        table = pa_csv.read_csv(
            pa.py_buffer(text),
            read_options=pa_csv.ReadOptions(column_names=_CSV_NAMES, use_threads=False, block_size=len(chunk) + 1),
            parse_options=pa_csv.ParseOptions(quote_char=False, double_quote=False, escape_char=False,
                                               invalid_row_handler=skip),
            convert_options=pa_csv.ConvertOptions(column_types=types, null_values=["null"], strings_can_be_null=False))
    except (pa.ArrowException, ValueError):  # ValueError: a skipped line that is not UTF-8
        return None
    if not all(_all_equal(table.column(name), expected) for name, expected in _CSV_FIXED.items()):
        return None
    batch = RowBatch()
    for line in _lines_at(chunk, text, skipped):
        if line is None:
            return None
        record = _decode(line)
        if record is not None:
            if record.get("kind") == "step":
                return None
            batch.add(record)
    return _with_step_matrix(batch, table)


def _all_equal(column: Any, expected: bytes) -> bool:
    """Whether every value of a fixed-size binary column is `expected` (one comparison of its bytes)."""
    for piece in column.chunks:
        if piece.null_count:
            return False
        width = len(expected)
        data = piece.buffers()[1]
        if width and data[piece.offset * width:(piece.offset + len(piece)) * width].to_pybytes() != expected * len(piece):
            return False
    return True


def _lines_at(chunk: bytes, text: bytes, found: list[str]) -> Iterator[bytes | None]:
    """The lines of `chunk` whose translations are `found` (whole lines of `text`, in order; a line cut
    short can also begin an earlier line, so a match inside a line is passed over); None for one that
    is not there."""
    at = 0
    for line in found:
        needle = line.encode()
        while (at := text.find(needle, at)) >= 0:
            end = at + len(needle)
            if (at == 0 or text[at - 1] in b"\r\n") and text[end:end + 1] in (b"", b"\n", b"\r"):
                break
            at += 1
        if at < 0:
            yield None
            return
        yield chunk[at:end]
        at = end


def _columnar_batch(chunk: bytes) -> RowBatch | None:
    try:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.json as pa_json
    except ImportError:
        return None
    fields = [("kind", pa.string())] + [(k, pa.int64() if k in _INT_KEYS else pa.float64()) for k in _STEP_SCHEMA_KEYS]
    options = pa_json.ParseOptions(explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore")
    try:
        table = pa_json.read_json(pa.py_buffer(chunk), read_options=pa_json.ReadOptions(use_threads=False),
                                  parse_options=options)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    lines = chunk.count(b"\n") + (not chunk.endswith(b"\n"))
    if table.num_rows != lines:  # a blank line, or a line holding two objects: let json.loads judge each line
        return None
    batch = RowBatch()
    others = _other_lines(chunk)
    for line in others:
        record = _decode(line)
        if record is None:
            return None
        batch.add(record)
    is_step = pc.fill_null(pc.equal(table.column("kind"), "step"), False)
    steps = table.filter(is_step)
    known = pc.sum(pc.is_in(table.column("kind"), pa.array(RECORD_KINDS))).as_py() or 0
    if len(others) + steps.num_rows != known:
        return None  # a row of a known kind that does not begin as encode_record begins it
    return _with_step_matrix(batch, steps)


def _with_step_matrix(batch: RowBatch, steps: Any) -> RowBatch | None:
    """`batch` with the step rows of a pyarrow table (the columns _STEP_SCHEMA_KEYS) as its float matrix,
    or None when an integer column has a null or a value float64 cannot hold exactly."""
    import numpy as np

    matrix = np.empty((steps.num_rows, len(_STEP_SCHEMA_KEYS)))
    for i, k in enumerate(_STEP_SCHEMA_KEYS):
        column = steps.column(k)
        if k in _INT_KEYS:
            # Integers must survive the trip through float64 (exact below 2**53); a missing one stays NULL
            # on the slow path, which refuses a step without rank or step as before.
            if column.null_count:
                return None
            values = column.to_numpy()
            if len(values) and int(np.abs(values).max()) >= 2**53:
                return None
            matrix[:, i] = values
        else:
            matrix[:, i] = column.to_numpy(zero_copy_only=False)  # a null becomes NaN: NULL in sqlite
    batch.step_matrix = matrix
    batch.counts["step"] += steps.num_rows
    return batch


def _other_lines(chunk: bytes) -> list[bytes]:
    """The lines of the chunk that begin as encode_record begins a record other than a step."""
    text = b"\n" + chunk
    found = []
    for match in _OTHER_START.finditer(text):
        end = text.find(b"\n", match.start() + 1)
        found.append(text[match.start() + 1:end if end >= 0 else len(text)])
    return found


def _decode(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def run_files(run_dir: Path) -> list[Path]:
    """A run's rank files in the order of their ranks (rank-2 before rank-10; remote-rank-N after
    rank-N, so its rows win where both hold one): the store's key order, so that a big ingest appends
    to the table's b-tree rather than splitting pages in its middle (about 10% faster)."""
    return sorted(run_dir.glob("*rank-*.jsonl"), key=_rank_then_name)


def _rank_then_name(path: Path) -> tuple[int, str]:
    rank = path.name.removesuffix(".jsonl").rpartition("-")[2]
    return (int(rank) if rank.isdigit() else -1, path.name)
