"""DBS against a 2x straggler: the epoch time of homogeneous ddp, ddp with a straggler, dbs with one.

Issue 20's bar: with one worker twice as slow, `dbs` must move the epoch time
most of the way from the straggler-bound time (`ddp`, straggler) toward the
homogeneous one (`ddp`, no straggler). The best a split can do with speeds 1
and 1/2 is a step of 2/3 of the straggler-bound one (shares 2/3 and 1/3, both
workers busy 2/3 of the straggler's time), so the bar's "most of the way" is
at most (1 - 2/3) / (1 - 1/2) = 67% of the gap closed, plus whatever the
all-reduce costs that does not scale with compute.

Each configuration runs `--epochs` epochs of the main study's accuracy
workload (cnn-digits, global batch 256: 1437 training images, 5 steps an
epoch; `--channels` 64 by default, the study's 16 makes an epoch about 0.1 s,
too short to time on a shared machine) on 2 ranks, through the real launcher; the three are run
interleaved `--repeats` times so machine noise lands on all of them. An
epoch's time is, on rank 0's clock, from the start of its first step to the
start of the next epoch's first step (the end of the last step for the last
epoch). The first epoch is left out of the reported mean: dbs runs it on the
equal split (nothing is measured yet), and every run pays its one-off costs
there. Printed: per configuration the median over repeats of the mean epoch
time of epochs 2.., dbs's split of the last epoch, the share of the gap
closed, and the load average before and after.

Run:  PYTHONPATH=src python benchmarks/dbs_straggler.py [--epochs 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "ddp homogeneous": {"strategy": {"name": "ddp"}, "slowdown": []},
    "ddp 2x straggler": {"strategy": {"name": "ddp"}, "slowdown": [1.0, 2.0]},
    "dbs 2x straggler": {"strategy": {"name": "dbs"}, "slowdown": [1.0, 2.0]},
}
BATCH = 256


def experiment(config: dict[str, Any], epochs: int, steps_per_epoch: int, channels: int = 16) -> Any:
    from ddlscope.runtime.config import experiment_from_dict

    return experiment_from_dict({
        "seed": 0,
        "workload": {"name": "cnn-digits", "channels": channels, "batch_size": BATCH, "steps": epochs * steps_per_epoch,
                     "eval_every": 0, "lr": 0.1, "momentum": 0.8},
        "strategy": config["strategy"],
        "cluster": {"world_size": 2, "slowdown": config["slowdown"]},
    })


def epoch_times(store_path: Path, exp: Any, steps_per_epoch: int) -> tuple[list[float], list[tuple[int, ...]]]:
    """Each epoch's wall time on rank 0, and each step's per-rank batch."""
    from ddlscope.runtime.launcher import launch
    from ddlscope.store import Store

    result = launch(exp, store_path)
    if result.status != "finished":
        raise SystemExit(f"run {result.status}: {result.error}")
    with Store(store_path) as store:
        rows = store.steps(result.run_id)
    rank0 = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])
    starts = [r["t_s"] for r in rank0] + [rank0[-1]["t_s"] + rank0[-1]["step_s"]]
    epochs = [starts[e + steps_per_epoch] - starts[e] for e in range(0, len(rank0), steps_per_epoch)]
    splits = [tuple(r["samples"] for r in rows if r["step"] == step) for step in range(len(rank0))]
    return epochs, splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--channels", type=int, default=64,
                        help="cnn-digits channels: 64 makes an epoch long enough to time on a shared machine")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first is left out)")
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    from ddlscope.workloads import WORKLOADS

    train_len = len(WORKLOADS.get("cnn-digits").build(experiment(CONFIGS["ddp homogeneous"], 1, 1).workload, 0).train)
    steps_per_epoch = train_len // BATCH
    load_before = os.getloadavg()
    means: dict[str, list[float]] = {label: [] for label in CONFIGS}
    last_split: dict[str, tuple[int, ...]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for label, config in CONFIGS.items():
                store = Path(tmp) / "bench.db"
                epochs, splits = epoch_times(store, experiment(config, args.epochs, steps_per_epoch, args.channels),
                                              steps_per_epoch)
                means[label].append(statistics.mean(epochs[1:]))
                last_split[label] = splits[-1]
                print(f"repeat {repeat}: {label:18} epochs " + " ".join(f"{e:.3f}" for e in epochs)
                      + " s; batches per epoch " + " ".join(str(splits[e]) for e in range(0, len(splits), steps_per_epoch)),
                      flush=True)
    load_after = os.getloadavg()
    median = {label: statistics.median(values) for label, values in means.items()}
    homogeneous, straggler, dbs = (median[k] for k in CONFIGS)
    print(f"\ncnn-digits (channels {args.channels}), global batch {BATCH}, 2 ranks, {steps_per_epoch} steps an epoch, {args.epochs} epochs, "
          f"median of {args.repeats} repeats of the mean epoch time of epochs 2..{args.epochs}:")
    for label in CONFIGS:
        print(f"  {label:18} {median[label]:.3f} s   (last step's batches {last_split[label]})")
    gap = straggler - homogeneous
    closed = (straggler - dbs) / gap if gap > 0 else float("nan")
    print(f"  dbs closes {closed:.0%} of the straggler's gap (the split's ceiling: 67%); dbs / homogeneous "
          f"{dbs / homogeneous:.2f}, ddp straggler / homogeneous {straggler / homogeneous:.2f}")
    print(f"  load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"(1 min; {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
