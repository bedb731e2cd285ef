"""`ddlscope launch`: the user's own training script under torch's elastic agent, as torchrun runs it,
with ddlscope's loopback binding, hang watchdog, signal handling, restarts and store.

Each rank runs the script as `__main__` (runpy) in a process the launcher starts (launcher.py's
`launch_processes`, the one elastic launch), with RANK, WORLD_SIZE, MASTER_ADDR/PORT set as torchrun
sets them and DDLSCOPE_RUN_DIR naming the run's folder. A script that calls `ddlscope.attach` writes
its rank rows and heartbeats there (runtime/attach.py). The run is created in the store when rank 0's
first row appears, so a script that fails before its first measured step, or never attaches, leaves
nothing in the store; after the ranks end, every rank's file is ingested and the run marked.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ddlscope.runtime.attach import (
    ATTACHED_EVENT, LAUNCHER_LOGS_ENV, RUN_DIR_ENV, RUN_NAME_ENV, TRACE_STEPS_ENV, create_attached_run, current_meter)
from ddlscope.runtime.heartbeat import Watchdog
from ddlscope.runtime.launcher import (
    HANG_STARTUP_S, RDZV_ID, _environment_variable, end_hung_run, first_failure, interrupted_by, launch_processes,
    start_progress, storing_rows)
from ddlscope.runtime.rows import done_pids, ingest_run_dir, rank_file, read_records, run_dir_for
from ddlscope.runtime.sinks import SinkChoice, run_label
from ddlscope.specs import ConfigError
from ddlscope.store import Store, StoreError


@dataclass
class ScriptResult:
    status: str  # finished | failed | interrupted
    run_id: int | None
    run_dir: Path
    error: str | None = None
    rows: dict[str, int] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)  # sink -> where it wrote (--log)
    log_errors: list[str] = field(default_factory=list)


def check_script(script: Path) -> None:
    """Refuse, in one line, a script that cannot be run, before any process starts."""
    if not script.exists():
        raise ConfigError(f"{script}: no such file")
    if not script.is_file():
        raise ConfigError(f"{script}: not a file (give the training script's path)")
    if script.suffix != ".py":
        raise ConfigError(f"{script}: not a Python script (.py)")


def launch_script(script: Path, args: list[str], nprocs: int, store_path: Path, *, name: str | None = None,
                  hang_timeout_s: float = 300.0, max_restarts: int = 0,
                  on_progress: Callable[[dict[str, Any]], None] | None = None,
                  output_to_stderr: bool = False, sinks: SinkChoice | None = None,
                  trace_steps: int = 0) -> ScriptResult:
    """Run `script ARGS` in `nprocs` ranks on this machine and store what its attached meter measured.

    `output_to_stderr`: the script's standard output goes to standard error (`launch --json` keeps its
    standard output for the summary). `trace_steps`: the attached meters profile steps 1..N
    (torch.profiler), for `ddlscope trace RUN`.

    `sinks`: TensorBoard / MLflow / W&B, fed here from rank 0's file (the ranks pay nothing).

    Raises ConfigError (nothing stored) when the script fails before it measures a step, or ends
    without ever attaching."""
    check_script(script)
    run_uuid = uuid.uuid4().hex
    run_dir = run_dir_for(store_path, run_uuid)
    run_dir.mkdir(parents=True, exist_ok=True)
    opener = _RunOpener(store_path, run_uuid, run_dir)
    opener.start()
    stop_progress = threading.Event()
    label = name or script.stem
    logging_to = sinks.open(run_label(label, run_uuid), {"name": label, "script": str(script), "args": list(args),
                                                         "world_size": nprocs}, batch_ranks=nprocs) if sinks else None
    progress = start_progress(run_dir, 0, on_progress, stop_progress, logging_to)
    watchdog = Watchdog(run_dir, list(range(nprocs)), hang_timeout_s, end_hung_run, startup_s=HANG_STARTUP_S)
    watchdog.start()
    status, error = "finished", None
    try:
        # The ranks learn that this launcher logs (their meters then leave `attach(log=...)` to it).
        with _environment_variable(LAUNCHER_LOGS_ENV, ",".join(sinks.names) if sinks else ""):
            launch_processes(script_main, (str(script.resolve()), list(args), str(run_dir), label,
                                           output_to_stderr, trace_steps), nprocs,
                             run_id=f"{RDZV_ID}-{run_uuid[:12]}", max_restarts=max_restarts)
    except ChildFailedError as exc:
        status, error = "failed", first_failure(exc)
    except (KeyboardInterrupt, SignalException) as exc:
        status, error = "interrupted", interrupted_by(exc)
    finally:
        stop_progress.set()
        watchdog.stop()
        opener.stop()
        if progress:
            progress.join(timeout=5)
        log_errors = logging_to.close(status) if logging_to is not None else []
    if watchdog.message:
        status, error = "failed", watchdog.message
    run_id = opener.open_now()  # a file that appeared after the opener's last look
    if run_id is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        if status == "finished":
            raise ConfigError(f"{script.name} ended without measuring a step: call ddlscope.attach(model, optimizer) "
                              "and mark steps with `with meter.step():` (docs/attach.md)")
        raise ConfigError(f"{script.name} failed before its first measured step: {error}")
    storing_rows(on_progress)
    result = _store(store_path, run_id, run_dir, nprocs, status, error, watchdog.message)
    result.logs, result.log_errors = (logging_to.places if logging_to else {}), log_errors
    return result


def script_main(script: str, args: list[str], run_dir: str, name: str, output_to_stderr: bool = False,
                trace_steps: int = 0) -> dict[str, Any]:
    """A rank: run the script as `__main__`, then close its meter (the script may not have)."""
    if output_to_stderr:
        sys.stdout.flush()
        os.dup2(2, 1)
    os.environ[RUN_DIR_ENV] = run_dir
    os.environ[RUN_NAME_ENV] = name
    if trace_steps:
        os.environ[TRACE_STEPS_ENV] = str(trace_steps)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            _close_meter("failed", f"SystemExit: {exc.code}")
            raise
    except BaseException as exc:
        _close_meter("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed", f"{type(exc).__name__}: {exc}")
        raise
    _close_meter("finished", None)
    return {"rank": int(os.environ.get("RANK", "0"))}


def _close_meter(status: str, error: str | None) -> None:
    meter = current_meter()
    if meter is not None:
        meter.close(status, error)


class _RunOpener(threading.Thread):
    """Create the run in the store as soon as rank 0's file says what the job is (its `attached` record)."""

    def __init__(self, store_path: Path, run_uuid: str, run_dir: Path, poll_s: float = 0.2):
        super().__init__(name="ddlscope-run-opener", daemon=True)
        self.store_path, self.run_uuid, self.run_dir, self.poll_s = store_path, run_uuid, run_dir, poll_s
        self.run_id: int | None = None
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def run(self) -> None:
        while self.open_now() is None and not self._stop_event.wait(self.poll_s):
            pass

    def open_now(self) -> int | None:
        with self._lock:
            if self.run_id is None:
                description = _attached_description(rank_file(self.run_dir, 0))
                if description is not None:
                    self.run_id = create_attached_run(self.store_path, self.run_uuid, description, "ddlscope launch")
            return self.run_id


