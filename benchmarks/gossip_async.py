"""Synchronous vs asynchronous gossip under a straggler: how long each rank takes for its steps.

    PYTHONPATH=src python benchmarks/gossip_async.py [--steps 40] [--repeats 2] [--slowdown 2]

Two ranks of mlp-digits (512 wide, batch 256), the second `--slowdown` times slower (cluster.slowdown),
gossip in sync and async mode, alternated `--repeats` times so that the machine's load falls on both.
Prints, per mode, the median over repeats of each rank's training time (its last step's end) and mean
step, rank 0's exposed communication, and the straggler's models rank 0 mixed in. Asynchronous gossip
should let rank 0 finish in about 1 / slowdown of the straggler's time; synchronous holds it to the
straggler's pace. Numbers on a shared machine are noisy: say the load.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(db: Path, mode: str, steps: int, slowdown: float) -> dict[str, float]:
    argv = [sys.executable, "-m", "ddlscope", "run", "--quiet", "--strategy", "gossip", "--world-size", "2",
            "--steps", str(steps), "--batch-size", "256", "--set", "workload.hidden=512",
            "--set", f"strategy.mode={mode}", "--set", f"cluster.slowdown=[1, {slowdown}]", "--db", str(db)]
    subprocess.run(argv, check=True, capture_output=True, env={**os.environ})
    with sqlite3.connect(db) as conn:
        run_id = conn.execute("SELECT max(id) FROM runs").fetchone()[0]
        per_rank = conn.execute("SELECT rank, max(t_s + step_s), avg(step_s), avg(comm_wait_s) FROM steps "
                                "WHERE run_id = ? GROUP BY rank ORDER BY rank", (run_id,)).fetchall()
        events = [json.loads(m) for (m,) in conn.execute(
            "SELECT message FROM events WHERE run_id = ? AND kind = 'strategy_metric' AND rank = 0", (run_id,))]
    mixed = next((e["by_peer"].get("1") for e in events if e["name"] == "gossip_copies_mixed"), steps)
    return {"rank0_s": per_rank[0][1], "rank1_s": per_rank[1][1], "rank0_step_ms": per_rank[0][2] * 1e3,
            "rank1_step_ms": per_rank[1][2] * 1e3, "rank0_wait_ms": per_rank[0][3] * 1e3,
            "rank0_mixed_from_straggler": float(mixed)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--slowdown", type=float, default=2.0)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="ddlscope-gossip-async-") as tmp:
        db = Path(tmp) / "bench.db"
        for _ in range(args.repeats):
            for mode in results:
                results[mode].append(run_once(db, mode, args.steps, args.slowdown))
    print(f"load average {os.getloadavg()[0]:.1f}; {args.steps} steps, rank 1 {args.slowdown:g}x slower, "
          f"median of {args.repeats}")
    medians = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in results.items()}
    for mode, m in medians.items():
        print(f"{mode:5}  rank 0 {m['rank0_s']:.3f} s ({m['rank0_step_ms']:.1f} ms/step, {m['rank0_wait_ms']:.1f} ms "
              f"exposed comm)  rank 1 {m['rank1_s']:.3f} s ({m['rank1_step_ms']:.1f} ms/step)  rank 0 mixed "
              f"{m['rank0_mixed_from_straggler']:.0f} of the straggler's models")
    for mode, m in medians.items():
        print(f"{mode}: rank 0's time / the straggler's = {m['rank0_s'] / m['rank1_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
