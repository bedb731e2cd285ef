"""Synthetic rank files of a data-parallel run, in exactly the format the workers write.

`write_synthetic_run(store_path, ranks, steps)` creates a run in the store (status `running`, as the
launcher leaves it before ingesting) and writes `ddlscope-runs/<uuid>/rank-N.jsonl` beside the store,
one file per rank, each line made by `runtime.rows.encode_record` (the function `RowWriter.write`
uses), with the fields runtime/loop.py writes, in its order:

- a `step` row per rank and step. Every rank has its own speed (lognormal, sigma 5%; one rank in 64
  (37, 101, ...) is a straggler 25% slower) and per-step jitter; the ranks meet at an all-reduce, so a rank's
  `comm_wait_s` is the slowest rank's compute minus its own, plus the exposed all-reduce. The five
  phases add up to `step_s`, and `t_s` is the sum of the rank's earlier steps, as in the loop.
  Now and then a data-loading spike (1 step in 1,000).
- an `eval` row from rank 0 every `eval_every` steps (accuracy rising, loss falling);
- one `memory` row per rank (parameters, gradients, optimizer, activations, peak_rss);
- events: started, flops, train_start, a checkpoint every `checkpoint_every` steps, train_end, and
  rank 0's final_params.

Deterministic: the same (ranks, steps, seed) give the same bytes. `expected_summary` in
tests/test_store_scale.py recomputes the summary from these rows without the store.

`write_synthetic_traces(folder, ranks, mb_per_rank)` writes chrome traces shaped like torch.profiler's
(one `ddlscope.trace_anchor` range, CPU ops, a device track, flow events) and their sidecars, for the
trace merge.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import uuid as uuidlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddlscope.runtime.rows import encode_record, rank_file, run_dir_for  # noqa: E402
from ddlscope.store import Store  # noqa: E402

PER_RANK_BATCH = 32
PARAMETER_BYTES = 4 * 1_250_000
MODEL_FLOPS_PER_STEP = 54_000_000_000_000  # per rank: about 40% MFU of an H100's bf16 peak at ~0.136 s a step
STEP_FIELDS = ("t_s", "data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s", "step_s", "comm_s",
               "compute_cpu_s")
STRAGGLER = 37
WALL_ZERO = 1.8e9  # events' wall clock (time.time() of some day)


@dataclass(frozen=True)
class Shape:
    """What one synthetic run looks like."""

    ranks: int
    steps: int
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 2000
    strategy: str = "ddp"

    def speed_factors(self) -> np.ndarray:
        """Each rank's compute time over the nominal one (shared by every rank's generator)."""
        rng = np.random.default_rng([self.seed, 1])
        factors = rng.lognormal(0.0, 0.05, self.ranks)
        factors[STRAGGLER::64] *= 1.25  # stragglers: ranks 37, 101, 165, ...
        return factors

    def slowest_compute_s(self) -> np.ndarray:
        """Per step, the compute time of the slowest rank (every rank waits for it at the all-reduce)."""
        rng = np.random.default_rng([self.seed, 2])
        return 0.090 * float(self.speed_factors().max()) * (1.0 + 0.04 + 0.02 * rng.random(self.steps))


def config_of(shape: Shape) -> dict[str, Any]:
    """A run config as `ddlscope run` stores it (the fields the summary and the report read)."""
    return {
        "workload": {"name": "mlp-digits", "batch_size": PER_RANK_BATCH * shape.ranks if shape.strategy != "single"
                     else PER_RANK_BATCH * 1024, "steps": shape.steps, "eval_every": shape.eval_every,
                     "lr": 0.1, "optimizer": "sgd"},
        "cluster": {"world_size": shape.ranks, "nnodes": max(1, shape.ranks // 8), "device": "cuda",
                    "backend": "nccl"},
        "strategy": {"name": shape.strategy},
        "seed": shape.seed,
    }


def write_synthetic_run(store_path: Path, shape: Shape, name: str = "", workers: int = 1,
                        workload: dict[str, Any] | None = None) -> tuple[int, Path]:
    """Create the run (running, its launcher this process) and write its rank files; (run id, run dir)."""
    run_uuid = uuidlib.UUID(int=(shape.seed << 64) + shape.ranks * 1_000_003 + shape.steps).hex
    config = config_of(shape)
    if workload is not None:
        config["workload"] = workload
    with Store(store_path) as store:
        run_id = store.create_run(uuid=run_uuid, name=name, workload="mlp-digits", strategy=shape.strategy,
                                  world_size=shape.ranks, config=config, code_version="synthetic", seed=shape.seed,
                                  environment={"cores": 8 * shape.ranks, "synthetic": True})
        store.mark_running(run_id)
    run_dir = run_dir_for(Path(store_path), run_uuid)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_write_rank, [shape] * shape.ranks, [run_dir] * shape.ranks, range(shape.ranks),
                          chunksize=max(1, shape.ranks // (4 * workers))))
    else:
        for rank in range(shape.ranks):
            _write_rank(shape, run_dir, rank)
    return run_id, run_dir


def step_values(shape: Shape, rank: int) -> dict[str, np.ndarray]:
    """The step columns of one rank, as arrays over steps."""
    rng = np.random.default_rng([shape.seed, 3, rank])
    s = shape.steps
    factor = shape.speed_factors()[rank]
    jitter = 1.0 + 0.03 * rng.standard_normal(s)
    forward = np.maximum(0.030 * factor * jitter, 1e-4)
    backward = np.maximum(0.060 * factor * (1.0 + 0.03 * rng.standard_normal(s)), 1e-4)
    data = 0.002 * (1.0 + 0.1 * rng.random(s))
    data[rng.random(s) < 0.001] += 0.050  # a slow batch now and then
    allreduce = 0.012 * (1.0 + 0.05 * rng.random(s))
    comm_wait = np.maximum(shape.slowest_compute_s() - forward - backward, 0.0) + 0.3 * allreduce
    if shape.strategy == "single":
        comm_wait = np.zeros(s)
        allreduce = np.zeros(s)
    optimizer = 0.004 * (1.0 + 0.05 * rng.random(s))
    step_s = data + forward + backward + comm_wait + optimizer
    t_s = np.concatenate(([0.0005 * rank / max(shape.ranks, 1)], step_s[:-1])).cumsum()
    loss = 0.3 + 2.2 * np.exp(-np.arange(s) / max(s / 3, 1)) + 0.02 * rng.standard_normal(s)
    return {"t_s": t_s, "data_s": data, "forward_s": forward, "backward_s": backward, "comm_wait_s": comm_wait,
            "optimizer_s": optimizer, "step_s": step_s,
            # in flight: the exposed wait (the all-reduce waits for the slowest rank) plus the part hidden
            # behind backward
            "comm_s": comm_wait + 0.7 * allreduce,
            "compute_cpu_s": (forward + backward) * 0.97, "loss": loss}


def _write_rank(shape: Shape, run_dir: Path, rank: int) -> None:
    values = step_values(shape, rank)
    columns = [values[k].tolist() for k in STEP_FIELDS]
    losses = values["loss"].tolist()
    bytes_sent = 0 if shape.strategy == "single" else 2 * PARAMETER_BYTES * (shape.ranks - 1) // shape.ranks
    lines: list[str] = []
    seq = 0

    def event(t: float, kind: str, message: str) -> None:
        nonlocal seq
        lines.append(encode_record("event", rank, {"seq": seq, "t": WALL_ZERO + t, "event": kind, "message": message}))
        seq += 1

    event(0.0, "started", f"host=node{rank // 8} pid={1000 + rank} device=cuda:{rank % 8} backend=nccl")
    event(2.0, "flops", f"model_flops_per_step={MODEL_FLOPS_PER_STEP} hardware_flops_per_step="
                        f"{MODEL_FLOPS_PER_STEP} per_rank_batch={PER_RANK_BATCH} peak_flops_per_s=9.89e+14 "
                        "counted_on=meta peak_source=catalogue_h100_bf16")
    event(2.1, "train_start", f"per_rank_batch={PER_RANK_BATCH}")
    start = 2.1
    for step in range(shape.steps):
        row = {k: col[step] for k, col in zip(STEP_FIELDS, columns)}
        # runtime/loop.py's order: step, t_s, data_s, forward_s, backward_s, comm_wait_s, optimizer_s, step_s,
        # comm_s, compute_cpu_s, samples, loss, bytes_sent
        lines.append(encode_record("step", rank, {
            "step": step, "t_s": row["t_s"], "data_s": row["data_s"], "forward_s": row["forward_s"],
            "backward_s": row["backward_s"], "comm_wait_s": row["comm_wait_s"], "optimizer_s": row["optimizer_s"],
            "step_s": row["step_s"], "comm_s": row["comm_s"], "compute_cpu_s": row["compute_cpu_s"],
            "samples": PER_RANK_BATCH, "loss": losses[step], "bytes_sent": bytes_sent}))
        end_s = row["t_s"] + row["step_s"]
        if rank == 0 and (step + 1) % shape.eval_every == 0:
            progress = (step + 1) / shape.steps
            lines.append(encode_record("eval", rank, {
                "step": step, "wall_s": end_s, "samples_seen": (step + 1) * PER_RANK_BATCH * shape.ranks,
                "metric_name": "accuracy", "metric": round(0.5 + 0.45 * (1 - math.exp(-3 * progress)), 6),
                "loss": 0.3 + 2.2 * math.exp(-3 * progress)}))
        if (step + 1) % shape.checkpoint_every == 0:
            event(start + end_s, "checkpoint", f"step={step + 1}")
        if len(lines) >= 4096:
            _append(run_dir, rank, lines)
    train_s = columns[0][-1] + columns[6][-1] if shape.steps else 0.0
    rng = np.random.default_rng([shape.seed, 4, rank])
    lines.append(encode_record("memory", rank, {"bytes": {
        "parameters": PARAMETER_BYTES, "gradients": PARAMETER_BYTES, "optimizer": PARAMETER_BYTES,
        "activations": int(40_000_000 * (1 + 0.01 * rng.random())),
        "peak_rss": int(3_000_000_000 * (1 + 0.2 * rng.random()))}}))
    event(start + train_s, "train_end", f"train_s={train_s:.3f}")
    if rank == 0:
        event(start + train_s + 0.5, "final_params", "sha256=" + "ab" * 32)
    _append(run_dir, rank, lines)


def _append(run_dir: Path, rank: int, lines: list[str]) -> None:
    with open(rank_file(run_dir, rank), "a", encoding="utf-8") as f:
        f.write("".join(lines))
    lines.clear()


# ---------------------------------------------------------------------------- traces
TRACE_OPS = ("aten::linear", "aten::addmm", "aten::relu", "aten::mm", "aten::add_", "aten::copy_",
             "autograd::engine::evaluate_function: AddmmBackward0", "Optimizer.step#SGD.step")


def write_synthetic_traces(folder: Path, ranks: int, mb_per_rank: float, seed: int = 0) -> list[tuple[int, Path]]:
    """Chrome traces of `ranks` ranks, about `mb_per_rank` MB each, with their sidecars.

    One trace is written and the others are hard links to it (the merge reads each in full anyway, and
    the disk holds one copy); each rank's sidecar gives it its own anchor time."""
    folder.mkdir(parents=True, exist_ok=True)
    first = folder / "rank-0.json"
    _write_trace(first, int(mb_per_rank * 1e6), seed)
    out = []
    for rank in range(ranks):
        path = folder / f"rank-{rank}.json"
        if rank:
            if path.exists():
                path.unlink()
            os.link(first, path)
        path.with_name(path.stem + ".meta.json").write_text(json.dumps({"anchor_wall_s": WALL_ZERO + 0.001 * rank}))
        out.append((rank, path))
    return out


