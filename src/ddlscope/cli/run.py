"""Runs: `run` one experiment, then read runs back: `runs`, `show`, `export`, `trace`, `scaling`."""

from __future__ import annotations

import csv
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.markup import escape
from rich.table import Column, Table

from ddlscope.cli.common import (DEFAULT_DB, MAX_RUN_ID, DbOption, RunArg, UserError, check_local_ranks, check_output_folder,
                                 check_run_outputs, console, err_console, json_option, open_store, progress_phase,
                                 has_control_characters, run_ref_callback)
from ddlscope.specs import is_baseline
from ddlscope.store import Run, Store, StoreError, atomic_output

LogOption = Annotated[Optional[str], typer.Option(
    "--log", metavar="SINKS", help="Also write each step's breakdown, throughput and MFU, and memory by category, to "
    "tensorboard, mlflow and/or wandb (comma-separated): event files, a local MLflow file store, a W&B offline run; "
    "nothing leaves this machine.")]
LogDirOption = Annotated[Optional[Path], typer.Option(
    "--log-dir", help="Where --log writes (default: ddlscope-logs beside the store).")]
EXPORT_FORMATS = ("csv", "json", "parquet")
EXPORT_TABLES = ("steps", "evals", "memory", "events")


# ---------------------------------------------------------------------------- run
def run(
    config: Annotated[Optional[Path], typer.Argument(help="TOML experiment file; flags override it.")] = None,
    workload: Annotated[Optional[str], typer.Option("--workload", "-w", help="Workload name (see `ddlscope workloads`).")] = None,
    strategy: Annotated[Optional[str], typer.Option("--strategy", "-s", help="Strategy name (see `ddlscope strategies`).")] = None,
    world_size: Annotated[Optional[int], typer.Option("--world-size", "-n", help="Total ranks over all nodes.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Global batch size (summed over ranks).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed for model init and data order.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Label for the run.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override any field: section.key=value (repeatable).")] = None,
    nnodes: Annotated[Optional[int], typer.Option(help="Nodes taking part (multi-node runs).")] = None,
    node_rank: Annotated[Optional[int], typer.Option(help="This node's rank; node 0 owns the store.")] = None,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="host:port of node 0's rendezvous.")] = None,
    procs_per_node: Annotated[Optional[int], typer.Option(help="Ranks per node (world size = nnodes x this).")] = None,
    db: DbOption = DEFAULT_DB,
    as_json: Annotated[bool, json_option("Print the summary as one JSON object.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    trace: Annotated[bool, typer.Option("--trace", help="Profile steps 1-3 on every rank (torch.profiler); "
                                        "merge with `ddlscope trace RUN`. --set trace_steps=N for N steps.")] = False,
    checkpoint_every: Annotated[Optional[int], typer.Option(help="Checkpoint every N steps (restarts and --resume "
                                                            "continue from the newest).")] = None,
    max_restarts: Annotated[Optional[int], typer.Option(help="Restart the ranks from the last checkpoint up to K "
                                                        "times when one dies.")] = None,
    resume: Annotated[Optional[str], typer.Option(metavar="RUN", help="Continue an interrupted or failed run from "
                                                  "its newest checkpoint (its stored experiment; no other input).",
                                                  callback=run_ref_callback)] = None,
    log: LogOption = None,
    log_dir: LogDirOption = None,
) -> None:
    """Run one experiment: start the ranks, train, record every rank and step, print a summary."""
    from ddlscope.runtime.config import load_experiment, parse_override

    if resume is not None:
        given = [flag for flag, value in (("CONFIG", config), ("--workload", workload), ("--strategy", strategy),
                                          ("--world-size", world_size), ("--steps", steps), ("--set", set_),
                                          ("--batch-size", batch_size), ("--seed", seed), ("--name", name),
                                          ("--checkpoint-every", checkpoint_every), ("--trace", trace or None),
                                          # the cluster's shape and restarts are the stored run's too
                                          ("--max-restarts", max_restarts), ("--nnodes", nnodes),
                                          ("--node-rank", node_rank), ("--rdzv-endpoint", rdzv_endpoint),
                                          ("--procs-per-node", procs_per_node))
                 if value is not None]
        if given:
            raise UserError(f"--resume continues the stored experiment as it was; drop {', '.join(given)}")
        sinks = _choose_sinks(log, log_dir, db)
        _run_and_report(*_resumable(resume, db), db, quiet, as_json, sinks)
        return
    overrides: dict[str, Any] = {}
    for key, value in (("workload.name", workload), ("strategy.name", strategy), ("workload.steps", steps),
                       ("workload.batch_size", batch_size), ("seed", seed), ("name", name),
                       ("cluster.nnodes", nnodes), ("cluster.node_rank", node_rank),
                       ("checkpoint_every", checkpoint_every), ("cluster.max_restarts", max_restarts),
                       ("cluster.rdzv_endpoint", rdzv_endpoint), ("cluster.world_size", world_size)):
        if value is not None:
            overrides[key] = value
    if procs_per_node is not None:
        if procs_per_node < 1:
            raise UserError(f"--procs-per-node = {procs_per_node}: must be >= 1")
        total = procs_per_node * (nnodes or 1)
        if world_size is not None and world_size != total:
            raise UserError(f"--world-size = {world_size} disagrees with --nnodes x --procs-per-node = {total}")
        overrides["cluster.world_size"] = total
    if trace:
        overrides["trace_steps"] = 3  # an explicit --set trace_steps=N below wins
    for item in set_ or []:
        key, value = parse_override(item)
        overrides[key] = value
    exp = load_experiment(config, overrides)
    if db.parent and not db.resolve().parent.exists():
        raise UserError(f"--db {db}: folder {db.resolve().parent} does not exist")
    check_run_outputs(exp)  # a missing folder fails now, not after the last step
    check_local_ranks(exp)
    _run_and_report(exp, None, db, quiet, as_json, _choose_sinks(log, log_dir, db))


