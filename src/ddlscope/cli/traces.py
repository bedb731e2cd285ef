"""`ddlscope import-trace DIR`: a job ddlscope never launched, from its torch.profiler traces (one file per
rank), into the store as a run whose step rows carry compute, communication, memory copies and idle
time (docs/import-trace.md)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

import ddlscope
from ddlscope.cli.common import DEFAULT_DB, DbOption, UserError, console, has_control_characters, json_option
from ddlscope.store import Store

__all__ = ["import_trace"]

IMPORTED = "imported"  # the strategy a run made from traces is stored as: the traces do not say which it was


def import_trace(
    folder: Annotated[Path, typer.Argument(metavar="DIR", help="Folder of torch.profiler traces (*.json, *.json.gz), "
                                                               "one file per rank.")],
    name: Annotated[Optional[str], typer.Option(help="The run's name (default: the folder's name).")] = None,
    samples: Annotated[Optional[int], typer.Option(min=1, help="Samples each rank took per step (the traces do "
                                                               "not say): gives the run a throughput.")] = None,
    db: DbOption = DEFAULT_DB,
    as_json: Annotated[bool, json_option("Print the new run's id and each rank's totals as one JSON object.")] = False,
) -> None:
    """Store a job's torch.profiler traces as a run: compute, communication, memory copies, idle and
    overlap per rank and step; then `show`, `report` and `export` read it like any run."""
    from ddlscope.analysis.kineto import TraceImportError, describe, load_rank_traces

    run_name = folder.resolve().name if name is None else name
    if has_control_characters(run_name):
        raise UserError(f"--name {run_name!r}: holds a line break or control character; remove it")
    if db.is_dir():
        raise UserError(f"--db {db} is a directory, not a store file: pass --db FILE (a new or existing store)")
    if not db.resolve().parent.is_dir():
        raise UserError(f"--db {db}: folder {db.resolve().parent} does not exist")
    try:
        traces = load_rank_traces(folder)
    except TraceImportError as exc:
        raise UserError(str(exc)) from None
    world = traces[0].world_size
    device = "cuda" if any(t.device == "cuda" for t in traces) else "cpu"
    backend = next((t.backend for t in traces if t.backend), "")
    config: dict[str, Any] = {
        "name": run_name, "seed": 0,
        "workload": {"name": "trace", "dir": str(folder.resolve()),
                     "files": {str(t.rank): t.path.name for t in traces}},
        "strategy": {"name": IMPORTED},
        "cluster": {"world_size": world, "backend": backend, "device": device},
    }
    environment = {"imported": True, "trace_dir": str(folder.resolve()), "device": device,
                   "hosts": sorted({t.host for t in traces if t.host})}
    records: list[dict[str, Any]] = []
    for t in traces:
        t0 = t.steps[0].start_s
        records.append({"kind": "event", "rank": t.rank, "seq": 0, "t": 0.0, "event": "trace_import",
                        "message": describe(t)})
        for i, step in enumerate(t.steps):
            records.append({**step.record(t.rank, t0), "samples": samples})
            records.append({"kind": "event", "rank": t.rank, "seq": 1 + i, "t": step.start_s - t0,
                            "event": "trace_step", "message": json.dumps(step.to_dict(), sort_keys=True)})
    records.extend(_metrics(traces))
    with Store(db) as store:
        run_id = store.create_run(uuid=uuid.uuid4().hex, name=run_name, workload=f"trace:{folder.resolve().name}",
                                  strategy=IMPORTED, world_size=world, config=config,
                                  code_version=ddlscope.__version__, seed=0, environment=environment)
        try:
            store.mark_running(run_id)
            store.ingest(run_id, records)
        except BaseException:
            store.mark_done(run_id, "failed", "the import stopped before all rows were stored")
            raise
        store.mark_done(run_id, "finished")
    if as_json:
        print(json.dumps({"run_id": run_id, "world_size": world, "device": device,
                          "ranks": {str(t.rank): {"file": t.path.name, "steps": len(t.steps), **t.totals()}
                                    for t in traces}}))
        return
    console.print(f"run {run_id}: {world} rank(s), {device} traces from {folder} "
                  f"({sum(len(t.steps) for t in traces)} rank-steps); `ddlscope show {run_id}` for its breakdown",
                  markup=False, highlight=False, soft_wrap=True)


# Per-rank shares go to `show` up to this many ranks; past it only the run's means (every rank's are in
# the `trace_import` events and in `show --json`'s breakdown by rank).
RANKS_SHOWN = 8


def _metrics(traces: list[Any]) -> list[dict[str, Any]]:
    """Shares over the steps as `strategy_metric` events, which `show` prints as they are: the mean over
    ranks, then each rank's (up to RANKS_SHOWN ranks)."""
    where = "device" if any(t.device == "cuda" for t in traces) else "host"
    kinds = (("compute share", "compute_share", f"of the {where}'s step time something computed"),
             ("idle share", "idle_share", f"of the {where}'s step time nothing ran"),
             ("comm-compute overlap", "overlap_fraction", "of the communication time overlapped by compute"))
    totals = {t.rank: t.totals() for t in traces}
    out = []
    for i, (name, key, detail) in enumerate(kinds):
        mean = sum(tot[key] for tot in totals.values()) / len(totals)
        out.append({"name": f"trace {name}", "value": mean, "detail": f"{detail} (mean over ranks)"})
        if len(traces) <= RANKS_SHOWN:
            out.extend({"name": f"trace {name}, rank {rank}", "value": tot[key], "detail": detail, "rank": rank}
                       for rank, tot in totals.items())
    return [{"kind": "event", "rank": m.get("rank", -1), "seq": 1_000_000 + i, "t": 0.0, "event": "strategy_metric",
             "message": json.dumps(m)} for i, m in enumerate(out)]
