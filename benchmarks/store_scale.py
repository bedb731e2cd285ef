"""The store, its summaries, exports and reports, and the trace merge at cluster scale.

    PYTHONPATH=src .venv/bin/python benchmarks/store_scale.py --ranks 1024 --steps 10000 --workdir /tmp/scale

writes a synthetic run of RANKS x STEPS step rows (benchmarks/synthetic_rows.py: the rank files a
data-parallel run leaves, in the workers' format) plus a one-rank `single` run of the same workload
(the speedup's baseline), then measures, each in its own process as a user would run it:

- ingest: the rank files into the store (runtime/rows.py:ingest_run_dir, the path the launcher and
  the recovery of a dead launcher take), rows/s over the ingest call itself;
- the store's size on disk;
- `ddlscope show --json`, `scaling`, `export --format csv|parquet -o FILE` and `report -o FILE`:
  wall time and peak RSS (os.wait4's ru_maxrss of that process), and the report's size;
- the report opened in headless chromium (through Playwright, as tests/test_report_browser.py does):
  every image decoded, the time to the load event; skipped when either is missing;
- the merge of TRACE_RANKS chrome traces of TRACE_MB MB each into one Perfetto file (`ddlscope
  trace`'s merge_traces): wall time and peak RSS.

A command past --timeout-s or past --rss-limit-gb of resident memory is killed and reported as such
(the machine is shared). Each line also gives the command's CPU time (user + system, all its threads)
and the 1-minute load average at its end: on a machine other work shares, wall time alone misleads.
Results are printed as a table and written to WORKDIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))

from synthetic_rows import Shape, config_of, write_synthetic_run, write_synthetic_traces  # noqa: E402

INGEST = """
import json, sys, time
from pathlib import Path
from ddlscope.runtime.rows import ingest_run_dir
from ddlscope.store import Store
db, run_id, run_dir = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
with Store(db) as store:
    began = time.perf_counter()
    counts = ingest_run_dir(store, run_id, run_dir)
    ingest_s = time.perf_counter() - began
    store.mark_done(run_id, "finished")
print(json.dumps({"counts": counts, "ingest_s": ingest_s}))
"""

MERGE = """
import json, sys, time
from pathlib import Path
from ddlscope.analysis.trace_merge import RankTrace, merge_traces
folder, n = Path(sys.argv[1]), int(sys.argv[2])
began = time.perf_counter()
result = merge_traces([RankTrace(r, folder / f"rank-{r}.json") for r in range(n)], folder / "merged.json")
print(json.dumps({"events": result.events, "merge_s": time.perf_counter() - began}))
"""


def measure(cmd: list[str], *, cwd: Path, timeout_s: float, rss_limit_bytes: int,
            capture: bool = True) -> dict[str, Any]:
    """Run `cmd`; its wall time, peak RSS (ru_maxrss of that child alone, through wait4), exit status
    and stdout. Killed past `timeout_s` or past `rss_limit_bytes` of resident memory."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "120"}
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    killed: list[str] = []
    out_chunks: list[str] = []
    err_chunks: list[str] = []

    def drain(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    readers = [threading.Thread(target=drain, args=(proc.stderr, err_chunks), daemon=True)]
    if capture:
        readers.append(threading.Thread(target=drain, args=(proc.stdout, out_chunks), daemon=True))
    for t in readers:
        t.start()

    def guard() -> None:
        while proc.returncode is None:
            try:
                rss = _rss_bytes(proc.pid)
            except OSError:
                return
            if rss > rss_limit_bytes:
                killed.append(f"killed: resident memory passed {rss_limit_bytes / 2**30:.1f} GiB")
                proc.kill()
                return
            if time.perf_counter() - began > timeout_s:
                killed.append(f"killed: still running after {timeout_s:.0f} s")
                proc.kill()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=guard, daemon=True)
    watcher.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall_s = time.perf_counter() - began
    for t in readers:
        t.join(timeout=10)
    return {"wall_s": wall_s, "cpu_s": usage.ru_utime + usage.ru_stime, "load_1min": os.getloadavg()[0],
            "peak_rss_bytes": usage.ru_maxrss * 1024, "rc": proc.returncode,
            "stdout": "".join(out_chunks), "stderr": "".join(err_chunks)[-2000:],
            "killed": killed[0] if killed else None}


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddlscope", *args]


