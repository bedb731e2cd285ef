"""How well a 1-rank model profile (`ddlscope calibrate --model`) predicts the model's multi-rank runs.

For three models (a GPT, a CNN, a Hugging Face transformer at a tiny config) it profiles one rank
with `ddlscope calibrate --model` (the CLI, in a fresh process, as a user runs it), then runs each
model for real under ddp, fsdp, pipeline and localsgd on 2 and 4 ranks (launch(), gloo, this
machine) and predicts each run from the profile alone (predict/from_profile.py: the profile's
whole step at the rank's batch, assembled into the run's step by predict/local.py with this
machine's calibration). It prints predicted vs measured mean step time per run, the median
|error| per model and per strategy, and the load average when it ran (target: median <= 10%).

    .venv/bin/python benchmarks/predict_profile.py [--calibration FILE] [--steps N] [--json OUT]
        [--models gpt,cnn,hf] [--strategies ddp,fsdp,pipeline,localsgd] [--worlds 2,4]

Without --calibration it calibrates world sizes 2, 3 and 4 first (quick). About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from predict_local import load_average  # noqa: E402 (the benchmark next door's reading of the load)

# Tiny configurations: a few milliseconds to tens of milliseconds a step on one core.
MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"workload.name": "gpt-synthetic", "workload.layers": 4, "workload.hidden": 128, "workload.heads": 4,
            "workload.seq_len": 64, "workload.batch_size": 16, "workload.optimizer": "sgd"},
    "cnn": {"workload.name": "resnet-cifar", "workload.width": 8, "workload.blocks": 1, "workload.batch_size": 32,
            "workload.samples": 2000, "workload.test_samples": 100},
    "hf": {"workload.name": "hf:llama", "workload.hidden": 64, "workload.layers": 4, "workload.heads": 4,
           "workload.seq_len": 64, "workload.batch_size": 16},
}
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {}, "fsdp": {}, "pipeline": {"strategy.micro_batches": 4}, "localsgd": {"strategy.period": 4},
}


def profile_of(model: str, overrides: dict[str, Any], folder: Path, repeats: int) -> dict[str, Any]:
    """`ddlscope calibrate --model` in a fresh process (what a user runs), read back."""
    from ddlscope.predict.from_profile import load_model_profile

    path = folder / f"{model}-profile.toml"
    workload = overrides["workload.name"]
    sets = [arg for key, value in overrides.items() if key != "workload.name"
            for arg in ("--set", f"{key}={value}")]
    ddlscope = Path(sys.executable).with_name("ddlscope")
    subprocess.run([str(ddlscope), "calibrate", "--model", workload, *sets, "--repeats", str(repeats),
                    "-o", str(path)], check=True, stdout=subprocess.DEVNULL)
    return load_model_profile(path)


def measured_run(exp: Any, db: Path, console: Console, label: str) -> tuple[Any, dict[str, Any]] | None:
    """Launch the run (once more if it did not finish: another launch may have taken its port) and read
    back what it measured, as predict_local.py does."""
    from ddlscope.analysis.summary import summarize
    from ddlscope.predict.local import measured_from_summary
    from ddlscope.runtime.launcher import launch
    from ddlscope.store import Store

    result = launch(exp, db)
    if result.status != "finished":
        console.print(f"{label}: {result.status} ({result.error}); retrying once")
        result = launch(exp, db)
    if result.status != "finished":
        console.print(f"{label}: {result.status} {result.error}")
        return None
    with Store(db) as store:
        run = store.get_run(result.run_id)
        return run, measured_from_summary(summarize(store, run).to_dict())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5, help="calibrate --model's repeats")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--json", type=Path, default=None, help="write every row, with the profiles, here")
    parser.add_argument("--beside-predict-run", action="store_true",
                        help="also predict each run as predict-run does (the run's kernels timed now, alone and "
                             "side by side in its ranks): what a profile taken once loses against that")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)

    from ddlscope.calibrate import calibrate, load_profile
    from ddlscope.predict.from_profile import predict_local_from_profile
    from ddlscope.calibrate import workload_facts
    from ddlscope.predict.local import compare, predict_local
    from ddlscope.runtime.config import load_experiment
    from ddlscope.specs import ConfigError

    console = Console()
    began = time.perf_counter()
    console.print(f"load average at the start: {load_average()}")
    calibration = load_profile(args.calibration) if args.calibration else calibrate([2, 3, 4], quick=True)
    rows, profiles = [], {}
    with tempfile.TemporaryDirectory(prefix="ddlscope-predict-profile-") as tmp:
        db = Path(tmp) / "bench.db"
        for model in args.models.split(","):
            profiles[model] = profile = profile_of(model, MODELS[model], Path(tmp), args.repeats)
            console.print(f"{model}: profiled at batch {profile['batch']} ({profile['split']}): step "
                          f"{(profile['step']['forward_s'] + profile['step']['backward_s']) * 1e3:.2f} ms, layers "
                          f"{profile['layers_sum_s'] * 1e3:.2f} ms, load {profile['meta']['load_average_1min']:.1f}")
            for strategy in args.strategies.split(","):
                for world in (int(w) for w in args.worlds.split(",")):
                    label = f"{model} {strategy} x{world}"
                    try:
                        exp = load_experiment(None, {**MODELS[model], **STRATEGIES[strategy], "strategy.name": strategy,
                                                     "cluster.world_size": world, "workload.steps": args.steps})
                    except ConfigError as refused:  # pipeline splits transformers only: not the CNN
                        console.print(f"{label}: not run ({refused})", markup=False)
                        continue
                    measured = measured_run(exp, db, console, label)
                    if measured is None:
                        continue
                    run, figures = measured
                    # the run's own steps: how often localsgd's averages land in its mean step
                    predicted = predict_local_from_profile(profile, run.config["strategy"], world, calibration,
                                                           run.environment, steps=int(run.config["workload"]["steps"]))
                    error = compare(predicted, figures)
                    row = {"model": model, "strategy": strategy, "world": world, "config": label,
                           "predicted": predicted, "measured": figures, "error": error,
                           "load_average_1min": os.getloadavg()[0]}
                    if args.beside_predict_run:
                        timed = predict_local(run.config, run.environment, workload_facts(run.config, time_kernels=True),
                                              calibration)
                        row["predict_run_error"] = compare(timed, figures)["step_s_error"]
                    rows.append(row)
                    console.print(f"{label}: {predicted['step_s'] * 1e3:.2f} ms predicted, "
                                  f"{figures['step_s'] * 1e3:.2f} ms measured ({error['step_s_error'] * 100:+.1f}%)")
    print_results(console, rows)
    console.print(f"{len(rows)} runs in {time.perf_counter() - began:.0f} s; load average at the end "
                  f"{load_average()}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "profiles": profiles}, default=str))
    return 0


def median_abs_pct(rows: list[dict[str, Any]]) -> float:
    return statistics.median(abs(r["error"]["step_s_error"]) for r in rows) * 100 if rows else float("nan")


def print_results(console: Console, rows: list[dict[str, Any]]) -> None:
    beside = any("predict_run_error" in r for r in rows)
    table = Table("run", "predicted ms", "measured ms", "error", *(["predict-run error"] if beside else []), "load",
                  title="from a 1-rank profile vs measured")
    for r in rows:
        table.add_row(r["config"], f"{r['predicted']['step_s'] * 1e3:.2f}", f"{r['measured']['step_s'] * 1e3:.2f}",
                      f"{r['error']['step_s_error'] * 100:+.1f}%",
                      *([f"{r['predict_run_error'] * 100:+.1f}%"] if beside else []), f"{r['load_average_1min']:.1f}")
    console.print(table)
    for key in ("model", "strategy"):
        groups = sorted({r[key] for r in rows})
        console.print(f"median |error| per {key}: " + ", ".join(
            f"{g} {median_abs_pct([r for r in rows if r[key] == g]):.1f}%" for g in groups))
    console.print(f"median |error| over all {len(rows)} runs: {median_abs_pct(rows):.1f}% (target <= 10%)")
    if beside:
        console.print(f"predict-run (kernels timed in the run's ranks) over the same runs: median |error| "
                      f"{statistics.median(abs(r['predict_run_error']) for r in rows) * 100:.1f}%")


if __name__ == "__main__":
    sys.exit(main())
