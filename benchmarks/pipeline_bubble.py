"""Why a measured pipeline bubble differs from (p - 1)/m on this machine.

Two ranks run the runtime's loop with `pipeline` (GPipe and 1F1B, m = 2, 4, 8; interleaved and
zero-bubble, 2 chunks a rank, m = 4) on a timed GPT, and measure a blocking loopback send/recv of one micro-batch's activation (ping-pong). Per
rank it prints: the measured idle / compute (median over steps 1..), the formula (p - 1)/m, torch's action
order played out with the ranks' own measured forward and backward times (predict/partition.py:
stage_bubbles: unequal stages), and that plus (m + 1) waits a step at the measured one-way transfer time
(both for one stage per rank only). The interleaved formula is (p - 1)/(m v); zero-bubble should idle less
than interleaved. Bubbles are timed here, not in the tests: on a shared machine a timed bubble fails on
noise (a CI run measured 1F1B at 0.326 against 0.25 at hidden 512, seq 128), and here noise is reported
rather than failed on; the wall/CPU column says how busy the cores were. On an idle machine GPipe and 1F1B
come within 1.05x of the formula from hidden 512, seq 128, batch 16 (docs/modelparallel.md).
Usage:

    PYTHONPATH=src python benchmarks/pipeline_bubble.py [--steps 6] [--hidden 512 --seq-len 128 --batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddlscope.predict.partition import bubble_fraction, stage_bubbles
from ddlscope.runtime.config import load_experiment
from ddlscope.runtime.loop import train
from ddlscope.runtime.rows import RowWriter, read_records
from ddlscope.strategies import runtime_class
from ddlscope.strategies.base import RunContext
from ddlscope.workloads import WORKLOADS

WORLD = 2
GPT = {"workload.name": "gpt-synthetic", "workload.layers": 4, "workload.hidden": 192, "workload.heads": 4,
       "workload.seq_len": 64, "workload.batch_size": 32, "workload.optimizer": "sgd", "workload.lr": 0.5,
       "workload.eval_batches": 1, "seed": 5, "strategy.name": "pipeline", "cluster.world_size": WORLD}
# (schedule, micro-batches, chunks a rank)
CELLS = [(schedule, m, 1) for schedule in ("gpipe", "1f1b") for m in (2, 4, 8)] + \
        [("interleaved", 4, 2), ("zero-bubble", 4, 2)]


def one_way_s(numel: int, repeats: int = 20) -> float:
    """Half the median round trip of a blocking send + recv of `numel` floats between ranks 0 and 1."""
    t = torch.zeros(numel)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 2


def worker(rank: int, port: int, out: str, steps: int, size: dict) -> None:
    torch.set_num_threads(1)
    GPT.update(size)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    sizes = {m: GPT["workload.batch_size"] // m * GPT["workload.seq_len"] * GPT["workload.hidden"] for _, m, _ in CELLS}
    transfer = {m: one_way_s(n) for m, n in sizes.items()}
    for schedule, m, chunks in CELLS:
        exp = load_experiment(None, {**GPT, "workload.steps": steps, "strategy.schedule": schedule,
                                     "strategy.micro_batches": m, "strategy.chunks": chunks})
        ctx = RunContext(rank, WORLD, rank, 0, torch.device("cpu"), "gloo", exp)
        task = WORKLOADS.get("gpt-synthetic").build(exp.workload, exp.seed)
        path = Path(out) / f"{schedule}-{m}-{rank}.jsonl"
        writer = RowWriter(path, rank)
        train(task, runtime_class(exp.strategy)(exp.strategy, ctx), ctx, writer)
        writer.close()
        rows = [r for r in read_records(path) if r.get("kind") == "step" and r["step"] >= 1]
        (Path(out) / f"{schedule}-{m}-{rank}.json").write_text(json.dumps(
            {"rows": rows, "transfer_s": transfer[m]}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=GPT["workload.hidden"])
    parser.add_argument("--seq-len", type=int, default=GPT["workload.seq_len"])
    parser.add_argument("--batch-size", type=int, default=GPT["workload.batch_size"])
    args = parser.parse_args()
    size = {"workload.hidden": args.hidden, "workload.seq_len": args.seq_len, "workload.batch_size": args.batch_size}
    GPT.update(size)
    out = tempfile.mkdtemp()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, out, args.steps, size), nprocs=WORLD, join=True, start_method="spawn")
    print(f"load average {os.getloadavg()[0]:.1f}; hidden {args.hidden}, seq {args.seq_len}, batch {args.batch_size}")
    print("| schedule | m | rank | fwd / bwd ms | idle ms | measured | (p-1)/(m v) | played out | + (m+1) waits "
          "| one-way transfer ms | wall/CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for schedule, m, chunks in CELLS:
        runs = [json.loads((Path(out) / f"{schedule}-{m}-{r}.json").read_text()) for r in range(WORLD)]
        forward = [statistics.median(x["forward_s"] for x in run["rows"]) for run in runs]
        backward = [statistics.median(x["backward_s"] for x in run["rows"]) for run in runs]
        compute = [f + b for f, b in zip(forward, backward)]
        one_stage = chunks == 1  # the played-out columns are for one stage a rank
        # zero-bubble has no closed form here: it should idle less than interleaved, the row above it
        formula = float("nan") if schedule == "zero-bubble" else bubble_fraction(WORLD, m) / chunks
        unequal = stage_bubbles(schedule, forward, backward, m) if one_stage else [float("nan")] * WORLD
        waited = (stage_bubbles(schedule, forward, backward, m, m + 1, statistics.fmean(r["transfer_s"] for r in runs))
                  if one_stage else [float("nan")] * WORLD)
        for rank, run in enumerate(runs):
            idle = statistics.median(x["comm_wait_s"] for x in run["rows"])
            cpu = statistics.median(x["compute_cpu_s"] for x in run["rows"])
            print(f"| {schedule} | {m} | {rank} | {forward[rank] * 1e3:.0f} / {backward[rank] * 1e3:.0f} | {idle * 1e3:.1f} | "
                  f"{idle / compute[rank]:.3f} | {formula:.3f} | {unequal[rank]:.3f} | {waited[rank]:.3f} | "
                  f"{run['transfer_s'] * 1e3:.2f} | {compute[rank] / cpu:.2f} |")


if __name__ == "__main__":
    main()
