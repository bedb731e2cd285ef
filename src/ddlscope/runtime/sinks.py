"""Metrics to TensorBoard, MLflow and W&B as a run records them: `--log tensorboard,mlflow,wandb` on
`ddlscope run` and `ddlscope launch`, `ddlscope.attach(..., log="tensorboard,mlflow")`.

Sinks take the records as rank 0's row file holds them (runtime/rows.py): each `step` row gives the
step's breakdown (data, forward, backward, comm_wait, optimizer and step seconds), the throughput and,
once a `flops` event has been seen, MFU (model FLOPs per step / step seconds / peak FLOP/s, as the
summary computes it per rank); the `memory` record gives memory by category; `eval` rows the
evaluation's metric and loss; the `attached` event what an attached job is. Under `run` and `launch`
the launcher feeds them from the thread that follows rank 0's file (the ranks pay nothing); under
plain torchrun or python, rank 0's meter feeds them as it writes each record. `record` only queues:
the sinks' own thread wakes every FLUSH_S and writes what came in as one batch (one MLflow call, one
TensorBoard event per step), so a training process shares its interpreter with it briefly, once a
second, rather than after every step. A backend that fails is dropped with a one-line note, never
failing the run.

Everything stays on this machine, with no account: TensorBoard event files, an MLflow file store
(`file:` URI; MLflow 3 keeps it behind MLFLOW_ALLOW_FILE_STORE, set here), W&B offline mode (`wandb
sync` uploads it later if wanted; the run's own settings say offline, whatever WANDB_MODE says).
Telemetry and error reports of the libraries are turned off by their environment variables
(OFFLINE_ENVIRONMENT). Libraries are imported when a sink opens.

Under the log folder (default: ddlscope-logs beside the store) each sink keeps runs apart:

    tensorboard/<label>/          event files        tensorboard --logdir ddlscope-logs/tensorboard
    mlruns/                       MLflow file store  mlflow ui --backend-store-uri file:ddlscope-logs/mlruns
    wandb/offline-run-*/          W&B offline run    wandb sync ddlscope-logs/wandb/offline-run-*
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ddlscope.specs import ConfigError

# sink name -> (the module it imports, the pip package that installs it)
SINK_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "wandb": ("wandb", "wandb"),
}
LOG_ROOT = "ddlscope-logs"  # the default log folder's name, beside the store
PROJECT = "ddlscope"  # MLflow's experiment and W&B's project
PHASES = ("data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s", "step_s")
FLUSH_S = 1.0  # the sinks' thread writes what was recorded this often (and at close)
# No usage reports, and MLflow's file store allowed: set in this process (and so its ranks) when a sink
# opens. W&B's offline mode, silence and no git or code capture are the run's own settings (WandbSink),
# not WANDB_MODE and the like, so that a script's own W&B runs (under attach or launch) stay as it set them.
OFFLINE_ENVIRONMENT = {
    "WANDB_ERROR_REPORTING": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_ALLOW_FILE_STORE": "true",
}


class SinkError(ConfigError):
    """A sink that cannot be used: one line, before any process starts."""


@dataclass(frozen=True)
class SinkChoice:
    """What the user asked for: the sinks and the folder they write under (checked by `choose_sinks`)."""
    names: tuple[str, ...]
    log_dir: Path

    def open(self, run_name: str, config: dict[str, Any], *, batch_ranks: int = 1) -> "Sinks":
        return open_sinks(list(self.names), self.log_dir, run_name, config, batch_ranks=batch_ranks)


def parse_sinks(value: str | Iterable[str] | None, flag: str = "--log") -> list[str]:
    """Sink names from 'tensorboard,mlflow' (or a list of such): known and installed, or SinkError."""
    if value is None:
        return []
    parts = value.split(",") if isinstance(value, str) else [p for v in value for p in str(v).split(",")]
    names: list[str] = []
    for part in parts:
        name = part.strip().lower()
        if name not in SINK_PACKAGES:
            raise SinkError(f"{flag} = {part.strip()!r}: allowed: {', '.join(SINK_PACKAGES)} (comma-separated)")
        if name not in names:
            names.append(name)
    for name in names:
        module, package = SINK_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise SinkError(f"{flag} = {name!r}: the {package} package is not installed (pip install {package})")
    return names


def choose_sinks(log: str | Iterable[str] | None, log_dir: Path | str | None, store_path: Path,
                 flag: str = "--log", dir_flag: str = "--log-dir") -> SinkChoice | None:
    """The sinks asked for and their folder, checked: None when none was asked for."""
    names = parse_sinks(log, flag)
    if not names:
        if log_dir is not None:
            raise SinkError(f"{dir_flag} {log_dir}: give {flag} too ({', '.join(SINK_PACKAGES)})")
        return None
    folder = Path(log_dir) if log_dir is not None else Path(store_path).resolve().parent / LOG_ROOT
    if folder.exists() and not folder.is_dir():
        raise SinkError(f"{dir_flag} {folder}: not a folder")
    parent = folder.resolve().parent
    if not parent.is_dir():
        raise SinkError(f"{dir_flag} {folder}: folder {parent} does not exist (create it first)")
    return SinkChoice(tuple(names), folder.resolve())


def run_label(name: str, run_uuid: str) -> str:
    """A run's name in the sinks: its name (letters, digits, . _ -) and the first 8 hex of its uuid."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "run"
    return f"{safe[:64]}-{run_uuid[:8]}"


