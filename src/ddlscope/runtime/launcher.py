"""Start the workers of one run through torch's elastic launcher (torchrun's API).

Single node: c10d rendezvous on 127.0.0.1 with a free port. Several nodes:
every node runs `ddlscope run` with the same experiment and the same
--rdzv-endpoint (node 0's host:port); node 0 hosts the rendezvous and owns
the store. Workers write rows to per-rank files; this module ingests them
into the store and decides the run's final status. `launch_processes` is the
one call of torch's elastic launcher, for runs and for calibrate's probes alike.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import ddlscope
from ddlscope.runtime.checkpoint import checkpoint_root, complete_steps, latest_checkpoint, run_key
from ddlscope.runtime.config import experiment_to_dict
from ddlscope.runtime.emulation import resolve_link
from ddlscope.runtime.heartbeat import Beat, Watchdog, process_state, signal_own_process
from ddlscope.runtime.netns import ShapedNetwork
from ddlscope.runtime.rank_server import FORKSERVER_PRELOAD
from ddlscope.runtime.recovery import hold_run_lock
from ddlscope.runtime.rows import (done_pids, ingest_run_dir, rank_file, record_outcome,  # noqa: F401 (re-exported)
                                   reserve_outcome, run_dir_for)
from ddlscope.runtime.sinks import SinkChoice, Sinks, run_label
from ddlscope.runtime.worker import worker_main
from ddlscope.specs import ConfigError, Experiment
from ddlscope.store import Run, Store, StoreError

RDZV_ID = "ddlscope"
# The environment this module was imported with: in a forked rank, the fork server's (see _rank_entry).
_ENVIRONMENT_AT_IMPORT = dict(os.environ)


@dataclass
class LaunchResult:
    status: str  # finished | failed | interrupted
    run_id: int | None  # None on nodes other than 0 (they own no store row)
    run_dir: Path
    error: str | None = None
    rows: dict[str, int] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)  # sink -> where it wrote (--log)
    log_errors: list[str] = field(default_factory=list)  # sinks that failed (the run went on)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def code_version() -> str:
    """Package version, plus the git commit when running from a checkout."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha, dirty = "", ""
    version = ddlscope.__version__
    return f"{version}+g{sha}{'.dirty' if dirty else ''}" if sha else version


def environment() -> dict[str, Any]:
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "platform": sys.platform,
        "load_average_1m": os.getloadavg()[0],  # other work on the machine skews every timing
    }


def run_environment(exp: Experiment) -> dict[str, Any]:
    """What a run of `exp` records as its environment: this machine, the resolved network, its ranks."""
    _, network_record = resolve_link(exp.cluster.network, exp.cluster.threads_per_rank)
    return {**environment(), "network": network_record, "ranks": exp.cluster.world_size,
            "extra_ranks": exp.strategy.extra_ranks()}


def launch(exp: Experiment, store_path: Path,
           on_progress: Callable[[dict[str, Any]], None] | None = None, resume: Run | None = None,
           sinks: SinkChoice | None = None) -> LaunchResult:
    """Run one experiment to the end and return how it went. Never leaves a run marked running.

    `resume`: a stored run (interrupted or failed) to continue from its newest checkpoint, under the
    same id; its rows from that checkpoint on are replaced. In `shaped` network mode the ranks'
    namespaces live for the whole launch and are removed whatever happens; when this machine cannot
    shape, ShapingUnavailable (a ConfigError, one line) is raised before the run is created.
    `sinks`: TensorBoard / MLflow / W&B, fed from rank 0's file by the progress thread (node 0 only).
    """
    cluster = exp.cluster
    if cluster.network.mode != "shaped":
        return _launch(exp, store_path, on_progress, resume=resume, sinks=sinks)
    if cluster.nnodes > 1:
        raise ConfigError(f"cluster.network.mode = 'shaped' runs on one node; cluster.nnodes = {cluster.nnodes} "
                          "(use mode = 'emulated' across nodes)")
    _, network_record = resolve_link(cluster.network, cluster.threads_per_rank)
    nprocs = cluster.procs_per_node + exp.strategy.extra_ranks()
    with ShapedNetwork(nprocs, network_record["shaped_bandwidth_bytes_per_s"]) as shaped:
        return _launch(exp, store_path, on_progress, shaped, resume, sinks)