def browser_check(report: Path) -> dict[str, Any]:
    """Open the report in headless chromium: images decoded, console errors, time to `load`."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return {"skipped": "playwright is not installed"}
    if chromium is None:
        return {"skipped": "chromium is not installed"}
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-quic"]
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=args)
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        began = time.perf_counter()
        page.goto(report.resolve().as_uri(), timeout=120_000)
        page.wait_for_load_state("load")
        load_s = time.perf_counter() - began
        images = page.evaluate("() => Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
        tables = page.evaluate("() => document.querySelectorAll('table').length")
        browser.close()
    return {"load_s": load_s, "images": len(images), "images_ok": sum(images), "tables": tables,
            "console_errors": errors[:5]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    db = work / "scale.db"
    for stale in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        stale.unlink(missing_ok=True)
    shutil.rmtree(work / "ddlscope-runs", ignore_errors=True)
    limits = {"cwd": work, "timeout_s": args.timeout_s, "rss_limit_bytes": int(args.rss_limit_gb * 2**30)}
    results: dict[str, Any] = {"ranks": args.ranks, "steps": args.steps, "step_rows": args.ranks * args.steps}

    shape = Shape(args.ranks, args.steps)
    began = time.perf_counter()
    big_id, big_dir = write_synthetic_run(db, shape, name="scale", workers=args.workers)
    base_id, base_dir = write_synthetic_run(db, Shape(1, args.steps, strategy="single"), name="scale-single",
                                            workload=config_of(shape)["workload"])
    results["generate_s"] = time.perf_counter() - began
    results["rank_files_bytes"] = sum(p.stat().st_size for p in big_dir.iterdir())
    os.sync()  # the generator's gigabytes written back now, not during the ingest being timed
    print(f"generated {args.ranks} x {args.steps} rows ({results['rank_files_bytes'] / 1e9:.2f} GB of rank files) "
          f"in {results['generate_s']:.1f} s", flush=True)

    # In the order the runs were made, as a launcher ingests each run when it ends: the store's key
    # begins with the run id, so the big run's rows then append to the table's b-tree. (The other way
    # round, each of its rows goes in before the single run's, mid-tree: 7-20% slower here.)
    for key, run_id, run_dir in (("ingest", big_id, big_dir), ("ingest_single", base_id, base_dir)):
        m = measure([sys.executable, "-c", INGEST, str(db), str(run_id), str(run_dir)], **limits)
        if m["rc"] == 0:
            out = json.loads(m["stdout"])
            rows = sum(out["counts"].values())
            m.update(rows=rows, ingest_s=out["ingest_s"], rows_per_s=rows / out["ingest_s"])
        results[key] = m
        _say(key, m)
    results["store_bytes"] = sum(p.stat().st_size for p in work.glob("scale.db*"))
    print(f"store: {results['store_bytes'] / 1e9:.2f} GB", flush=True)
    if not args.keep_rank_files:
        shutil.rmtree(work / "ddlscope-runs", ignore_errors=True)

    commands = {
        "show": _cli("show", str(big_id), "--json", "--db", str(db)),
        "scaling": _cli("scaling", str(base_id), str(big_id), "--db", str(db)),
        "export_csv": _cli("export", str(big_id), "--format", "csv", "-o", str(work / "steps.csv"), "--db", str(db)),
        "export_parquet": _cli("export", str(big_id), "--format", "parquet", "-o", str(work / "steps.parquet"),
                               "--db", str(db)),
        "report": _cli("report", str(big_id), str(base_id), "-o", str(work / "report.html"), "--db", str(db)),
    }
    for key, cmd in commands.items():
        if key in args.skip:
            continue
        m = measure(cmd, **limits)
        results[key] = m
        _say(key, m)
    for key, name in (("export_csv", "steps.csv"), ("export_parquet", "steps.parquet"), ("report", "report.html")):
        if (work / name).exists() and key in results:
            results[key]["file_bytes"] = (work / name).stat().st_size
            (work / name).unlink() if key != "report" else None
    if "report" in results and results["report"]["rc"] == 0 and "browser" not in args.skip:
        results["browser"] = browser_check(work / "report.html")
        print(f"browser: {results['browser']}", flush=True)

    if "trace" not in args.skip:
        folder = work / "traces"
        shutil.rmtree(folder, ignore_errors=True)
        write_synthetic_traces(folder, args.trace_ranks, args.trace_mb)
        m = measure([sys.executable, "-c", MERGE, str(folder), str(args.trace_ranks)], **limits)
        if m["rc"] == 0:
            m.update(json.loads(m["stdout"]))
            m["file_bytes"] = (folder / "merged.json").stat().st_size
        m["input_bytes"] = (folder / "rank-0.json").stat().st_size * args.trace_ranks
        results["trace_merge"] = m
        _say("trace_merge", m)
        shutil.rmtree(folder, ignore_errors=True)
    return results


def _say(key: str, m: dict[str, Any]) -> None:
    extra = f", {m['rows_per_s']:,.0f} rows/s" if "rows_per_s" in m else ""
    extra += f", CPU {m['cpu_s']:.1f} s, load {m['load_1min']:.1f}"
    status = m["killed"] or (f"exit {m['rc']}: {m['stderr'].strip().splitlines()[-1:]}" if m["rc"] else "ok")
    print(f"{key}: {m['wall_s']:.1f} s, peak RSS {m['peak_rss_bytes'] / 2**20:,.0f} MiB{extra} ({status})", flush=True)


def table(results: dict[str, Any]) -> str:
    lines = [f"{results['ranks']} ranks x {results['steps']} steps = {results['step_rows']:,} step rows; "
             f"store {results.get('store_bytes', 0) / 1e9:.2f} GB",
             f"{'what':<16}{'wall s':>9}{'CPU s':>8}{'peak RSS MiB':>14}{'load':>6}  notes"]
    for key in ("ingest", "show", "scaling", "export_csv", "export_parquet", "report", "trace_merge"):
        m = results.get(key)
        if not m:
            continue
        notes = []
        if "rows_per_s" in m:
            notes.append(f"{m['rows_per_s']:,.0f} rows/s over {m['ingest_s']:.1f} s; "
                         f"{m['rows'] / m['cpu_s']:,.0f} rows per CPU-second of the process")
        if "file_bytes" in m:
            notes.append(f"file {m['file_bytes'] / 2**20:,.1f} MiB")
        if "input_bytes" in m:
            notes.append(f"input {m['input_bytes'] / 1e6:,.0f} MB")
        if m.get("killed") or m["rc"]:
            notes.append(m["killed"] or f"exit {m['rc']}")
        lines.append(f"{key:<16}{m['wall_s']:>9.1f}{m['cpu_s']:>8.1f}{m['peak_rss_bytes'] / 2**20:>14,.0f}"
                     f"{m['load_1min']:>6.1f}  {'; '.join(notes)}")
    if "browser" in results:
        lines.append(f"browser: {results['browser']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ddlscope-scale"))
    parser.add_argument("--workers", type=int, default=2, help="processes writing the rank files")
    parser.add_argument("--trace-ranks", type=int, default=64)
    parser.add_argument("--trace-mb", type=float, default=50.0)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="kill a command running longer")
    parser.add_argument("--rss-limit-gb", type=float, default=8.0, help="kill a command resident past this")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["show", "scaling", "export_csv", "export_parquet", "report", "browser", "trace"])
    parser.add_argument("--keep-rank-files", action="store_true")
    parser.add_argument("--label", default="", help="a name for this measurement in results.json")
    args = parser.parse_args()
    results = run(args)
    results["label"] = args.label
    print()
    print(table(results))
    out = args.workdir / f"results{'-' + args.label if args.label else ''}.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