def _write_trace(path: Path, size_bytes: int, seed: int) -> None:
    rng = np.random.default_rng([seed, 5])
    with open(path, "w", encoding="utf-8") as f:
        f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [{"id": 0, "name": "synthetic"}],\n'
                '  "traceEvents": [\n')
        events = [{"ph": "M", "name": "process_name", "pid": 4242, "tid": 0, "args": {"name": "python 4242"}},
                  {"ph": "M", "name": "thread_name", "pid": 4242, "tid": 4242, "args": {"name": "thread 4242 (python)"}},
                  {"ph": "X", "cat": "user_annotation", "name": "ddlscope.trace_anchor", "pid": 4242, "tid": 4242,
                   "ts": 1_000_000.0, "dur": 1.5, "args": {"External id": 1}}]
        written = 0
        ts = 1_000_010.0
        n = 0
        while True:
            for e in events:
                text = json.dumps(e) + ",\n"
                f.write("  " + text)
                written += len(text) + 2
            if written >= size_bytes:
                break
            events = []
            for _ in range(256):
                n += 1
                dur = float(rng.integers(1, 400))
                op = TRACE_OPS[n % len(TRACE_OPS)]
                events.append({"ph": "X", "cat": "cpu_op", "name": op, "pid": 4242, "tid": 4242,
                               "ts": round(ts, 3), "dur": dur,
                               "args": {"External id": n, "Record function id": 0, "Sequence number": n,
                                        "Fwd thread id": 0, "Input Dims": [[32, 64], [64, 128]],
                                        "Input type": ["float", "float"]}})
                if n % 16 == 0:  # a kernel on the device track, linked by a flow
                    events.append({"ph": "X", "cat": "kernel", "name": "ampere_sgemm_64x32", "pid": 0, "tid": 7,
                                   "ts": round(ts + 5, 3), "dur": dur / 2, "args": {"correlation": n}})
                    events.append({"ph": "s", "id": n, "pid": 4242, "tid": 4242, "ts": round(ts, 3),
                                   "cat": "ac2g", "name": "ac2g"})
                    events.append({"ph": "f", "id": n, "pid": 0, "tid": 7, "ts": round(ts + 5, 3),
                                   "cat": "ac2g", "name": "ac2g", "bp": "e"})
                ts += dur + 1.0
        f.write('  {"ph": "M", "name": "process_sort_index", "pid": 4242, "tid": 0, "args": {"sort_index": 0}}\n'
                '  ],\n  "traceName": "synthetic"\n}\n')


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, required=True)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    print(write_synthetic_run(args.db, Shape(args.ranks, args.steps), workers=args.workers))
