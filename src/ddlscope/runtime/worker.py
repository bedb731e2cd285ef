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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddlscope.runtime.config import experiment_from_json
from ddlscope.runtime.flops import StepFlops, flops_message, peak_flops
from ddlscope.runtime.loop import LoopResult, train
from ddlscope.runtime.netns import join_rank_namespace
from ddlscope.runtime.profiler import profile_task
from ddlscope.runtime.ps_server import serve
from ddlscope.runtime.rows import RowWriter, leave_done_marker, rank_file, read_records, remote_rank_file
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


def worker_main(experiment_json: str, run_dir: str, link_json: str = "", shaping_json: str = "") -> dict[str, Any]:
    _die_with_launcher()
    exp = experiment_from_json(experiment_json)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, node_rank = int(os.environ["LOCAL_RANK"]), int(os.environ.get("GROUP_RANK", "0"))
    torch.set_num_threads(exp.cluster.threads_per_rank)
    writer = RowWriter(rank_file(Path(run_dir), rank), rank)
    try:
        delay_s = exp.cluster.start_delay_of(rank)
        if delay_s:
            writer.event("start_delay", f"{delay_s}s")
            time.sleep(delay_s)
        device = choose_device(exp.cluster, local_rank)
        backend = choose_backend(exp.cluster, device)
        if shaping_json:  # shaped network mode: gloo runs inside this rank's namespace
            dist.init_process_group(backend, **join_rank_namespace(shaping_json, local_rank, rank, world, backend))
        else:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        _check_same_experiment(exp)
        workers = exp.cluster.world_size
        # new_group is collective: every rank, servers included, must call it.
        worker_group = dist.new_group(list(range(workers))) if workers < world else None
        link = LinkModel(**json.loads(link_json)) if link_json else None
        ctx = RunContext(rank, world, local_rank, node_rank, device, backend, exp, link, workers, worker_group)
        writer.event("started", f"host={os.uname().nodename} pid={os.getpid()} device={device} backend={backend}")
        outcome = _take_part(exp, ctx, writer, Path(run_dir))
        # The model, DDP's reducer and the strategy's communication futures died with _take_part's
        # frame; collect any cycles now, on this thread and with the process group alive, rather than
        # in the teardown below, where freeing them raced with gloo's threads (a rare hang at exit).
        gc.collect()
        writer.close()
        if exp.cluster.nnodes > 1:
            _send_rows_to_rank0(Path(run_dir), rank, node_rank)
        _finish_together(world)
        leave_done_marker(Path(run_dir), rank, os.getpid())  # see launcher.ExitReaper
        return outcome
    except BaseException as exc:
        if not writer.closed:
            writer.event("error", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        writer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _take_part(exp: Experiment, ctx: RunContext, writer: RowWriter, run_dir: Path) -> dict[str, Any]:
    """Serve (a parameter-server rank) or train and save; what this rank reports to the launcher."""
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    strategy = runtime_class(exp.strategy)(exp.strategy, ctx)
    if getattr(strategy, "is_server", lambda: False)():
        serve(task, strategy, ctx, writer)  # type: ignore[arg-type]
        return {"rank": ctx.rank, "role": "server"}
    _record_flops(task, exp, ctx, writer)  # on the plain model, before the strategy wraps it
    traces = traces_dir_for(run_dir) if exp.trace_steps else None
    result = train(task, strategy, ctx, writer, traces_dir=traces)
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
    if exp.save_model_path:
        full_state = strategy.full_state_dict(result.model)  # collective for sharded strategies
        if rank == 0:
            torch.save(full_state, exp.save_model_path)
    if exp.checkpoint_dir:
        strategy.save_checkpoint(result.model, result.optimizer, exp.checkpoint_dir)
        writer.event("checkpoint", exp.checkpoint_dir)


def _finish_together(world: int, timeout_s: float = 600.0) -> None:
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
        time.sleep(0.01)


def _check_same_experiment(exp: Experiment) -> None:
    """Every launcher of a multi-node run must have been given the same experiment (but its node rank)."""
    same_everywhere = exp.model_dump(mode="json", exclude={"cluster": {"node_rank"}})
    digest = hashlib.sha256(json.dumps(same_everywhere, sort_keys=True).encode()).hexdigest()[:16]
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        raise RuntimeError(f"launchers were given different experiments (config digests {sorted(set(digests))})")


def _send_rows_to_rank0(run_dir: Path, rank: int, node_rank: int) -> None:
    """Rows of ranks on other nodes travel to rank 0 over torch.distributed.

    Node 0's launcher owns the store; a rank elsewhere keeps its own file on its
    node and sends a copy, which rank 0 writes beside its own for ingestion.
    """
    mine = list(read_records(rank_file(run_dir, rank))) if node_rank != 0 else None
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0 and gathered:
        for src_rank, records in enumerate(gathered):
            if records:
                writer = RowWriter(remote_rank_file(run_dir, src_rank), src_rank)
                for record in records:
                    writer.write_record(record)
                writer.close()