def _open_run(exp: Experiment, store: Store, store_path: Path, resume: Run | None,
              locks: list[int]) -> tuple[int, Path, bytes]:
    """Create the run's row (or take the resumed one back) and its folder, holding the run's launcher lock
    (its descriptor appended to `locks`): (run id, run folder, checkpoint key)."""
    if resume is not None:
        run_dir = run_dir_for(store_path, resume.uuid)
        locks.append(hold_run_lock(run_dir))  # a second launcher of this run stops here
        current = store.get_run(resume.id)  # as it is now that no other launcher can hold it
        if current.shown_status not in ("interrupted", "failed", "died"):
            raise ConfigError(f"run {resume.id} is {current.shown_status}: only an interrupted or failed run can "
                              "be resumed")
        key = run_key(store.checkpoint_secret(), resume.uuid)
        found = latest_checkpoint(checkpoint_root(exp, run_dir), exp, key=key)  # before anything is unpickled
        if not store.take_over_run(resume.id, current.status, current.launcher_pid):
            raise ConfigError(f"run {resume.id} changed while being resumed (another process took it): try again")
        from_step = found.step if found else 0
        store.forget_rows_from(resume.id, from_step)
        store.add_event(resume.id, "resumed", f"from the checkpoint after step {from_step}" if found
                        else "no checkpoint: from step 0")
        return resume.id, run_dir, key
    run_uuid = uuid.uuid4().hex
    run_dir = run_dir_for(store_path, run_uuid)
    if exp.checkpoint_dir and complete_steps(Path(exp.checkpoint_dir)):
        raise ConfigError(f"checkpoint_dir {exp.checkpoint_dir} already holds checkpoints: continue that run with "
                          "`ddlscope run --resume RUN`, or name an empty folder")
    env_record = run_environment(exp)
    run_id = store.create_run(
        uuid=run_uuid, name=exp.name, workload=exp.workload.name, strategy=exp.strategy.name,
        world_size=exp.cluster.world_size, config=experiment_to_dict(exp), code_version=code_version(),
        seed=exp.seed, environment=env_record)
    locks.append(hold_run_lock(run_dir))
    return run_id, run_dir, run_key(store.checkpoint_secret(), run_uuid)


def _launch(exp: Experiment, store_path: Path, on_progress: Callable[[dict[str, Any]], None] | None,
            shaped: ShapedNetwork | None = None, resume: Run | None = None,
            sinks: SinkChoice | None = None) -> LaunchResult:
    """`_launch_holding`, letting go of the run's launcher lock however it ends."""
    locks: list[int] = []
    try:
        return _launch_holding(locks, exp, store_path, on_progress, shaped, resume, sinks)
    finally:
        for fd in locks:
            os.close(fd)


def fresh_launch_dir(run_dir: Path) -> Path:
    """A new folder for this launch's heartbeats and done markers: a resumed run never reads (or signals
    the pids in) the files of a launch before it. Older launches' folders go (their launcher is gone:
    this one holds the run's lock)."""
    for old in run_dir.glob("launch-*"):
        shutil.rmtree(old, ignore_errors=True)
    folder = run_dir / f"launch-{uuid.uuid4().hex[:12]}"
    folder.mkdir(parents=True)
    return folder


