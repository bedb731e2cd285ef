"""Sinks (runtime/sinks.py): records as rank 0's file holds them go to TensorBoard, MLflow and W&B (offline),
and each test reads back what the library wrote with that library's own reader: TensorBoard's
EventAccumulator, MlflowClient on the file store, and `wandb leet inspect --json` (W&B's reader of an
offline run's .wandb transaction log; one JSON object per record)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddlscope.runtime.sinks import SinkError, choose_sinks, open_sinks, parse_sinks, run_label

pytestmark = pytest.mark.cli_in_this_process  # its runs need no process of their own (conftest.cli)


# What a run's rank 0 writes, in the order it writes it: the flops event (before training under
# `run`), the step rows, an eval row, the memory record at the end.
MODEL_FLOPS, PEAK = 2.0e9, 1.0e10
FLOPS = {"kind": "event", "rank": 0, "seq": 0, "t": 0.0, "event": "flops",
         "message": f"model_flops_per_step={int(MODEL_FLOPS)} hardware_flops_per_step={int(MODEL_FLOPS)} "
                    f"per_rank_batch=32 peak_flops_per_s={PEAK:g} counted_on=meta peak_source=measured_fp32"}


def step_row(step: int) -> dict[str, Any]:
    data, fwd, bwd, comm, opt = 0.01 * (step + 1), 0.1, 0.2, 0.05, 0.04  # distinct, so a swap shows
    return {"kind": "step", "rank": 0, "step": step, "t_s": step, "data_s": data, "forward_s": fwd,
            "backward_s": bwd, "comm_wait_s": comm, "optimizer_s": opt, "step_s": data + fwd + bwd + comm + opt,
            "comm_s": 0.07, "compute_cpu_s": 0.3, "samples": 32, "loss": 2.0 - 0.5 * step, "bytes_sent": 1000}


STEPS = [step_row(s) for s in range(3)]
EVAL = {"kind": "eval", "rank": 0, "step": 2, "wall_s": 1.0, "samples_seen": 192, "metric_name": "accuracy",
        "metric": 0.75, "loss": 0.9}
MEMORY = {"kind": "memory", "rank": 0, "bytes": {"parameters": 4000, "gradients": 4000, "optimizer": 8000,
                                                 "activations": 12345, "peak_rss": 10**8}}
RECORDS = [FLOPS, *STEPS, EVAL, MEMORY]
WORLD = 2


def expected(step: int) -> dict[str, float]:
    row = STEPS[step]
    return {"time/data_s": row["data_s"], "time/forward_s": row["forward_s"], "time/backward_s": row["backward_s"],
            "time/comm_wait_s": row["comm_wait_s"], "time/optimizer_s": row["optimizer_s"],
            "time/step_s": row["step_s"], "throughput/samples_per_s": 32 * WORLD / row["step_s"],
            "utilization/mfu": MODEL_FLOPS / row["step_s"] / PEAK, "train/loss": row["loss"]}


MEMORY_EXPECTED = {"memory/parameters_bytes": 4000, "memory/gradients_bytes": 4000, "memory/optimizer_bytes": 8000,
                   "memory/activations_bytes": 12345}


def feed(name: str, log_dir: Path) -> dict[str, str]:
    sinks = open_sinks([name], log_dir, "unit-0123abcd", {"name": "unit", "world_size": WORLD}, batch_ranks=WORLD)
    for record in RECORDS:
        sinks.record(record)
    assert sinks.close() == []
    return sinks.places


def check_series(series: dict[str, list[tuple[int, float]]]) -> None:
    """`series`: metric -> [(step, value)] as read back."""
    for step in range(3):
        for key, value in expected(step).items():
            got = dict(series[key])
            assert step in got, (key, got)
            assert got[step] == pytest.approx(value, rel=1e-6), (key, step)
    for key, value in MEMORY_EXPECTED.items():
        assert series[key] == [(2, pytest.approx(value))], key  # at the last step seen
    assert series["eval/accuracy"] == [(2, pytest.approx(0.75))]


@pytest.mark.timeout(60)
def test_tensorboard_holds_every_scalar_at_its_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    places = feed("tensorboard", tmp_path)
    folder = tmp_path / "tensorboard" / "unit-0123abcd"
    assert places == {"tensorboard": str(folder)}
    events = EventAccumulator(str(folder))
    events.Reload()
    series = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    check_series(series)


@pytest.mark.timeout(60)
def test_mlflow_file_store_holds_the_run_its_metrics_and_params(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    places = feed("mlflow", tmp_path)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("ddlscope")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "unit-0123abcd" and run.info.status == "FINISHED"
    assert run.info.run_id in places["mlflow"]
    keys = [*expected(0), *MEMORY_EXPECTED, "eval/accuracy"]
    series = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] for k in keys}
    check_series(series)
    params = run.data.params
    assert params["world_size"] == "2" and params["peak_flops_per_s"] == str(PEAK)


def wandb_records(log_dir: Path) -> list[dict[str, Any]]:
    """An offline run's records, through W&B's own reader of its transaction log."""
    (run_dir,) = (log_dir / "wandb").glob("offline-run-*")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.mark.timeout(90)
def test_wandb_offline_run_holds_the_history_and_config(tmp_path: Path) -> None:
    places = feed("wandb", tmp_path)
    records = wandb_records(tmp_path)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "unit-0123abcd" and run["project"] == "ddlscope"
    assert places["wandb"].endswith(run["run_id"])
    series: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r["type"] == "history":
            step = int(r["history"]["step"]["num"])
            for key, value in r["history"]["item"].items():
                if not key.startswith("_"):
                    series.setdefault(key, []).append((step, value))
    check_series(series)
    config = {}
    for r in records:
        if r["type"] in ("run", "config"):
            config.update((r.get("run") or r)["config"]["update"])
    assert config["world_size"] == 2 and config["model_flops_per_step"] == MODEL_FLOPS
    assert not [r for r in records if r["type"] == "stats"], "system metrics are off"


def test_throughput_counts_one_rank_where_every_rank_takes_the_whole_batch(tmp_path: Path) -> None:
    from ddlscope.runtime.sinks import RecordMetrics

    metrics = RecordMetrics(batch_ranks=1).step_metrics(STEPS[0])
    assert metrics["throughput/samples_per_s"] == pytest.approx(32 / STEPS[0]["step_s"])
    assert "utilization/mfu" not in metrics  # no flops event yet
    nan_loss = RecordMetrics().step_metrics({**STEPS[0], "loss": math.nan})
    assert "train/loss" not in nan_loss


def test_a_failing_sink_is_dropped_with_a_note_and_the_others_go_on(tmp_path: Path) -> None:
    from ddlscope.runtime.sinks import Backend, Sinks

    class Broken(Backend):
        name = "broken"

        def metrics(self, rows: list[tuple[dict[str, float], int]]) -> None:
            raise OSError("disk full")

    class Kept(Backend):
        name = "kept"

        def __init__(self) -> None:
            self.steps: list[int] = []
            self.closed = ""

        def metrics(self, rows: list[tuple[dict[str, float], int]]) -> None:
            self.steps.extend(step for _, step in rows)

        def config(self, values: dict[str, Any]) -> None:
            pass

        def close(self, status: str) -> None:
            self.closed = status

    kept = Kept()
    sinks = Sinks([Broken(), kept])
    for record in STEPS:
        sinks.record(record)
    errors = sinks.close("failed")
    assert errors == ["log sink broken failed and was dropped: OSError: disk full"]
    assert kept.steps == [0, 1, 2] and kept.closed == "failed"


def test_sink_names_and_the_log_folder_are_checked_in_one_line(tmp_path: Path, monkeypatch) -> None:
    assert parse_sinks(" TensorBoard, mlflow,tensorboard") == ["tensorboard", "mlflow"]
    with pytest.raises(SinkError, match=r"^--log = 'comet': allowed: tensorboard, mlflow, wandb \(comma-separated\)$"):
        parse_sinks("tensorboard,comet")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(SinkError, match=r"^--log = 'wandb': the wandb package is not installed \(pip install wandb\)$"):
        parse_sinks("wandb")
    store = tmp_path / "x.db"
    assert choose_sinks(None, None, store) is None
    assert choose_sinks("tensorboard", None, store).log_dir == tmp_path / "ddlscope-logs"
    with pytest.raises(SinkError, match="does not exist"):
        choose_sinks("tensorboard", tmp_path / "no" / "logs", store)
    with pytest.raises(SinkError, match="give --log too"):
        choose_sinks(None, tmp_path, store)
    assert run_label("torchvision:resnet18 / ddp", "0123456789abcdef") == "torchvision-resnet18-ddp-01234567"


@pytest.mark.timeout(60)
def test_attach_feeds_the_sinks_from_rank_0s_meter(tmp_path: Path, monkeypatch) -> None:
    """A plain-python job (one process): `attach(..., log=...)` writes to TensorBoard as it steps."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import ddlscope
    from ddlscope.runtime import attach as attach_module

    monkeypatch.setattr(attach_module, "_current", None)
    monkeypatch.delenv("DDLSCOPE_RUN_DIR", raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = ddlscope.attach(model, optimizer, run="sunk", db=tmp_path / "s.db", log="tensorboard",
                            log_dir=tmp_path / "logs")
    for _ in range(4):
        with meter.step(samples=4) as step:
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step.loss = loss
    meter.close()
    (folder,) = (tmp_path / "logs" / "tensorboard").iterdir()
    assert folder.name.startswith("sunk-")
    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = events.Tags()["scalars"]
    step_s = [e.value for e in events.Scalars("time/step_s")]
    assert [e.step for e in events.Scalars("time/step_s")] == [0, 1, 2, 3]
    throughput = [e.value for e in events.Scalars("throughput/samples_per_s")]
    assert throughput == pytest.approx([4 / s for s in step_s], rel=1e-5)
    assert "utilization/mfu" in scalars and "memory/parameters_bytes" in scalars
    mfu = events.Scalars("utilization/mfu")
    assert 0 < mfu[-1].value < 1  # a fraction of the peak
    assert meter.log_places["tensorboard"] == str(folder)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_two_rank_run_logs_rank_0s_steps_to_tensorboard(cli, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = cli("run", "--world-size", "2", "--steps", "4", "--batch-size", "16", "--log", "tensorboard", "--name", "tb",
                 "--json", timeout_s=200)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    (folder,) = (tmp_path / "ddlscope-logs" / "tensorboard").iterdir()
    assert summary["logs"] == {"tensorboard": str(folder)}
    events = EventAccumulator(str(folder))
    events.Reload()
    step_s = {e.step: e.value for e in events.Scalars("time/step_s")}
    assert sorted(step_s) == [0, 1, 2, 3]
    parts = ("data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s")
    for step, total in step_s.items():
        assert sum({e.step: e.value for e in events.Scalars(f"time/{p}")}[step] for p in parts) == \
            pytest.approx(total, rel=1e-4)
    throughput = {e.step: e.value for e in events.Scalars("throughput/samples_per_s")}
    # 16 samples a step over both ranks: rank 0's 8 times 2 ranks, over rank 0's step time
    assert throughput == pytest.approx({s: 16 / v for s, v in step_s.items()}, rel=1e-4)
    mfu = {e.step: e.value for e in events.Scalars("utilization/mfu")}
    assert set(mfu) == set(step_s) and all(0 < v < 1 for v in mfu.values())
    assert events.Scalars("memory/parameters_bytes")[0].value > 0
