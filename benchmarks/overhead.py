"""How much slower is a DDP training loop when ddlscope instruments it?

One invocation runs the same data-parallel training job three ways, several times,
interleaved (bare, ddlscope, attached, bare, ...) so that machine noise lands on
all evenly:

(a) bare: `bare_worker` below, plain torch and nothing of ddlscope in the loop.
    Started with torch's `elastic_launch` (c10d rendezvous on 127.0.0.1 and a
    free port, one process per rank, start method spawn), gloo, CPU,
    `DistributedDataParallel` with default settings (bucket_cap_mb 25, no comm
    hook), SGD with the spec's lr / momentum / weight decay, and
    `loss.item()` every step as ddlscope does. Model, data and loss come from
    the same workload builder with the same seed; each rank's batch is
    `GlobalBatchSampler.rank_batch(step, rank, per_rank)` exactly as in
    runtime/loop.py, so both runs train on identical batches.
(b) ddlscope: `ddlscope.runtime.launcher.launch()` with the same experiment
    (evaluation only after the last step), i.e. the instrumented loop with
    its timers, timing comm hook, per-step JSON rows and the rest.
(c) attached: the bare loop of (a) with ddlscope attached to it as a user
    would (`ddlscope.attach(model, optimizer)`, each step in `meter.step()`,
    its loss given; docs/attach.md): hooks, timing comm hook, per-step rows,
    the FLOP count of step 0 and the memory of step 1, timed exactly as (a).

Both use OMP_NUM_THREADS=1 and one intra-op thread per rank, and both send the
workers' stdout/stderr to log files.

What is compared (per-step wall time, steady state): the first `--warmup`
steps (default 2) pay one-off costs in both runs - lazy initialisation, DDP's
bucket rebuild after its first iteration and, in ddlscope, the single
memory-measurement step (step 1). They are excluded from both sides:

  bare      one wall-clock interval per rank, from just before step W's batch
            is fetched to just after the last step's `loss.item()`.
  ddlscope  the same interval from its own records: train_s (the train_end
            event: the loop's wall time without evaluation) minus the step row
            t_s of step W (the time from the loop's start to step W's start),
            per rank. Everything ddlscope does per step in between - clocks,
            comm hook, comm accounting, row writing - is inside it.

Each side's interval is divided by the number of timed steps (steps - W) and
the slower rank counts (ranks run in lockstep through the all-reduce, so they
differ by microseconds). The reported overhead is the median over repeats of
ddlscope / bare of each interleaved pair (quiet pairs only, see below). For
reference each line also shows the whole loop including warm-up (bare: from
before step 0; ddlscope: train_s).
Process start-up, rendezvous and ddlscope's ingestion into SQLite are outside
both intervals: they are once-per-run costs, not per-step overhead.

The ranks need every core of a small machine, so anything else running skews a
run badly (a concurrent test suite made steps ~1.8x slower here). On Linux each
run therefore also reports "other": CPU time the rest of the machine used
during the run (system-wide busy time from /proc/stat minus this process and
its workers), in cores. Pairs with other > 0.1 core in either run are flagged
and left out of the median; if no pair was quiet, all count and a warning
says the ratio is unreliable. Even on a quiet 2-core machine single pairs
scatter by several percent, so use more --repeats to resolve a few percent.

Run:  PYTHONPATH=src python benchmarks/overhead.py [--workload cnn-digits] [--set workload.hidden=256]
"""

from __future__ import annotations

import argparse
import logging
from contextlib import nullcontext
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# spawn pickles `bare_worker` by module and name; when this file runs as a
# script that would be `__main__`, so the launcher is handed the function from
# the importable module `overhead` (this folder on sys.path) instead.
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_KNOBS: dict[str, dict[str, Any]] = {
    # A step big enough that the per-step overhead is not all there is, small enough for 2 cores.
    "gpt-synthetic": {"workload.layers": 2, "workload.hidden": 128, "workload.heads": 4,
                      "workload.seq_len": 64, "workload.batch_size": 16},
    "cnn-digits": {"workload.batch_size": 64},
    "mlp-digits": {"workload.batch_size": 64},
}
TARGET_RATIO = 1.03
BUSY_CORES = 0.1  # CPU used by other processes during a run above which the run is flagged


