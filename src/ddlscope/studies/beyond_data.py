"""Study section: the Parquet data pipeline against the naive loader on an input-bound workload.

The workload: the synthetic CIFAR images (3 x 32 x 32, the vision workloads' data) written as 8
Parquet shards, each image's float32 pixels zlib-compressed, and a small MLP whose step costs far
less than decoding a batch, so the loader decides the pace. Both loaders give the same batches (the
same order and augmentation, checked batch by batch):
    naive      in the training process, on demand: each batch reads its shards whole (every column)
               from the source folder, decodes and flips its images; no workers, no cache
    pipeline   runtime/parquet_data.py: 2 loader workers decode and augment (round-robin, prefetching),
               reading only the label and input columns from the local cache
Each trains for two epochs of one rank's shards (batch 64); the data phase of a step is the time it
waited for its batch, the stall. Reported: samples/s and the stall fraction (data time / step time),
over all steps including the workers' start at each epoch.

    rows, table = data_section(quick=True)     # quick: 2,000 images; full: 8,000
    python -m ddlscope.studies.beyond_data [--full]
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ddlscope.studies.text_table import render_rows

SAMPLES = {True: 2_000, False: 8_000}
BATCH = 64
WORKERS = 2
EPOCHS = 2
SHARDS = 8
HIDDEN = 128
TITLE = "data pipeline vs naive loader, input-bound (synthetic CIFAR, MLP, 1 rank)"

clock = time.perf_counter


def train_on(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], steps: int, seed: int = 0) -> dict[str, Any]:
    """SGD steps of a small MLP on the loader's batches: samples/s, stall fraction, and a digest of the
    batches (to check two loaders gave the same)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    digest = hashlib.sha256()
    data_s = samples = 0.0
    began = clock()
    for _ in range(steps):
        waited = clock()
        x, y = next(batches)
        data_s += clock() - waited
        digest.update(x.numpy().tobytes() + y.numpy().tobytes())
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        samples += len(y)
    total_s = clock() - began
    return {"samples/s": samples / total_s, "stall": data_s / total_s, "data ms/step": data_s / steps * 1e3,
            "step ms": total_s / steps * 1e3, "digest": digest.hexdigest()}


def data_section(quick: bool = True) -> tuple[list[dict[str, Any]], str]:
    """Measure both loaders; the table rows and the rendered table."""
    from ddlscope.runtime.parquet_data import NaiveLoader, PipelineLoader, RankOrder, write_shards
    from ddlscope.workloads import WORKLOADS

    workload = WORKLOADS.get("resnet-cifar")
    task = workload.build(workload.spec_class(samples=SAMPLES[quick], test_samples=10), 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core computes, the other is the workers' (2-core machine)
    try:
        with tempfile.TemporaryDirectory(prefix="ddlscope-data-") as tmp:
            order = RankOrder(write_shards(task.train, Path(tmp) / "source", SHARDS), 0, 1, 0, BATCH)
            steps = EPOCHS * order.batches_per_epoch
            naive = train_on(NaiveLoader(order, as_workers=WORKERS).batches(0), steps)
            pipeline = train_on(PipelineLoader(order, Path(tmp) / "local", workers=WORKERS).batches(0), steps)
    finally:
        torch.set_num_threads(threads)
    same = naive.pop("digest") == pipeline.pop("digest")
    rows = [{"loader": name, "steps": steps, **numbers, "same batches": "yes" if same else "NO"}
            for name, numbers in (("naive", naive), (f"pipeline ({WORKERS} workers)", pipeline))]
    rows.append({"loader": "pipeline / naive", "steps": None,
                 **{k: pipeline[k] / naive[k] for k in naive}, "same batches": "-"})
    return rows, render_rows(rows, TITLE)


if __name__ == "__main__":
    print(data_section(quick="--full" not in sys.argv)[1])
