"""MG-WFBP against DDP's 25 MB buckets and one bucket per layer: measured and predicted exposed communication.

Runs `ddlscope run` with strategy.buckets = size, per_layer, mgwfbp on the emulated fast and slow networks
(2 ranks, `scaled`), then `ddlscope buckets RUN` on each, and prints per run: the measured exposed
communication and step time, and the exposed communication the alpha-beta model predicts for the plan used.
Timings on a shared 2-core machine are noisy: give the load (`uptime`) with the numbers.

    PYTHONPATH=src python benchmarks/bucket_plans.py [--workload gpt-synthetic] [--steps 20] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOADS = {  # a model with many layers, where the merge has choices to make
    "gpt-synthetic": ["--set", "workload.layers=6", "--set", "workload.hidden=128", "--set", "workload.heads=4",
                      "--set", "workload.seq_len=32", "--batch-size", "16"],
    "cnn-digits": ["--batch-size", "256"],
}


def ddlscope(*args: str, db: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "ddlscope", *args, "--db", str(db), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt-synthetic", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    db = Path(tempfile.mkdtemp()) / "buckets.db"
    print(f"{'network':8} {'plan':10} {'buckets':>7} {'exposed ms (measured)':>22} {'predicted':>9} "
          f"{'step ms':>8}")
    for network in ("fast", "slow"):
        for plan in ("size", "per_layer", "mgwfbp"):
            exposed, steps, predicted, buckets = [], [], [], 0
            for _ in range(args.repeats):
                run = ddlscope("run", "-w", args.workload, "-s", "ddp", "-n", "2", "--steps", str(args.steps),
                               "--quiet", *WORKLOADS[args.workload], "--set", f'strategy.buckets="{plan}"',
                               "--set", f'cluster.network.profile="{network}"', "--set", "cluster.network.scaled=true",
                               db=db)
                report = ddlscope("buckets", str(run["run"]["id"]), db=db)
                exposed.append(run["comm"]["exposed_s"])
                steps.append(run["mean_step_s"])
                used = report["used"] or report["plans"][2]
                predicted.append(used["predicted_exposed_s"])
                buckets = len(used["buckets"])
            print(f"{network:8} {plan:10} {buckets:>7} {statistics.median(exposed) * 1e3:>22.2f} "
                  f"{statistics.median(predicted) * 1e3:>9.2f} {statistics.median(steps) * 1e3:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