def _launch_holding(locks: list[int], exp: Experiment, store_path: Path,
                    on_progress: Callable[[dict[str, Any]], None] | None, shaped: ShapedNetwork | None,
                    resume: Run | None, sinks: SinkChoice | None) -> LaunchResult:
    cluster = exp.cluster
    link, network_record = resolve_link(cluster.network, cluster.threads_per_rank)
    if shaped:
        network_record.update(shaped.record())
    store: Store | None = None
    run_id: int | None = None
    key = b""  # nodes other than 0 hold no store: their ranks trust the manifest rank 0 verified
    if cluster.node_rank == 0:
        store = Store(store_path)
        try:
            run_id, run_dir, key = _open_run(exp, store, store_path, resume, locks)
        except BaseException:
            store.close()
            raise
    else:
        run_dir = run_dir_for(store_path, f"{uuid.uuid4().hex}-node{cluster.node_rank}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if store is not None:
        reserve_outcome(run_dir)
    launch_dir = fresh_launch_dir(run_dir)

    nprocs = cluster.procs_per_node + exp.strategy.extra_ranks()
    if store and run_id is not None:
        store.mark_running(run_id)
    stop_progress = threading.Event()
    logging_to = _open_sinks(exp, run_dir, sinks) if sinks is not None and run_id is not None else None
    progress = start_progress(run_dir, cluster.node_rank * cluster.procs_per_node, on_progress, stop_progress,
                              logging_to)
    reaper = ExitReaper(launch_dir, nprocs)
    reaper.start()
    first_rank = cluster.node_rank * cluster.procs_per_node
    local_ranks = list(range(first_rank, first_rank + cluster.procs_per_node)) \
        + list(range(cluster.world_size, cluster.world_size + exp.strategy.extra_ranks()))
    watchdog = Watchdog(launch_dir, local_ranks, cluster.hang_timeout_s, end_hung_run,
                        startup_s=HANG_STARTUP_S + max(cluster.start_delay_s, default=0.0))
    watchdog.start()
    status, error = "finished", None
    try:
        launch_processes(
            worker_main, (exp.model_dump_json(), str(run_dir), json.dumps(asdict(link)) if link else "",
                          shaped.worker_json() if shaped else "", str(checkpoint_root(exp, run_dir)),
                          str(launch_dir), key.hex()), nprocs,
            # Launchers of one multi-node run share the id; a local run gets its own, so two
            # runs on one machine can never join each other's rendezvous.
            run_id=RDZV_ID if cluster.rdzv_endpoint else f"{RDZV_ID}-{run_dir.name[:12]}",
            rdzv_endpoint=cluster.rdzv_endpoint, nnodes=cluster.nnodes, is_host=cluster.node_rank == 0,
            log_dir=run_dir / "logs", threads_per_rank=cluster.threads_per_rank, max_restarts=cluster.max_restarts)
    except ChildFailedError as exc:
        status, error = "failed", first_failure(exc)
        if reaper.killed:  # every rank had finished; only their exit hung
            status, error = "finished", None
    except (KeyboardInterrupt, SignalException) as exc:
        status, error = "interrupted", interrupted_by(exc)
    except Exception as exc:  # rendezvous errors and the like: the run did not happen
        status, error = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        stop_progress.set()
        reaper.stop()
        watchdog.stop()
        if progress:
            progress.join(timeout=5)
        log_errors = logging_to.close(status) if logging_to is not None else []
    if watchdog.message:  # the watchdog ended the run (through SIGTERM to this process)
        status, error = "failed", watchdog.message

    if status == "failed" and (full := full_disk_of(run_dir, checkpoint_root(exp, run_dir))):
        error = f"{full} ({error})"  # the ranks' own errors only say that a write failed, if anything
    remove_partial_checkpoints(checkpoint_root(exp, run_dir))
    result = LaunchResult(status, run_id, run_dir, error, logs=logging_to.places if logging_to else {},
                          log_errors=log_errors)
    if store is None or run_id is None:
        return result
    try:
        storing_rows(on_progress)
        events = [("exit_hang", f"every rank had finished, but pids {reaper.killed} did not exit within "
                                f"{reaper.grace_s:.0f} s (a torch/gloo teardown hang): killed")] if reaper.killed else []
        if watchdog.message:
            events.append(("hang", watchdog.message))
        elif result.status == "interrupted":
            events.append(("interrupted", result.error or ""))
        store_rows_and_status(store, run_id, result, exp.workload.steps * cluster.world_size, events)
    finally:
        store.close()
    return result


def store_rows_and_status(store: Store, run_id: int, result: LaunchResult, expected_steps: int,
                          events: list[tuple[str, str]]) -> None:
    """The run's rows from its folder into the store, its events and final status; the folder removed once
    a finished run's rows are all in the very store the run started with.

    The folder is kept, and StoreError raised naming it, when the store was replaced during the run (a
    rename over its path: this connection would write to a file nobody sees) or cannot take the rows (a
    full disk). In the second case the run's outcome is in the folder's outcome file and the run stays
    unfinished: the next command that opens the store (runtime/recovery.py) stores the rows and gives the
    run that outcome."""
    record_outcome(result.run_dir, result.status, result.error, expected_steps)
    _refuse_a_replaced_store(store, run_id, result.run_dir)
    try:
        result.rows = ingest_run_dir(store, run_id, result.run_dir)
        if result.status == "finished" and store.count_steps(run_id) != expected_steps:
            result.status = "failed"
            result.error = f"expected {expected_steps} step rows, got {store.count_steps(run_id)}"
        for kind, message in events:
            store.add_event(run_id, kind, message)
        store.mark_done(run_id, result.status, result.error)
    except StoreError as exc:
        raise StoreError(f"run {run_id}'s rows were not stored: {exc}; they are kept in {result.run_dir} "
                         f"(rank-*.jsonl): once the store can be written, any `ddlscope runs` stores them and marks "
                         f"the run {result.status}") from None
    _refuse_a_replaced_store(store, run_id, result.run_dir)
    if result.status == "finished":
        shutil.rmtree(result.run_dir, ignore_errors=True)  # everything is in the store now


def _refuse_a_replaced_store(store: Store, run_id: int, run_dir: Path) -> None:
    if not store.still_at_path():
        raise StoreError(f"store {store.path.resolve()} was replaced or removed during run {run_id}: it is not the "
                         f"file the run started with, so the run's rows were not stored there; they are kept in "
                         f"{run_dir} (rank-*.jsonl)")


# Below this much free space a filesystem counts as full: a failed write there is the disk's doing.
FULL_DISK_BYTES = 1 << 20


def full_disk_of(*paths: Path) -> str | None:
    """'no space left on device: the filesystem of PATH is full' for the first of `paths` on a full
    filesystem, or None."""
    for path in paths:
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            free = shutil.disk_usage(probe).free
        except OSError:
            continue
        if free < FULL_DISK_BYTES:
            return f"no space left on device: the filesystem of {path.resolve()} is full ({free} bytes free)"
    return None


def remove_partial_checkpoints(root: Path) -> None:
    """A checkpoint the ranks did not finish (a full disk, a crash mid-write) is never read: remove it."""
    for partial in root.glob("step-*.partial") if root.is_dir() else ():
        shutil.rmtree(partial, ignore_errors=True)


def _open_sinks(exp: Experiment, run_dir: Path, sinks: SinkChoice) -> Sinks:
    """The run's sinks, named after the run (run_dir's name is its uuid), its experiment as their config."""
    splits = exp.strategy.traits.splits_global_batch
    return sinks.open(run_label(exp.name or exp.workload.name, run_dir.name), experiment_to_dict(exp),
                      batch_ranks=exp.cluster.world_size if splits else 1)


# Before the first step, a rank may take this long to start (rendezvous, building the model) before
# the watchdog calls it hung; cluster.hang_timeout_s is added to it.
HANG_STARTUP_S = 300.0


def end_hung_run(message: str, beats: list[Beat]) -> None:
    """The watchdog found a hang: stop the elastic agent (a SIGTERM to this process, which the agent
    turns into an orderly shutdown without restarts) and kill every rank at once (a stopped rank
    cannot act on anything gentler)."""
    os.kill(os.getpid(), signal.SIGTERM)
    kill_ranks(beats)


def kill_ranks(beats: list[Beat]) -> list[int]:
    """SIGKILL the processes the beats are from, each only if it is the very process that beat (its
    start time) and one this launcher started (heartbeat.signal_own_process); the pids killed."""
    return [b.pid for b in beats if signal_own_process(b.pid, signal.SIGKILL, b.started_ticks)]


def launch_processes(entrypoint: Callable[..., Any], args: Sequence[Any], nprocs: int, *, run_id: str,
                     rdzv_endpoint: str | None = None, nnodes: int = 1, is_host: bool = True,
                     log_dir: Path | None = None, threads_per_rank: int = 1, max_restarts: int = 0) -> dict[int, Any]:
    """Run `entrypoint(*args)` in `nprocs` processes on this node through torch's elastic launcher,
    and return what each local rank returned. The one place ddlscope starts processes: training
    runs (`launch`) and calibrate's probes.

    c10d rendezvous at `rdzv_endpoint` (default: 127.0.0.1 and a free port); ranks are forked from a
    server process that has imported torch and the runtime (FORKSERVER_PRELOAD), each given this
    process's environment as of this call (_rank_entry). When a rank dies,
    the agent restarts the whole group up to `max_restarts` times (the workers continue from their
    newest checkpoint).
    `is_host`: this node hosts the rendezvous store (node 0; on one machine every launcher of a
    multi-node run would otherwise try to). `log_dir`: each rank's stdout and stderr go there
    (default: to this process's console). Failures raise as elastic_launch raises them
    (ChildFailedError, SignalException, rendezvous errors).

    Threads: each rank gets OMP_NUM_THREADS = `threads_per_rank` (1 unless the cluster says
    otherwise: two threads per rank on 2 cores made a 2-rank DDP step 4.7x slower); this
    process's own setting is put back afterwards.
    """
    quiet_torch_logging()
    with _environment_variable("OMP_NUM_THREADS", str(threads_per_rank)), \
            (nullcontext(rdzv_endpoint) if rdzv_endpoint else _loopback_only()) as endpoint:  # type: ignore[attr-defined]
        config = LaunchConfig(
            min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nprocs, run_id=run_id, rdzv_backend="c10d",
            rdzv_endpoint=endpoint, rdzv_configs={"is_host": is_host, "timeout": 600},
            max_restarts=max_restarts, monitor_interval=0.1, start_method="forkserver",
            local_addr=None if rdzv_endpoint else LOOPBACK,
            **({"logs_specs": DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL)} if log_dir else {}))
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
        return elastic_launch(config, _rank_entry)(dict(os.environ), threads_per_rank, os.getpid(), os.getcwd(),
                                                   entrypoint, *args)


