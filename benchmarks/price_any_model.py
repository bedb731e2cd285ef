"""How long pricing a large model from a model source takes, from a fresh process, and its peak memory.

The "any model" goal: an 8B and a 70B Llama config from `hf:llama` priced in under 5 s each with
under 2 GB of resident memory, the model built on the meta device (no weights allocated). Each
command runs in a new process, as a user types it (so the time includes importing torch,
torchvision and transformers); the table prints wall seconds and the child's peak RSS.

    .venv/bin/python benchmarks/price_any_model.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LLAMA = {
    "8B": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "intermediate": 14336},
    "70B": {"hidden": 8192, "layers": 80, "heads": 64, "kv_heads": 8, "intermediate": 28672},
}
VOCAB, SEQ = 128256, 8192


def commands(size: str) -> dict[str, list[str]]:
    k = LLAMA[size]
    predict = ["predict", "--model", "hf:llama", "--hidden", str(k["hidden"]), "--layers", str(k["layers"]),
               "--heads", str(k["heads"]), "--kv-heads", str(k["kv_heads"]), "--ffn-hidden", str(k["intermediate"]),
               "--vocab", str(VOCAB), "--seq", str(SEQ), "--global-batch", "512", "--cluster", "h100:16x8",
               "--tp", "8", "--pp", "2", "--dp", "8", "--micro-batch", "1", "--recompute", "selective", "--json"]
    memory = ["memory", "hf:llama", "--strategy", "fsdp", "--cluster", "h100:8x8", "--batch", "64", "--json"]
    memory += [arg for knob, value in {**k, "vocab": VOCAB, "seq_len": 2048}.items()
               for arg in ("--set", f"workload.{knob}={value}")]
    return {"predict": predict, "memory": memory}


def run(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in GB) of `ddlscope ARGV` in a fresh process."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "ddlscope", *argv], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, not every child's so far
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"ddlscope {' '.join(argv)} failed: {child.stderr.read().decode().strip()[-300:]}")
    return wall, usage.ru_maxrss / 1e6  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command (the median is shown)")
    args = parser.parse_args()
    print(f"{'model':<6} {'command':<8} {'median s':>9} {'min s':>7} {'peak RSS GB':>12}")
    for size in LLAMA:
        for name, argv in commands(size).items():
            runs = [run(argv) for _ in range(args.repeats)]
            walls = [w for w, _ in runs]
            print(f"{size:<6} {name:<8} {statistics.median(walls):>9.2f} {min(walls):>7.2f} "
                  f"{max(r for _, r in runs):>12.2f}")


if __name__ == "__main__":
    main()