def open_sinks(names: list[str], log_dir: Path, run_name: str, config: dict[str, Any], *,
               batch_ranks: int = 1) -> "Sinks":
    """The sinks `names` writing under `log_dir`, for the run `run_name` described by `config`.

    `batch_ranks`: how many ranks' samples make one step's global batch (the world size for data
    parallelism, 1 where every rank takes the whole batch): the throughput is rank 0's samples times
    it over rank 0's step time. A backend that fails to open is left out, with a note in `errors`."""
    os.environ.update(OFFLINE_ENVIRONMENT)
    log_dir.mkdir(exist_ok=True)
    backends: list[Backend] = []
    errors: list[str] = []
    for name in names:
        try:
            backends.append(BACKENDS[name](log_dir, run_name, config))
        except Exception as exc:  # noqa: BLE001 - a sink must never stop a run
            errors.append(f"log sink {name} could not open: {_one_line(exc)}")
    return Sinks(backends, errors, batch_ranks)


class Sinks:
    """The open sinks of one run: `record(record)` for each record of rank 0's file, then `close()`."""

    def __init__(self, backends: list["Backend"], errors: list[str] | None = None, batch_ranks: int = 1):
        self.backends = backends
        self.errors = list(errors or [])
        self.places = {b.name: b.where for b in backends}  # sink -> where it wrote (for the summary)
        self._metrics = RecordMetrics(batch_ranks)
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._flush_now = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="ddlscope-sinks", daemon=True)
        self._thread.start()
        self._closed = False

    def record(self, record: dict[str, Any]) -> None:
        """One record as the rank files hold it; queued, written by the sinks' own thread."""
        if not self._closed:
            self._queue.put(record)

    def close(self, status: str = "finished", timeout_s: float = 60.0) -> list[str]:
        """Write what is queued, close every sink; the notes of sinks that failed."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._flush_now.set()
            self._thread.join(timeout_s)
            for backend in list(self.backends):
                self._call(backend, "close", status)
        return self.errors

    def _drain(self) -> None:
        """Every FLUSH_S (at once when closing): what was recorded meanwhile, as batches of calls."""
        while True:
            records = [self._queue.get()]
            self._flush_now.wait(FLUSH_S)
            while True:
                try:
                    records.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            end = records.index(None) if None in records else len(records)
            self._write(records[:end])  # type: ignore[arg-type]
            if end < len(records):
                return

    def _write(self, records: list[dict[str, Any]]) -> None:
        """The records' calls in order, each run of metrics one call: metrics([(values, step), ...])."""
        calls: list[tuple[str, Any]] = []
        for record in records:
            for what, arg in self._metrics.translate(record):
                if what == "metrics" and calls and calls[-1][0] == "metrics":
                    calls[-1][1].append(arg)
                else:
                    calls.append((what, [arg] if what == "metrics" else arg))
        for what, arg in calls:
            for backend in list(self.backends):
                self._call(backend, what, arg)

    def _call(self, backend: "Backend", what: str, *args: Any) -> None:
        try:
            getattr(backend, what)(*args)
        except Exception as exc:  # noqa: BLE001 - a failing sink is dropped, the run goes on
            self.errors.append(f"log sink {backend.name} failed and was dropped: {_one_line(exc)}")
            if backend in self.backends:
                self.backends.remove(backend)