def _rank_entry(environment: dict[str, str], threads: int, launcher_pid: int, cwd: str,
                entrypoint: Callable[..., Any], *args: Any) -> Any:
    """A rank's first call: the launcher's environment and working folder as of the launch, then
    `entrypoint(*args)`.

    A forked rank inherits the fork server's environment and folder, taken when the server started (the
    first launch of this process), not this launch's: a study, a test or your own code that launches
    again after changing folder would find relative paths (a checkpoint_dir, a script's data) beside the
    first launch's. The agent's own variables (RANK, MASTER_PORT, ...) are those that differ from the
    server's; everything else comes from the launcher. The thread count is set again because OpenMP read
    OMP_NUM_THREADS when the server imported torch.
    """
    import torch

    set_by_agent = {k: v for k, v in os.environ.items() if _ENVIRONMENT_AT_IMPORT.get(k) != v}
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(set_by_agent)
    os.chdir(cwd)
    torch.set_num_threads(threads)
    _die_with(launcher_pid)
    try:
        return entrypoint(*args)
    except (KeyboardInterrupt, SystemExit, Exception):
        # torch's spawn wrapper records an Exception quietly (its error file; the traceback to the agent,
        # not printed: `ddlscope launch`'s ranks write to the user's terminal)
        raise
    except BaseException as exc:  # torch's CheckpointException is a BaseException, which that wrapper lets out
        _fail_quietly(exc)


