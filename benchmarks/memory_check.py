"""Estimate vs measurement: `ddlscope memory` against real 2-rank `ddlscope run`s on this machine.

For each model x strategy it runs a short training (`ddlscope run`, a few
steps, a small batch; a finished run of the same name in the store is reused)
and prints rank 0's measured bytes per category (the runtime's parameters,
gradients, optimizer, activations; a parameter server's too) beside the
estimate `ddlscope memory --json` gives for the same experiment, and the
relative error. Exit status 1 when a category is off by more than --tolerance.

    python benchmarks/memory_check.py                      # 3 models x 3 strategies, ~5 minutes on 2 cores
    python benchmarks/memory_check.py --models hf:gpt2 --strategies fsdp --markdown
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODELS = ("torchvision:resnet18", "hf:llama", "module:examples.my_model:build")
STRATEGIES = ("ddp", "fsdp", "ps-async")
CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
ROOT = Path(__file__).resolve().parents[1]


def ddlscope(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "ddlscope", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"ddlscope {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


def measured(model: str, strategy: str, world: int, batch: int, steps: int, db: Path,
             sets: tuple[str, ...] = ()) -> dict[str, dict[str, int]]:
    """Bytes per category per rank of a finished run (run now unless the store has it)."""
    name = " ".join(["memcheck", model, strategy, f"n{world}", f"b{batch}", *sets])
    run_id = _finished_run(name, db)
    if run_id is None:
        ddlscope("run", "--workload", model, "--strategy", strategy, "--world-size", str(world),
                 "--batch-size", str(batch), "--steps", str(steps), "--name", name, "--db", str(db), "--quiet",
                 *_set_flags(sets))
        run_id = _finished_run(name, db)
    shown = json.loads(ddlscope("show", str(run_id), "--json", "--db", str(db)))
    return shown["memory_bytes_by_rank"]


def _finished_run(name: str, db: Path) -> int | None:
    from ddlscope.store import Store

    if not db.exists():
        return None
    with Store(db) as store:
        found = [r.id for r in store.runs_named(name) if r.status == "finished"]
    return found[0] if found else None  # newest first


def _set_flags(sets: tuple[str, ...]) -> list[str]:
    return [flag for item in sets for flag in ("--set", item)]


def estimated(model: str, strategy: str, world: int, batch: int,
              sets: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Bytes per category by role (worker, server) from `ddlscope memory --json`."""
    out = json.loads(ddlscope("memory", model, "--strategy", strategy, "--world-size", str(world),
                              "--batch", str(batch), "--json", *_set_flags(sets)))
    return {rank["role"]: rank["bytes"] for rank in out["estimates"][0]["ranks"]}


def compare(model: str, strategy: str, world: int, batch: int, steps: int, db: Path,
            sets: tuple[str, ...] = ()) -> list[dict[str, object]]:
    """One row per (role, category): measured on rank 0 (a server: the first server rank), estimated, error."""
    got = measured(model, strategy, world, batch, steps, db, sets)
    want = estimated(model, strategy, world, batch, sets)
    rows = []
    for role, estimate in want.items():
        rank = "0" if role == "worker" else str(world)
        for category in CATEGORIES:
            if category not in got.get(rank, {}):
                continue  # a server measures no gradients or activations
            m, e = got[rank][category], estimate[category]
            error = (e - m) / m if m else (0.0 if e == 0 else float("inf"))
            rows.append({"model": model, "strategy": strategy, "role": role, "category": category,
                         "measured_bytes": m, "estimated_bytes": e, "error": error})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--db", type=Path, default=Path("memory_check.db"))
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for both the run and the estimate, e.g. workload.classes=11 (repeatable)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown (docs/memory.md)")
    args = parser.parse_args(argv)
    rows = [row for model in args.models for strategy in args.strategies
            for row in compare(model, strategy, args.world_size, args.batch, args.steps, args.db, tuple(args.sets))]
    _print(rows, args.markdown)
    worst = max((abs(r["error"]) for r in rows), default=0.0)  # type: ignore[arg-type]
    print(f"\nworst error {worst:.2%} (tolerance {args.tolerance:.0%})", flush=True)
    return 0 if worst <= args.tolerance else 1


def _print(rows: list[dict[str, object]], markdown: bool) -> None:
    header = ("model", "strategy", "rank", "category", "measured bytes", "estimated bytes", "error")
    lines = [(str(r["model"]), str(r["strategy"]), str(r["role"]), str(r["category"]), f"{r['measured_bytes']:,}",
              f"{r['estimated_bytes']:,.0f}", f"{r['error']:+.2%}") for r in rows]
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))


if __name__ == "__main__":
    sys.exit(main())