def _attached_description(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    for record in read_records(path):
        if record.get("kind") == "event" and record.get("event") == ATTACHED_EVENT:
            return json.loads(record["message"])
    return None


def _refuse_another_store(store: Store, run_id: int, run_dir: Path) -> None:
    """The store is opened again by path once the job ends: one renamed over it meanwhile would take the
    rows under another run's id. The run's folder is named by its uuid, which the run row must carry."""
    try:
        same = store.get_run(run_id).uuid == run_dir.name
    except StoreError:
        same = False
    if not same:
        raise StoreError(f"store {store.path.resolve()} was replaced during run {run_id}: it is not the store the run "
                         f"was created in, so its rows were not stored there; they are kept in {run_dir} "
                         "(rank-*.jsonl)")


def _store(store_path: Path, run_id: int, run_dir: Path, nprocs: int, status: str, error: str | None,
           hang: str | None) -> ScriptResult:
    with Store(store_path) as store:
        _refuse_another_store(store, run_id, run_dir)
        rows = ingest_run_dir(store, run_id, run_dir)
        closed = len(done_pids(run_dir))
        if status == "finished" and closed < nprocs:
            status, error = "failed", f"{nprocs - closed} of {nprocs} ranks never closed their meter"
        if hang:
            store.add_event(run_id, "hang", hang)
        elif status == "interrupted":
            store.add_event(run_id, "interrupted", error or "")
        store.mark_done(run_id, status, error)
    if status == "finished":
        shutil.rmtree(run_dir, ignore_errors=True)
    return ScriptResult(status, run_id, run_dir, error, rows)
