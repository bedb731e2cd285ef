"""`partitioned` against end-to-end training on the digits: accuracy and memory per rank.

Runs `ddlscope run --json` for one process (end to end) and for 2 and 3 parts, same workload, seed,
steps and global batch, and prints a table: final test accuracy and loss, and the largest rank's
parameter + gradient + optimizer + activation bytes. Usage:

    PYTHONPATH=src python benchmarks/partitioned_digits.py [--steps 300] [--db /tmp/partitioned.db]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

WORKLOAD = ["--workload", "mlp-digits", "--set", "workload.layers=3", "--set", "workload.hidden=256",
            "--set", "workload.optimizer=sgd", "--set", "workload.eval_every=0"]
STATES = ("parameters", "gradients", "optimizer", "activations_peak")


def run(strategy: str, world: int, steps: int, seed: int, db: str) -> dict:
    cmd = [sys.executable, "-m", "ddlscope", "run", *WORKLOAD, "--strategy", strategy, "--world-size", str(world),
           "--steps", str(steps), "--seed", str(seed), "--db", db, "--json", "--quiet"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--db", default="/tmp/partitioned-bench.db")
    args = parser.parse_args()
    print("| run | parts | test accuracy (per seed) | test loss | largest rank's states + activations |")
    print("|---|---|---|---|---|")
    for strategy, world in (("single", 1), ("partitioned", 2), ("partitioned", 3)):
        results = [run(strategy, world, args.steps, seed, args.db) for seed in range(args.seeds)]
        accuracy = ", ".join(f"{r['final_eval']['metric']:.3f}" for r in results)
        loss = ", ".join(f"{r['final_eval']['loss']:.3f}" for r in results)
        memory = max(sum(m.get(k, 0) for k in STATES) for m in results[0]["memory_bytes_by_rank"].values())
        print(f"| {strategy} | {world} | {accuracy} | {loss} | {memory / 1024:.1f} KiB |")


if __name__ == "__main__":
    main()