def _fail_quietly(exc: BaseException) -> NoReturn:
    """End a rank whose entrypoint raised, its traceback in its log only.

    An exception leaving the rank would be printed again by multiprocessing, after torch has put the
    console back as stderr: every rank's whole traceback on the user's terminal (141 lines for a full
    checkpoint folder). So the error file torch's `record` would write is written here (the launcher's
    one-line message comes from it), the traceback goes to the rank's log, and the rank exits 1. An error
    file that cannot be written (a full disk) is removed: an empty one fails the agent's parser."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    try:
        get_error_handler().record_exception(exc)
    except OSError:
        if error_file:
            Path(error_file).unlink(missing_ok=True)
    try:
        traceback.print_exc()  # stderr is the rank's log file here
        sys.stderr.flush()
    except OSError:  # the log's disk is full too
        pass
    raise SystemExit(1) from None


def _die_with(launcher_pid: int) -> None:
    """A rank must not outlive its launcher (killed, or timed out by a test). A forked rank's parent is
    the fork server, which outlives a killed launcher while any rank holds the server's liveness pipe
    (every fork inherits it), so the rank's PR_SET_PDEATHSIG (runtime/worker.py) would not fire: a
    thread waits on the launcher's pidfd and kills the rank when the launcher is gone."""
    if not hasattr(os, "pidfd_open"):  # not Linux: parent-death signals are not there either
        return
    try:
        launcher = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def wait_for_launcher() -> None:
        select.select([launcher], [], [])  # readable once the process has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_for_launcher, name="launcher-watch", daemon=True).start()