# ---------------------------------------------------------------------------- launch
def launch(
    script: Annotated[Path, typer.Argument(help="Your training script (it calls ddlscope.attach).")],
    script_args: Annotated[Optional[list[str]], typer.Argument(
        metavar="-- ARGS", help="The script's own arguments, after `--`.")] = None,
    nproc: Annotated[int, typer.Option("--nproc", min=1, help="Processes (ranks) on this machine.")] = 1,
    name: Annotated[Optional[str], typer.Option(help="The run's name (default: the script's).")] = None,
    hang_timeout: Annotated[float, typer.Option(
        "--hang-timeout", min=1.0, max=7 * 24 * 3600.0,
        help="Seconds past the slowest step before the watchdog ends a stuck run (at most a week).")] = 300.0,
    max_restarts: Annotated[int, typer.Option(min=0, help="Restart every rank up to K times when one dies "
                                              "(the script resumes from its own checkpoints).")] = 0,
    db: DbOption = DEFAULT_DB,
    as_json: Annotated[bool, json_option("Print the summary as one JSON object (the script's own output goes "
                                         "to standard error).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    trace: Annotated[bool, typer.Option("--trace", help="Profile steps 1-3 of every attached rank (torch.profiler); "
                                        "merge with `ddlscope trace RUN`.")] = False,
    log: LogOption = None,
    log_dir: LogDirOption = None,
) -> None:
    """Run your own training script as torchrun would, with ddlscope's watchdog and store.

    Each rank runs SCRIPT as __main__ with RANK, WORLD_SIZE and MASTER_ADDR/PORT set; a script that calls
    `ddlscope.attach(model, optimizer)` and marks its steps is measured per rank and step, and stored like
    a `ddlscope run` (docs/attach.md). Example: ddlscope launch --nproc 2 train.py -- --epochs 1
    """
    from ddlscope.runtime.script import check_script, launch_script
    from ddlscope.specs import run_name_problem

    check_script(script)
    if name is not None and (run_name_problem(name) or has_control_characters(name)):
        raise UserError(f"--name: {run_name_problem(name) or 'holds a line break or control character; remove it'}")
    if db.parent and not db.resolve().parent.exists():
        raise UserError(f"--db {db}: folder {db.resolve().parent} does not exist")
    sinks = _choose_sinks(log, log_dir, db)
    show_progress = not quiet and not as_json and console.is_terminal
    with _progress(None, enabled=show_progress) as on_progress:
        result = launch_script(script, script_args or [], nproc, db, name=name, hang_timeout_s=hang_timeout,
                               max_restarts=max_restarts, on_progress=on_progress, output_to_stderr=as_json,
                               sinks=sinks, trace_steps=3 if trace else 0)
    _report_stored(db, result.run_id, as_json, result.logs, result.log_errors)
    if result.status != "finished":
        err_console.print(f"run {result.run_id} {result.status}: {result.error}", markup=False, highlight=False,
                          soft_wrap=True)
        raise typer.Exit(130 if result.status == "interrupted" else 1)


