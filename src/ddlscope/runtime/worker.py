"""Entry point of every worker process started by the elastic launcher."""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddlscope.runtime.checkpoint import Checkpointer, params_sha256
from ddlscope.runtime.config import experiment_from_json
from ddlscope.runtime.heartbeat import Heartbeat
from ddlscope.runtime.flops import StepFlops, flops_message, peak_flops
from ddlscope.runtime.loop import LoopResult, train
from ddlscope.runtime.netns import join_rank_namespace
from ddlscope.runtime.profiler import profile_task
from ddlscope.runtime.ps_server import serve
from ddlscope.runtime.rows import RowWriter, leave_done_marker, rank_file, remote_rank_file
from ddlscope.runtime.trace import traces_dir_for
from ddlscope.specs import ClusterSpec, Experiment
from ddlscope.strategies import runtime_class
from ddlscope.strategies.base import RunContext, Strategy
from ddlscope.strategies.comm import LinkModel
from ddlscope.workloads import WORKLOADS
from ddlscope.workloads.base import Task


def choose_device(cluster: ClusterSpec, local_rank: int) -> torch.device:
    want_cuda = cluster.device == "cuda" or (cluster.device == "auto" and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.device = 'cuda' but CUDA is not available on this node")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_backend(cluster: ClusterSpec, device: torch.device) -> str:
    if cluster.backend != "auto":
        return cluster.backend
    return "nccl" if device.type == "cuda" else "gloo"


def _die_with_launcher() -> None:
    """A worker must not outlive its launcher (killed, or timed out by a test): ask Linux to kill it too."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


PR_SET_PDEATHSIG = 1


def _stop_at_once_on_signals() -> None:
    """SIGINT and SIGTERM end a rank at once, by the kernel's default action, not with a Python
    exception: a rank blocked in a collective cannot run a handler until the collective returns, which
    kept a Ctrl-C waiting up to the agent's 30 s grace. Nothing is lost: rows are on disk line by line
    and checkpoints are sealed only when whole; the launcher records the run as interrupted."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


# gloo's and NCCL's own collective timeout: a backstop behind the hang watchdog, which ends a stuck
# run much sooner (cluster.hang_timeout_s past the slowest step).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def _attempt_store() -> Any:
    """The process group's store for this attempt of the worker group.

    After a restart, a group built on the agent's store as it is fails to connect ("Gloo
    connectFullMesh failed", stale addresses of the previous attempt; PLATFORM.md); one key prefix
    per attempt keeps the attempts apart.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=600))
    return dist.PrefixStore(f"attempt{attempt}", store)


def worker_main(experiment_json: str, run_dir: str, link_json: str = "", shaping_json: str = "",
                checkpoint_root: str = "", launch_dir: str = "", checkpoint_key: str = "") -> dict[str, Any]:
    """One rank of a run. `launch_dir`: this launch's own folder for heartbeats and the done marker (the
    launcher signals no pid from an older launch's files); `checkpoint_key`: hex of the run's checkpoint
    key (checkpoint.run_key; empty on nodes other than 0), handed over in memory, never written to disk."""
    _die_with_launcher()
    _stop_at_once_on_signals()
    exp = experiment_from_json(experiment_json)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, node_rank = int(os.environ["LOCAL_RANK"]), int(os.environ.get("GROUP_RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(exp.cluster.threads_per_rank)
    writer = RowWriter(rank_file(Path(run_dir), rank), rank)
    own_dir = Path(launch_dir or run_dir)
    heartbeat = Heartbeat(own_dir, rank, attempt)
    try:
        if attempt:
            writer.event("restart", f"attempt {attempt} of the worker group (torch elastic restart)")
        delay_s = exp.cluster.start_delay_of(rank)
        if delay_s:
            writer.event("start_delay", f"{delay_s}s")
            time.sleep(delay_s)
        device = choose_device(exp.cluster, local_rank)
        backend = choose_backend(exp.cluster, device)
        if shaping_json:  # shaped network mode: gloo runs inside this rank's namespace
            dist.init_process_group(backend, **join_rank_namespace(shaping_json, local_rank, rank, world, backend))
        else:
            dist.init_process_group(backend, store=_attempt_store(), rank=rank, world_size=world,
                                    timeout=COLLECTIVE_TIMEOUT, device_id=device if device.type == "cuda" else None)
        _check_same_experiment(exp)
        workers = exp.cluster.world_size
        # new_group is collective: every rank, servers included, must call it.
        worker_group = dist.new_group(list(range(workers))) if workers < world else None
        link = LinkModel(**json.loads(link_json)) if link_json else None
        ctx = RunContext(rank, world, local_rank, node_rank, device, backend, exp, link, workers, worker_group)
        writer.event("started", f"host={os.uname().nodename} pid={os.getpid()} device={device} backend={backend}")
        checkpointer = Checkpointer(Path(checkpoint_root) if checkpoint_root else Path(run_dir) / "checkpoints",
                                    exp, rank, device, worker_group, final=bool(exp.checkpoint_dir),
                                    key=bytes.fromhex(checkpoint_key))
        outcome = _take_part(exp, ctx, writer, Path(run_dir), checkpointer, heartbeat)
        heartbeat.beat(phase="finish")
        # The model, DDP's reducer and the strategy's communication futures died with _take_part's
        # frame; collect any cycles now, on this thread and with the process group alive, rather than
        # in the teardown below, where freeing them raced with gloo's threads (a rare hang at exit).
        gc.collect()
        writer.close()
        if exp.cluster.nnodes > 1:
            _send_rows_to_rank0(Path(run_dir), rank, node_rank)
        _finish_together(world, heartbeat)
        leave_done_marker(own_dir, rank, os.getpid())  # see launcher.ExitReaper
        return outcome
    except BaseException as exc:
        if not writer.closed:
            writer.event("error", f"{type(exc).__name__}: {exc}")
        if _peer_was_lost(exc):
            time.sleep(PEER_LOSS_GRACE_S)
        raise
    finally:
        writer.close()
        heartbeat.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# A rank whose collective failed because a peer vanished waits this long before failing: the agent
# reports the first exit it sees (polling every 0.1 s), and that should be the vanished peer's, the
# root cause, not this consequence of it (ranks forked from one server can be reported together).
PEER_LOSS_GRACE_S = 1.0
PEER_LOSS_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _peer_was_lost(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in PEER_LOSS_MARKERS)


def _take_part(exp: Experiment, ctx: RunContext, writer: RowWriter, run_dir: Path, checkpointer: Checkpointer,
               heartbeat: Heartbeat) -> dict[str, Any]:
    """Serve (a parameter-server rank) or train and save; what this rank reports to the launcher."""
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    strategy = runtime_class(exp.strategy)(exp.strategy, ctx)
    if getattr(strategy, "is_server", lambda: False)():
        serve(task, strategy, ctx, writer, checkpointer, heartbeat)  # type: ignore[arg-type]
        return {"rank": ctx.rank, "role": "server"}
    _record_flops(task, exp, ctx, writer)  # on the plain model, before the strategy wraps it
    traces = traces_dir_for(run_dir) if exp.trace_steps else None
    result = train(task, strategy, ctx, writer, traces_dir=traces, checkpointer=checkpointer, heartbeat=heartbeat)
    _save_outputs(exp, strategy, result, ctx.rank, writer)
    return {"rank": ctx.rank, "role": "worker", "train_s": result.train_s, "final_loss": result.final_loss}


def _record_flops(task: Task, exp: Experiment, ctx: RunContext, writer: RowWriter) -> None:
    """Model FLOPs of one of this rank's steps, and the peak FLOP/s MFU divides them by (event `flops`).

    Every strategy here is data parallel: each worker computes the whole model
    on its per-rank batch (FSDP shards state, not compute), so one
    forward + backward of that batch is the rank's work per step.
    """
    step = StepFlops.from_profile(profile_task(task, exp.per_rank_batch()))
    peak, source = peak_flops(ctx.device, exp.cluster.threads_per_rank)
    writer.event("flops", flops_message(step, peak, source))


def _save_outputs(exp: Experiment, strategy: Strategy, result: LoopResult, rank: int, writer: RowWriter) -> None:
    """The final model's hash (event `final_params`: `show --json` reports it as final_params_sha256)
    and, when asked, the model itself."""
    full_state = strategy.full_state_dict(result.model)  # collective for sharded strategies
    if rank == 0:
        writer.event("final_params", f"sha256={params_sha256(full_state)}")
        if exp.save_model_path:
            torch.save(full_state, exp.save_model_path)


def _finish_together(world: int, heartbeat: Heartbeat, timeout_s: float = 600.0) -> None:
    """Wait until every rank is done, through the rendezvous store rather than a gloo barrier.

    A gloo barrier right before exit races with process teardown: its work object
    is destroyed on gloo's thread, which needs the GIL, while the main thread,
    holding the GIL, frees the DDP reducer and joins that thread (seen here as a
    rare hang at exit). The store has no such thread.
    """
    store = dist.distributed_c10d._get_default_store()
    store.add("ddlscope/finished", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("ddlscope/finished", 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank finished within {timeout_s:.0f} s")
        heartbeat.beat()
        time.sleep(0.01)


def _check_same_experiment(exp: Experiment) -> None:
    """Every launcher of a multi-node run must have been given the same experiment (but its node rank).

    The digests are compared as numbers through two all-reduces (min and max), not exchanged as
    pickled objects.
    """
    same_everywhere = exp.model_dump(mode="json", exclude={"cluster": {"node_rank"}})
    digest = int(hashlib.sha256(json.dumps(same_everywhere, sort_keys=True).encode()).hexdigest()[:15], 16)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    low = torch.tensor([digest], dtype=torch.int64, device=device)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if int(low.item()) != int(high.item()):
        raise RuntimeError("launchers were given different experiments (their config digests differ)")


def _send_rows_to_rank0(run_dir: Path, rank: int, node_rank: int) -> None:
    """Rows of ranks on other nodes travel to rank 0 over torch.distributed.

    Node 0's launcher owns the store; a rank elsewhere keeps its own file on its
    node and sends a copy of its bytes (JSON lines, never pickled objects), which
    rank 0 writes beside its own for ingestion.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = rank_file(run_dir, rank).read_bytes() if node_rank != 0 else b""
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    if longest == 0:
        return
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    if mine:
        padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(padded) for _ in sizes] if rank == 0 else None
    dist.gather(padded, gathered, dst=0)
    if rank == 0 and gathered:
        for src_rank, (data, length) in enumerate(zip(gathered, sizes)):
            if int(length.item()):
                remote_rank_file(run_dir, src_rank).write_bytes(data[:int(length.item())].cpu().numpy().tobytes())