class ForeignCpu:
    """Cores' worth of CPU that processes other than this one and its children used meanwhile (Linux)."""

    def __enter__(self) -> "ForeignCpu":
        self.cores: float | None = None
        self._start = (_busy_machine_s(), _own_cpu_s(), time.monotonic())
        return self

    def __exit__(self, *exc: object) -> None:
        busy0, own0, t0 = self._start
        busy1 = _busy_machine_s()
        if busy0 is not None and busy1 is not None:
            other_s = (busy1 - busy0) - (_own_cpu_s() - own0)
            self.cores = max(0.0, other_s) / max(time.monotonic() - t0, 1e-9)

    def __str__(self) -> str:
        return "n/a" if self.cores is None else f"{self.cores:.2f}"


def _busy_machine_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # up to steal; guest time is inside user


def _own_cpu_s() -> float:
    t = os.times()  # children: the workers, once the launcher has reaped them
    return t.user + t.system + t.children_user + t.children_system


def bare_worker(experiment_json: str, warmup: int, attach_db: str = "") -> dict[str, float]:
    """One rank of the plain-torch DDP loop (with ddlscope attached when `attach_db` names a store).
    Returns its timings in seconds."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddlscope.runtime.config import experiment_from_json
    from ddlscope.runtime.data import GlobalBatchSampler
    from ddlscope.workloads import WORKLOADS

    exp = experiment_from_json(experiment_json)
    spec = exp.workload
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(exp.cluster.threads_per_rank)
    dist.init_process_group("gloo")
    try:
        task = WORKLOADS.get(spec.name).build(spec, exp.seed)
        model = DistributedDataParallel(task.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum,
                                    weight_decay=spec.weight_decay)
        sampler = GlobalBatchSampler(len(task.train), spec.batch_size, exp.seed)
        per_rank = spec.batch_size // world
        loss_fn, data = task.loss_fn, task.train

        meter = None
        if attach_db:
            import ddlscope

            meter = ddlscope.attach(model, optimizer, run="overhead-attached", db=attach_db)
        start = timed_start = time.perf_counter()
        for step in range(spec.steps):
            if step == warmup:
                timed_start = time.perf_counter()
            with meter.step(samples=per_rank) if meter else nullcontext() as marked:
                x, y = data.get(sampler.rank_batch(step, rank, per_rank))
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if marked is not None:
                    marked.loss = loss
            loss.item()
        end = time.perf_counter()
        if meter is not None:
            meter.close()  # stores the rows (rank 0): after the timed interval, like ddlscope's ingest
        return {"timed_s": end - timed_start, "loop_s": end - start}
    finally:
        dist.destroy_process_group()


def make_experiment(workload: str, world_size: int, steps: int, extra: dict[str, Any]) -> Any:
    from ddlscope.runtime.config import load_experiment

    overrides = {
        "name": "overhead-benchmark",
        "workload.name": workload,
        "workload.steps": steps,
        "workload.optimizer": "sgd",  # the bare loop uses SGD
        "workload.eval_every": 0,  # evaluate only after the last step
        "workload.eval_batches": 1,
        "strategy.name": "ddp",
        "cluster.world_size": world_size,
        "cluster.device": "cpu",
        "cluster.backend": "gloo",
        "cluster.threads_per_rank": 1,
        **DEFAULT_KNOBS.get(workload, {}),
        **extra,
    }
    return load_experiment(None, overrides)


def run_bare(exp: Any, warmup: int, log_dir: Path, attach_db: str = "") -> tuple[float, float]:
    """(slowest rank's timed interval, slowest rank's whole loop) of one bare (or attached) run."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ddlscope.runtime.launcher import free_port

    import overhead  # this file as a module, so that spawn can find bare_worker

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=exp.cluster.world_size,
        run_id="overhead-bare", rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 600}, max_restarts=0, monitor_interval=0.1, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
    )
    results = elastic_launch(config, overhead.bare_worker)(exp.model_dump_json(), warmup, attach_db)
    return max(r["timed_s"] for r in results.values()), max(r["loop_s"] for r in results.values())