def _report_stored(db: Path, run_id: int, as_json: bool, logs: dict[str, str] | None = None,
                   log_errors: list[str] | None = None) -> None:
    """The stored run's summary; with --log, where each sink wrote (and any sink that failed)."""
    from ddlscope.analysis.summary import summarize

    with Store(db) as store:
        summary = summarize(store, store.get_run(run_id))
    if as_json:
        extra = {"logs": logs, **({"log_errors": log_errors} if log_errors else {})} if logs or log_errors else {}
        print(json.dumps({**summary.to_dict(), **extra}, default=str))
        return
    _print_summary(summary)
    for sink, where in (logs or {}).items():
        console.print(f"logged to {sink}: {where}", markup=False, highlight=False, soft_wrap=True)
    for note in log_errors or []:
        err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)


def _choose_sinks(log: Optional[str], log_dir: Optional[Path], db: Path) -> Any:
    """--log and --log-dir, checked before anything starts (runtime/sinks.py; ConfigError in one line)."""
    from ddlscope.runtime.sinks import choose_sinks

    return choose_sinks(log, log_dir, db)


def _resumable(ref: str, db: Path) -> tuple[Any, Run]:
    """The stored run to resume and its experiment; refused in one line when it cannot be resumed."""
    from ddlscope.runtime.config import experiment_from_dict
    from ddlscope.runtime.rows import run_dir_for

    with open_store(db) as store:
        run_ = store.get_run(ref)
        if run_.shown_status not in ("interrupted", "failed", "died"):
            raise UserError(f"run {run_.id} is {run_.shown_status}: only an interrupted or failed run can be resumed")
        if not run_dir_for(db, run_.uuid).is_dir():
            raise UserError(f"run {run_.id}: its folder {run_dir_for(db, run_.uuid)} is gone, nothing to resume from")
        exp = experiment_from_dict(run_.config)
        _refuse_an_unsigned_checkpoint(exp, run_, db, store.checkpoint_secret())
    return exp, run_


def _refuse_an_unsigned_checkpoint(exp: Any, run_: Run, db: Path, secret: bytes) -> None:
    """The newest checkpoint's manifest against the store's key, before any process starts (its files
    are hashed by the launcher, under the run's lock, before a rank loads them)."""
    from ddlscope.runtime.checkpoint import checkpoint_root, latest_checkpoint, run_key
    from ddlscope.runtime.rows import run_dir_for

    latest_checkpoint(checkpoint_root(exp, run_dir_for(db, run_.uuid)), exp, key=run_key(secret, run_.uuid),
                      verify_files=False)


def _run_and_report(exp: Any, resume: Run | None, db: Path, quiet: bool, as_json: bool, sinks: Any = None) -> None:
    from ddlscope.runtime.rank_server import start_rank_server

    start_rank_server(exp.cluster.threads_per_rank)  # importing while this process imports the launcher
    from ddlscope.runtime.launcher import launch

    show_progress = not quiet and not as_json and console.is_terminal
    with _progress(exp.workload.steps, enabled=show_progress) as on_progress:
        result = launch(exp, db, on_progress=on_progress, resume=resume, sinks=sinks)

    if result.run_id is None:
        console.print(f"node {exp.cluster.node_rank}: {result.status}; this node's ranks sent their rows to node 0's store",
                      markup=False, highlight=False)
        raise typer.Exit(0 if result.status == "finished" else 1)
    _report_stored(db, result.run_id, as_json, result.logs, result.log_errors)
    if result.status != "finished":
        err_console.print(f"run {result.run_id} {result.status}: {result.error}  (worker logs: {result.run_dir / 'logs'})",
                          markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130 if result.status == "interrupted" else 1)