LOOPBACK = "127.0.0.1"


@contextmanager
def _loopback_only() -> Iterator[str]:
    """A local run listens on 127.0.0.1 only; yields the rendezvous endpoint.

    torch's elastic agent creates two TCPStore servers (the rendezvous's, and the one the workers
    build their process group on), and a TCPStore server listens on every interface whatever host
    it is given. A TCPStore given an already-listening socket (`master_listen_fd`) uses it, and
    multi-tenant stores on one port share one server: so the rendezvous port is a socket bound to
    127.0.0.1, served by a store made here, which the agent's own store then joins; the second
    server is built the same way through the rendezvous handler's one hook for it. gloo's own
    connections follow MASTER_ADDR (`local_addr`) to loopback, and GLOO_SOCKET_IFNAME=lo for them.
    """
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    sockets: list[socket.socket] = []

    def loopback_server() -> Any:
        sock = socket.socket()
        sock.bind((LOOPBACK, 0))
        sock.listen(1024)
        sockets.append(sock)
        return dist.TCPStore(LOOPBACK, sock.getsockname()[1], is_master=True, multi_tenant=True,
                             master_listen_fd=sock.fileno(), wait_for_workers=False)

    rendezvous_store = loopback_server()
    original = DynamicRendezvousHandler._create_tcp_store_server
    DynamicRendezvousHandler._create_tcp_store_server = lambda self, addr, port: loopback_server()  # type: ignore
    try:
        with _environment_variable("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo")):
            yield f"{LOOPBACK}:{rendezvous_store.port}"
    finally:
        DynamicRendezvousHandler._create_tcp_store_server = original  # type: ignore[method-assign]
        del rendezvous_store
        for sock in sockets:
            sock.detach()  # the store's server owns the descriptor now