def run_ddlscope(exp: Any, warmup: int, store_path: Path) -> tuple[float, float]:
    """(slowest rank's train_s minus t_s of step `warmup`, slowest rank's train_s) of one ddlscope run."""
    from ddlscope.runtime.launcher import launch
    from ddlscope.store import Store

    result = launch(exp, store_path)
    if result.status != "finished":
        raise SystemExit(f"ddlscope run {result.status}: {result.error}")
    with Store(store_path) as store:
        train_s = {e["rank"]: float(e["message"].removeprefix("train_s="))
                   for e in store.events(result.run_id) if e["kind"] == "train_end"}
        start_of_timed = {s["rank"]: s["t_s"] for s in store.steps(result.run_id) if s["step"] == warmup}
    if len(train_s) != exp.cluster.world_size:
        raise SystemExit(f"expected {exp.cluster.world_size} train_end events, got {len(train_s)}")
    return max(train_s[r] - start_of_timed[r] for r in train_s), max(train_s.values())


def main(argv: list[str] | None = None) -> int:
    from ddlscope.runtime.config import parse_override

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt-synthetic", help="registered workload (default: gpt-synthetic)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="training steps per run (default 150)")
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the timing (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="bare/ddlscope pairs, interleaved (default 3)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra experiment override, e.g. workload.hidden=256 (repeatable)")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and below --steps")

    os.environ["OMP_NUM_THREADS"] = "1"  # launch() sets it too; the bare run must match
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # as launch() does
    exp = make_experiment(args.workload, args.world_size, args.steps, dict(map(parse_override, args.overrides)))
    timed = args.steps - args.warmup
    knobs = {k: v for k, v in exp.workload.model_dump().items() if k not in ("name", "steps")}
    print(f"workload {exp.workload.name} {knobs}")
    print(f"ddp, world size {args.world_size}, gloo on CPU, {args.steps} steps of which the first "
          f"{args.warmup} are warm-up; per-step time over the other {timed}")

    ratios: list[float] = []
    attached_ratios: list[float] = []
    busy_flags: list[bool] = []
    with tempfile.TemporaryDirectory(prefix="ddlscope-overhead-") as tmp:
        store_path = Path(tmp) / "overhead.db"
        for repeat in range(1, args.repeats + 1):
            with ForeignCpu() as bare_other:
                bare_s, bare_loop_s = run_bare(exp, args.warmup, Path(tmp) / f"bare-logs-{repeat}")
            with ForeignCpu() as scope_other:
                scope_s, scope_loop_s = run_ddlscope(exp, args.warmup, store_path)
            with ForeignCpu() as attached_other:
                attached_s, attached_loop_s = run_bare(exp, args.warmup, Path(tmp) / f"attached-logs-{repeat}",
                                                       attach_db=str(Path(tmp) / "attached.db"))
            ratio = scope_s / bare_s
            ratios.append(ratio)
            attached_ratios.append(attached_s / bare_s)
            others = (bare_other, scope_other, attached_other)
            busy = any(o.cores is not None and o.cores > BUSY_CORES for o in others)
            busy_flags.append(busy)
            print(f"repeat {repeat}: bare {1e3 * bare_s / timed:7.3f} ms/step   "
                  f"ddlscope {1e3 * scope_s / timed:7.3f} ms/step   ratio {ratio:.3f}   "
                  f"attached {1e3 * attached_s / timed:7.3f} ms/step   ratio {attached_s / bare_s:.3f}   "
                  f"(whole loop: bare {bare_loop_s:.3f} s, ddlscope train_s {scope_loop_s:.3f} s, attached "
                  f"{attached_loop_s:.3f} s; other: {' / '.join(map(str, others))} cores)"
                  f"{'  BUSY MACHINE' if busy else ''}", flush=True)

    quiet = [i for i, busy in enumerate(busy_flags) if not busy]
    if not quiet:
        print(f"warning: other processes used more than {BUSY_CORES} core during every repeat; "
              "the ratios below are unreliable, rerun on a quiet machine")
        quiet, which = list(range(len(ratios))), f"{len(ratios)}"
    elif len(quiet) < len(ratios):
        print(f"note: {len(ratios) - len(quiet)} of {len(ratios)} repeats ran on a busy machine and are left out")
        which = f"{len(quiet)} quiet repeats of {len(ratios)}"
    else:
        which = f"{len(ratios)}"
    for label, values in (("ddlscope/bare", ratios), ("attached/bare", attached_ratios)):
        median = statistics.median(values[i] for i in quiet)
        print(f"overhead ratio ({label}, median of {which}): {median:.3f}  (target <= {TARGET_RATIO:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