class _progress:
    """A rich progress bar fed by the launcher's row follower; nothing when disabled."""

    def __init__(self, total_steps: int | None, enabled: bool):
        self.total, self.enabled = total_steps, enabled
        self.bar: Progress | None = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        # The phase is named from the first line on (starting ranks, training, ...), so that no stretch of
        # a run passes silently: rank start-up, the final evaluation and the ingest take seconds.
        self.bar = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"), TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[metric]}"), TimeElapsedColumn(), console=console, transient=True)
        self.bar.start()
        task = self.bar.add_task("starting ranks", total=self.total, rate="", loss="-", metric="")

        def update(row: dict[str, Any]) -> None:
            assert self.bar is not None
            phase = progress_phase(row, self.total)
            if row["kind"] == "eval":
                self.bar.update(task, metric=f"{row['metric_name']} {row['metric']:.4g}")
            elif row["kind"] == "step":
                rate = f"{row['samples'] / row['step_s']:.0f} samples/s/rank" if row["step_s"] > 0 else ""
                self.bar.update(task, completed=row["step"] + 1, loss=f"{row['loss']:.4f}", rate=rate)
            if phase is not None:
                self.bar.update(task, description=phase)

        return update

    def __exit__(self, *exc: object) -> None:
        if self.bar:
            self.bar.stop()


# ---------------------------------------------------------------------------- runs / show
def runs(db: DbOption = DEFAULT_DB,
         limit: Annotated[int, typer.Option(min=1, max=MAX_RUN_ID, help="Show the newest N runs.")] = 50) -> None:
    """List the runs in the store, newest first."""
    with open_store(db) as store:
        # Names wrap rather than truncate (they are what one types back as RUN), so that 80 columns hold
        # a row: workload, strategy and ranks share one column.
        table = Table("id", Column("name", overflow="fold", ratio=1), Column("what", overflow="fold", ratio=1),
                      "status", "steps", Column("created", no_wrap=True), "duration", box=None, pad_edge=False)
        for r in store.list_runs(limit):
            steps = store.count_steps(r.id) // max(r.world_size, 1)
            duration = f"{r.finished_at - r.started_at:.1f}s" if r.finished_at and r.started_at else ""
            # escape(): a name like "[/]" is the user's text, not rich markup
            table.add_row(str(r.id), escape(r.name), escape(f"{r.workload} {r.strategy} x{r.world_size}"),
                          escape(r.shown_status),
                          str(steps), _when(r.created_at), duration)
        console.print(table)


def show(run_ref: RunArg,
         db: DbOption = DEFAULT_DB,
         as_json: Annotated[bool, json_option("The summary as one JSON object.")] = False) -> None:
    """Summary of one run: throughput, speedup vs single, breakdown, memory, final metric."""
    from ddlscope.analysis.summary import summarize

    with open_store(db) as store:
        summary = summarize(store, store.get_run(run_ref))
    if as_json:
        print(json.dumps(summary.to_dict(), default=str))
    else:
        _print_summary(summary)


# ---------------------------------------------------------------------------- export
def export(run_ref: RunArg,
           fmt: Annotated[str, typer.Option("--format", "-f", help="csv or parquet (one table), or json (everything).")] = "csv",
           table: Annotated[str, typer.Option(help="For csv and parquet: steps, evals, memory or events.")] = "steps",
           output: Annotated[Optional[Path], typer.Option("--output", "-o", help="File to write (default: stdout).")] = None,
           db: DbOption = DEFAULT_DB) -> None:
    """Export a run's rows as CSV, JSON or Parquet."""
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"--format = {fmt!r}: allowed: {', '.join(EXPORT_FORMATS)}")
    if table not in EXPORT_TABLES:
        raise UserError(f"--table = {table!r}: allowed: {', '.join(EXPORT_TABLES)}")
    if fmt == "parquet" and output is None and sys.stdout.isatty():
        raise UserError("--format parquet is binary: give --output FILE, or redirect stdout to a file")
    if output is not None:
        check_output_folder(output, "--output")
    with open_store(db) as store:
        run_ = store.get_run(run_ref)
        with _opened(output, binary=fmt == "parquet") as out:
            if fmt == "parquet":
                _write_parquet(store, run_.id, table, out)
            elif fmt == "json":
                _write_json(store, run_, out)
            else:
                _write_csv(store, run_.id, table, out)
    if output:
        err_console.print(f"wrote {output}", markup=False, highlight=False)