class RecordMetrics:
    """Records of rank 0's file -> the sinks' calls: ("metrics", (dict, step)) and ("config", dict)."""

    def __init__(self, batch_ranks: int = 1):
        self.batch_ranks = batch_ranks
        self.model_flops: float | None = None  # per step, the latest `flops` event's
        self.peak_flops_per_s: float | None = None
        self.last_step = 0

    def translate(self, record: dict[str, Any]) -> list[tuple[str, Any]]:
        kind = record.get("kind")
        if kind == "step":
            self.last_step = int(record["step"])
            return [("metrics", (self.step_metrics(record), self.last_step))]
        if kind == "memory":
            memory = {f"memory/{k}_bytes": float(v) for k, v in (record.get("bytes") or {}).items()
                      if isinstance(v, (int, float))}
            return [("metrics", (memory, self.last_step))] if memory else []
        if kind == "eval":
            metrics = {f"eval/{record.get('metric_name') or 'metric'}": record.get("metric"),
                       "eval/loss": record.get("loss")}
            finite = {k: float(v) for k, v in metrics.items() if _finite(v)}
            return [("metrics", (finite, int(record["step"])))] if finite else []
        if kind == "event" and record.get("event") == "flops":
            from ddlscope.runtime.flops import parse_flops_message

            fields = parse_flops_message(str(record.get("message", "")))
            self.model_flops = float(fields["model_flops_per_step"])
            self.peak_flops_per_s = float(fields["peak_flops_per_s"])
            return [("config", {"model_flops_per_step": self.model_flops, "peak_flops_per_s": self.peak_flops_per_s,
                                "peak_source": fields.get("peak_source", "").replace("_", " ")})]
        if kind == "event" and record.get("event") == "attached":
            return [("config", json.loads(record.get("message") or "{}"))]
        return []

    def step_metrics(self, row: dict[str, Any]) -> dict[str, float]:
        metrics = {f"time/{k}": float(row[k]) for k in PHASES if _finite(row.get(k))}
        step_s = float(row.get("step_s") or 0.0)
        samples = row.get("samples") or 0
        if step_s > 0 and samples:
            metrics["throughput/samples_per_s"] = samples * self.batch_ranks / step_s
            metrics["throughput/rank0_samples_per_s"] = samples / step_s
        if _finite(row.get("loss")):
            metrics["train/loss"] = float(row["loss"])
        if step_s > 0 and self.model_flops and self.peak_flops_per_s:
            metrics["utilization/mfu"] = self.model_flops / step_s / self.peak_flops_per_s
            metrics["utilization/model_flops_per_s"] = self.model_flops / step_s
        return metrics


# ---------------------------------------------------------------------------- backends
class Backend:
    """One library's writer for one run."""

    name = ""
    where = ""  # where it writes, for the summary

    def metrics(self, rows: list[tuple[dict[str, float], int]]) -> None:
        """Metric values at their steps, in order."""
        raise NotImplementedError

    def config(self, values: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self, status: str) -> None:
        raise NotImplementedError


class TensorBoardSink(Backend):
    """Event files under log_dir/tensorboard/<run>, one scalar series per metric; the config as text.

    A step's scalars go as one event (one summary of all its values): add_scalar makes an event per
    value, through torch's tensor conversion, about ten times the CPU."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        folder = log_dir / "tensorboard" / run_name
        self.writer = SummaryWriter(log_dir=str(folder))
        self.where = str(folder)
        if config:
            self.config(config)

    def metrics(self, rows: list[tuple[dict[str, float], int]]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        events = self.writer._get_file_writer()
        for values, step in rows:
            events.add_summary(Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()]), step)

    def config(self, values: dict[str, Any]) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(values, indent=1, sort_keys=True, default=str) + "\n```")

    def close(self, status: str) -> None:
        self.writer.add_text("status", status)
        self.writer.close()


class MLflowSink(Backend):
    """A run of the experiment 'ddlscope' in an MLflow file store at log_dir/mlruns; config as params."""

    name = "mlflow"
    PARAM_CHARS = 500

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        uri = (log_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = experiment.experiment_id if experiment else self._create_experiment()
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.where = f"{uri} (run {self.run_id})"
        self._params: dict[str, str] = {}
        if config:
            self.config(config)

    def _create_experiment(self) -> str:
        try:
            return self.client.create_experiment(PROJECT)
        except Exception:  # noqa: BLE001 - another run created it meanwhile
            experiment = self.client.get_experiment_by_name(PROJECT)
            if experiment is None:
                raise
            return experiment.experiment_id

    BATCH = 1000  # metrics per log_batch call, MLflow's limit

    def metrics(self, rows: list[tuple[dict[str, float], int]]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [Metric(k, v, now_ms, step) for values, step in rows for k, v in values.items()]
        for start in range(0, len(batch), self.BATCH):
            self.client.log_batch(self.run_id, metrics=batch[start:start + self.BATCH])

    def config(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # A param is logged once: a value that changed (a run's config, updated) is not sent again.
        fresh = {k: v[:self.PARAM_CHARS] for k, v in _flatten(values).items() if k not in self._params}
        if fresh:
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in fresh.items()])
            self._params.update(fresh)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))


class WandbSink(Backend):
    """A W&B run in offline mode under log_dir/wandb (project 'ddlscope'); nothing leaves the machine."""

    name = "wandb"

    def __init__(self, log_dir: Path, run_name: str, config: dict[str, Any]):
        import wandb

        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                                  x_disable_machine_info=True, disable_git=True, disable_code=True,
                                  save_code=False, x_save_requirements=False)
        self.run = wandb.init(mode="offline", dir=str(log_dir), project=PROJECT, name=run_name, config=config,
                              reinit="create_new", settings=settings)
        self.where = str(Path(self.run.dir).parent)

    def metrics(self, rows: list[tuple[dict[str, float], int]]) -> None:
        for values, step in rows:
            self.run.log(values, step=step)

    def config(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


BACKENDS: dict[str, type[Backend]] = {"tensorboard": TensorBoardSink, "mlflow": MLflowSink, "wandb": WandbSink}


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"
