"""Data pipeline vs naive loader on an input-bound workload: samples/s and stall fraction for both.

    PYTHONPATH=src python benchmarks/data_pipeline.py [--full]

The measurement is the `beyond` study's data section (src/ddlscope/studies/beyond_data.py): the
synthetic CIFAR images as Parquet shards, a small MLP, two epochs of batch 64, the naive loader
(in-process, shards re-read per batch) against the pipeline (2 loader workers, column projection,
local cache). Both produce identical batches; the table says so. Timing on a shared machine is
noisy: run it idle, and report `uptime` with the numbers.
"""

from __future__ import annotations

import os
import sys

from ddlscope.studies.beyond_data import data_section

if __name__ == "__main__":
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(data_section(quick="--full" not in sys.argv)[1])