# Rows are streamed from the store in its key order (rank, then step), a batch at a time: a run of
# millions of rows exports in bounded memory.
@contextmanager
def _opened(output: Optional[Path], binary: bool) -> Iterator[Any]:
    """The file to write (or stdout). A file is written whole or not at all (store.atomic_output): a full
    disk leaves no truncated export, and a write that fails is one line naming --output."""
    if output is None:
        sys.stdout.flush()  # text printed before must not land after the bytes
        yield sys.stdout.buffer if binary else sys.stdout
        (sys.stdout.buffer if binary else sys.stdout).flush()
        return
    with atomic_output(output, binary=binary, what="--output") as f:
        yield f


def _write_csv(store: Store, run_id: int, table: str, out: Any) -> None:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(store.column_names(table))
    for rows in store.iter_rows(table, run_id):
        writer.writerows(rows)


def _write_parquet(store: Store, run_id: int, table: str, out: Any) -> None:
    """One Parquet file: the csv export's columns, in its order, with the store's types."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("--format parquet needs pyarrow: pip install pyarrow") from None
    arrow_types = {"INTEGER": pa.int64(), "REAL": pa.float64(), "TEXT": pa.string()}
    schema = pa.schema([(name, arrow_types.get(kind, pa.string())) for name, kind in store.column_types(table)])
    with pq.ParquetWriter(out, schema) as writer:
        for rows in store.iter_rows(table, run_id):
            columns = list(zip(*rows))
            writer.write_batch(pa.record_batch([pa.array(c, type=f.type) for c, f in zip(columns, schema)],
                                               schema=schema))


def _write_json(store: Store, run_: Run, out: Any) -> None:
    """Everything about the run: {"run": ..., "steps": [...], "evals": [...], "memory": [...], "events": [...]}."""
    from dataclasses import asdict

    out.write('{"run": ' + json.dumps(asdict(run_), default=str, indent=1))
    for table in EXPORT_TABLES:
        out.write(f',\n"{table}": [')
        first = True
        names = store.column_names(table)
        for rows in store.iter_rows(table, run_.id):
            for row in rows:
                out.write(("\n" if first else ",\n") + json.dumps(dict(zip(names, row)), default=str))
                first = False
        out.write("\n]")
    out.write("}\n")


# ---------------------------------------------------------------------------- trace
def trace(run_ref: RunArg,
          output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Merged trace (default: trace-RUNID.json).")] = None,
          db: DbOption = DEFAULT_DB) -> None:
    """Merge a traced run's per-rank profiler traces into one chrome-trace / Perfetto JSON (one track per rank)."""
    from ddlscope.analysis.trace_merge import RankTrace, TraceMergeError, merge_traces

    if output is not None:
        check_output_folder(output, "--output")
    with open_store(db) as store:
        run_ = store.get_run(run_ref)
        traces = {e["rank"]: Path(e["message"].partition("path=")[2]) for e in store.events(run_.id)
                  if e["kind"] == "trace" and "path=" in e["message"]}
    if not traces:
        raise StoreError(f"run {run_.id} has no traces (run it with --trace or --set trace_steps=N; an attached job: "
                         "launch --trace, or ddlscope.attach(..., trace_steps=N))")
    present = [RankTrace(rank, path) for rank, path in sorted(traces.items()) if path.is_file()]
    missing = sorted(set(traces) - {t.rank for t in present})
    if not present:
        raise StoreError(f"run {run_.id}: trace files are gone (first: {traces[min(traces)]})")
    target = output or Path(f"trace-{run_.id}.json")
    try:
        result = merge_traces(present, target)
    except TraceMergeError as exc:
        raise StoreError(f"run {run_.id}: {exc}") from None
    offsets = ", ".join(f"rank {r} +{v / 1e3:.1f} ms" for r, v in sorted(result.offsets_us.items()))
    console.print(f"wrote {target}: {result.events} events from ranks {', '.join(map(str, result.ranks))} "
                  f"(clock offsets: {offsets}); open it in https://ui.perfetto.dev or chrome://tracing",
                  markup=False, highlight=False, soft_wrap=True)
    if missing:
        err_console.print(f"note: no trace file here for ranks {', '.join(map(str, missing))} "
                          "(ranks on other nodes keep theirs on their node)", markup=False, highlight=False)