@contextmanager
def _environment_variable(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def interrupted_by(exc: BaseException) -> str:
    """What stopped a launch: the signal torch's agent forwarded, or Ctrl-C."""
    return f"interrupted by {getattr(getattr(exc, 'sigval', None), 'name', 'SIGINT')}"


def first_failure(exc: ChildFailedError) -> str:
    """One line for the root-cause failure: the worker's exception, or how the process died.

    The earliest failure, as torch's get_first_failure picks it, except within one second (its
    timestamps are whole seconds): there a rank that died without a Python exception (killed, or
    exited) goes before ranks that raised, whose collectives failed because that rank was gone.
    """
    def raised(failure: Any) -> bool:
        return bool(failure.error_file) and Path(failure.error_file).exists()

    rank, failure = min(exc.failures.items(), key=lambda kv: (kv[1].timestamp, raised(kv[1]), kv[0]))
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    if lines and failure.error_file and Path(failure.error_file).exists():
        return f"rank {rank}: {lines[-1]}"
    if failure.exitcode is not None and failure.exitcode < 0:
        return f"rank {rank}: killed by {failure.signal_name()} (no Python error: out of memory or killed from outside?)"
    lines = [line for line in lines if not line.startswith(NO_ERROR_FILE_NOTE)]
    return f"rank {rank}: exited with code {failure.exitcode}" + (f": {lines[-1]}" if lines else "")


# What torch says of a rank that left no error file (its disk was full, say): nothing about the rank.
NO_ERROR_FILE_NOTE = "To enable traceback see"


def quiet_torch_logging() -> None:
    """The elastic agent logs every lifecycle step, and each worker's traceback at ERROR.

    ddlscope reports a failure itself in one line and keeps the full traceback
    in the worker logs, so the agent's own logging would only repeat it.
    """
    quieted = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    # torch's get_logger gives each module's logger a level of its own, which a parent's does not override
    # (an unreadable error file of a rank on a full disk was logged with its traceback, 17 lines).
    for name in [*quieted, *(n for n in list(logging.Logger.manager.loggerDict) if n.startswith(quieted))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


# How long finished ranks may take to exit before ExitReaper kills them.
EXIT_GRACE_S = 60.0


class ExitReaper(threading.Thread):
    """Kill ranks that finished but do not exit.

    Once its rows are written and every rank has finished, a rank leaves a marker file with its
    pid (rows.leave_done_marker). Rarely, torch/gloo's teardown then hangs and the process never exits, and
    the elastic agent would wait on it forever. When every local rank has left its marker and some
    are still alive `grace_s` later, they are killed; the launcher then keeps the run's status (its
    rows are complete, and checked as always) and records an `exit_hang` event.
    """

    def __init__(self, run_dir: Path, ranks: int, grace_s: float = EXIT_GRACE_S, poll_s: float = 1.0):
        super().__init__(name="ddlscope-exit-reaper", daemon=True)
        self.run_dir, self.ranks, self.grace_s, self.poll_s = run_dir, ranks, grace_s, poll_s
        self.killed: list[int] = []
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        all_done_at: float | None = None
        while not self._stop_event.wait(self.poll_s):
            pids = done_pids(self.run_dir)
            if len(pids) < self.ranks:
                continue
            all_done_at = all_done_at or time.monotonic()
            if time.monotonic() - all_done_at < self.grace_s:
                continue
            # A marker names a pid in a file: only a process this launcher started is signalled.
            self.killed += [pid for pid in filter(_running, pids) if signal_own_process(pid, signal.SIGKILL)]
            return


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child its parent has not reaped yet); without /proc, assumed alive
    (killing an exited pid is harmless here)."""
    return process_state(pid) not in ("zombie", "gone")


# A rank's events a progress display names its phase by (rank 0's: started, training, done training).
PROGRESS_EVENTS = ("started", "train_start", "train_end", "checkpoint")


def storing_rows(on_progress: Callable[[dict[str, Any]], None] | None) -> None:
    """Tell a progress display that the ranks are done and their rows are going into the store."""
    if on_progress is not None:
        on_progress({"kind": "phase", "phase": "storing rows"})


def start_progress(run_dir: Path, first_local_rank: int, on_progress: Callable[[dict[str, Any]], None] | None,
                    stop: threading.Event, sinks: Sinks | None = None) -> threading.Thread | None:
    """Follow the first local rank's row file and report each new step, evaluation and phase event
    (PROGRESS_EVENTS); hand `sinks` every record."""
    if on_progress is None and sinks is None:
        return None

    def follow() -> None:
        path = rank_file(run_dir, first_local_rank)
        offset = 0
        while True:
            done = stop.is_set()
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
                offset += len(complete)
                for line in complete.decode("utf-8").splitlines():
                    if sinks is not None:
                        try:
                            sinks.record(json.loads(line))
                        except ValueError:  # not JSON: the ingest skips such a line too
                            pass
                    if on_progress is not None and ('"kind":"step"' in line or '"kind":"eval"' in line
                                                    or any(f'"event":"{e}"' in line for e in PROGRESS_EVENTS)):
                        on_progress(json.loads(line))
            if done:
                return
            time.sleep(0.2)

    thread = threading.Thread(target=follow, name="ddlscope-progress", daemon=True)
    thread.start()
    return thread