# ---------------------------------------------------------------------------- scaling
def scaling(
    runs_: Annotated[Optional[list[str]], typer.Argument(metavar="[RUN]...", help="Runs to compare (default: see --workload).",
                                                               callback=run_ref_callback)] = None,
    workload: Annotated[Optional[str], typer.Option("--workload", "-w", help="With --strategy: the newest finished run per world size.")] = None,
    strategy: Annotated[Optional[str], typer.Option("--strategy", "-s", help="Strategy of those runs.")] = None,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Scaling table: throughput, speedup, efficiency and each phase's growth over world sizes."""
    from ddlscope.analysis.scaling import latest_per_world_size, scaling_table
    from ddlscope.analysis.summary import PHASES

    with open_store(db) as store:
        if runs_:
            chosen = [store.get_run(ref) for ref in runs_]
        elif workload and strategy:
            chosen = latest_per_world_size(store, workload, strategy)
        else:
            raise UserError("give RUN ids, or --workload and --strategy")
        if not chosen:
            raise UserError(f"no finished {strategy} runs of {workload} in {db}")
        rows = scaling_table(store, chosen)
    # Each phase's mean ms per step, its growth over the first row's beneath: 80 columns hold it.
    short = {"data_s": "data", "forward_s": "fwd", "backward_s": "bwd", "comm_wait_s": "comm", "optimizer_s": "opt"}
    table = Table("ranks", "run", "samples/s", "speedup", "eff.", *(f"{short.get(p, p)} ms" for p in PHASES),
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  title="scaling (phase ms per step; beneath, x the first row's)")
    for r in rows:
        table.add_row(str(r.world_size), str(r.run_id), f"{r.throughput_samples_per_s or 0:.4g}",
                      f"{r.speedup_vs_single:.2f}x" if r.speedup_vs_single else "-",
                      f"{r.scaling_efficiency:.0%}" if r.scaling_efficiency else "-",
                      *(_ms_short(r.breakdown_mean_s.get(p, 0) * 1e3)
                        + (f"\nx{r.breakdown_growth[p]:.2f}" if r.breakdown_growth[p] is not None else "")
                        for p in PHASES))
    console.print(table)


def _ms_short(ms: float) -> str:
    """Three significant digits without an exponent (1280, 168, 7.46, 0.203)."""
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


# ---------------------------------------------------------------------------- summary output
def _when(ts: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts).strftime("%m-%d %H:%M")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


# Past this many ranks, `show` summarises per-rank lists (the JSON keeps every rank).
SHOWN_RANKS = 16


def _stragglers(steps_by_rank: dict[int, int]) -> str:
    """How often each rank was the one the others waited for (the most time outside communication in
    a step), most often first; past SHOWN_RANKS, the first few and a count."""
    total = sum(steps_by_rank.values())
    ranked = sorted(steps_by_rank.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ", ".join(f"rank {r} in {n} of {total} steps" for r, n in ranked[:SHOWN_RANKS if len(ranked) <= SHOWN_RANKS
                                                                               else 5])
    rest = f", other ranks in {sum(n for _, n in ranked[5:])}" if len(ranked) > SHOWN_RANKS else ""
    return f"{shown}{rest}"


def _memory_table(memory: dict[int, dict[str, int]], categories: list[str]) -> Table:
    """A row per rank; past SHOWN_RANKS ranks, the smallest, median and largest rank of each category."""
    if len(memory) <= SHOWN_RANKS:
        table = Table("rank", *categories, title="memory by category")
        for rank, cats in sorted(memory.items()):
            table.add_row(str(rank), *(_fmt_bytes(cats[c]) if c in cats else "-" for c in categories))
        return table
    table = Table("over ranks", *categories, title=f"memory by category ({len(memory)} ranks)")
    values = {c: sorted(m[c] for m in memory.values() if c in m) for c in categories}
    for label, pick in (("min", lambda v: v[0]), ("median", lambda v: v[len(v) // 2]), ("max", lambda v: v[-1])):
        table.add_row(label, *(_fmt_bytes(pick(values[c])) if values[c] else "-" for c in categories))
    return table


def _print_summary(s: Any) -> None:
    r = s.run
    e = {k: escape(str(r[k])) for k in ("name", "workload", "strategy", "status", "code_version")}
    console.print(f"[bold]run {r['id']}[/bold] {e['name']}  {e['workload']} / {e['strategy']} x {r['world_size']} ranks"
                  f"  status [bold]{e['status']}[/bold]  ({e['code_version']}, seed {r['seed']})")
    if r["error"]:
        console.print(f"  error: {r['error']}", markup=False, highlight=False)
    head = Table(show_header=False, box=None, pad_edge=False)
    head.add_row("steps recorded", f"{s.steps_recorded} x {s.ranks_recorded} ranks "
                 f"(first {s.warmup_steps_excluded} excluded from timing)")
    if s.mean_step_s:
        head.add_row("step time", f"{s.mean_step_s * 1e3:.2f} ms (slowest rank, mean)"
                     + (f"; {s.cpu_derived_step_s * 1e3:.2f} ms with compute from thread CPU time"
                        if s.oversubscribed and s.cpu_derived_step_s else ""))
        head.add_row("throughput", f"{s.throughput_samples_per_s:.1f} samples/s")
    if getattr(s, "mfu", None) is not None:
        head.add_row("MFU", f"{s.mfu:.2%} of this rank's measured peak ({s.achieved_flops_per_s / 1e9:.3g} GFLOP/s "
                     f"of model FLOPs per rank; HFU {s.hfu:.2%}, no recompute)")
    if s.speedup_vs_single is not None:
        head.add_row("speedup vs single", f"{s.speedup_vs_single:.2f}x (run {s.baseline_run_id}); "
                     f"scaling efficiency {s.scaling_efficiency:.0%}")
    elif not is_baseline(r["strategy"]):
        head.add_row("speedup vs single", "no matching finished `single` run in the store")
    if s.comm:
        head.add_row("communication", f"{_fmt_bytes(s.comm['bytes_sent_per_step'])}/step/rank, "
                     f"{s.comm['comm_s'] * 1e3:.2f} ms in flight, {s.comm['exposed_s'] * 1e3:.2f} ms exposed, "
                     f"overlap {s.comm['overlap_fraction']:.0%}")
    if len(s.straggler_steps) > 0 and sum(s.straggler_steps.values()) > 0:
        head.add_row("waited for", _stragglers(s.straggler_steps))
    if s.staleness:
        head.add_row("staleness", f"mean {s.staleness['mean']:.2f}, max {s.staleness['max']:.0f} "
                     f"over {s.staleness['updates']:.0f} server updates")
    if s.server_busy_fraction is not None:
        head.add_row("server busy", f"{s.server_busy_fraction:.1%} of its wall time applying updates")
    for metric in getattr(s, "strategy_metrics", []):  # what the strategy reported, as it worded it
        head.add_row(escape(str(metric["name"])), escape(f"{metric['value']:.4g}  {metric.get('detail', '')}"))
    if s.final_eval:
        e = s.final_eval
        head.add_row("final eval", f"{escape(str(e['metric_name']))} {e['metric']:.4f}, loss {e['loss']:.4f} "
                     f"after {e['samples_seen']} samples, {e['wall_s']:.1f}s of training")
    console.print(head)
    if s.breakdown_mean_s:
        bt = Table("phase (mean per rank-step)", "ms", "share", title="time breakdown")
        for phase, secs in s.breakdown_mean_s.items():
            bt.add_row(phase.removesuffix("_s"), f"{secs * 1e3:.3f}", f"{s.breakdown_fraction.get(phase, 0):.1%}")
        console.print(bt)
    if s.memory_bytes_by_rank:
        categories = sorted({c for m in s.memory_bytes_by_rank.values() for c in m},
                            key=lambda c: ("parameters", "gradients", "optimizer", "activations").index(c)
                            if c in ("parameters", "gradients", "optimizer", "activations") else 9)
        console.print(_memory_table(s.memory_bytes_by_rank, categories))
    for note in s.notes:
        console.print(f"[yellow]note:[/yellow] {escape(str(note))}")
