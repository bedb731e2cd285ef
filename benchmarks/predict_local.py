"""How well the local predictor (ddlscope predict-run) predicts real local runs.

Runs short configurations through launch(), predicts each from its stored
config with this machine's calibration, and prints predicted vs measured mean
step time and rank 0's model-state bytes. The standard 12 (ddp, fsdp,
ps-sync, ps-async; world sizes 2 and 4; the real loopback network and an
emulated custom link) carry the MAPE targets (<= 10% step time, <= 5%
memory). With --cnn: the vision workloads (resnet-cifar as `study paper`
trains it, and vgg-cifar), whose convolutions are priced as their implicit
GEMMs (target: <= 10% median step-time error). With --all: a row for every
registered strategy (and the four pipeline schedules, tp, recompute);
issue 38's target is a median |error| <= 10% per strategy, <= 15% for the
worst one.

Run-to-run noise is part of the result: every configuration runs --repeats
times (3 by default), and each repeat is predicted from its workload's
kernels timed right before it (this machine's speed drifts by a fifth within
a minute: a timing minutes away reads the drift as the predictor's error).
A row is the repeat with the median error; it prints the repeats' min..max
step times and errors, and is "within noise" when its prediction lies inside
the measured min..max. Per strategy: the median |error| of its rows. Each
configuration runs enough steps (beyond --steps) that its timed steps last
about --min-run-s (2 s): this machine's speed varies over seconds, and a
tenth of a second of steps drew one sample of it (see run_steps).

    .venv/bin/python benchmarks/predict_local.py [--calibration FILE] [--steps N] [--repeats R] [--json OUT]
        [--quick]                      # one repeat, a quick calibration: a smoke run, not a judgement
        [--only STRATEGY[,..]]         # just these strategies' rows, from every set
        [--servers | --only-servers]   # + 5 runs with two parameter-server ranks, reported apart
        [--cnn]                        # 10 runs of the vision workloads instead (resnet-cifar, vgg-cifar)
        [--dataparallel | --only-dataparallel]   # + 11 runs of localsgd, diloco, cocod, hpsgd, osp, gossip, omnivore, apart
        [--modelparallel | --only-modelparallel] # + pipeline (4 schedules, recompute), tp, partitioned, apart
        [--all]                        # every set above but --cnn, + the strategies no set covers (a row each)
    .venv/bin/python benchmarks/predict_local.py --rescore OUT [--calibration FILE]   # the same runs, predicted again

Without --calibration it calibrates world sizes 2, 3 and 4 first (the full
calibration: 5 repeats per size; --quick-calibration for 3). About 3 minutes
on 2 cores. Run it on an otherwise idle machine: other work stretches the runs
but not the calibration that predicts them, or the other way round.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

# Each configuration runs enough steps to last about MIN_RUN_S (see run_steps), at most MAX_RUN_STEPS.
MIN_RUN_S, MAX_RUN_STEPS = 2.0, 400
WORKLOAD = {"workload.name": "mlp-digits", "workload.hidden": 512, "workload.layers": 3,
            "workload.batch_size": 256}
# The tables are wide (a row per configuration with its spread): printed at this width, a terminal or not.
WIDTH = 170
CUSTOM = {"cluster.network.profile": "custom", "cluster.network.alpha_us": 100.0,
          "cluster.network.bandwidth_gbps": 0.5}
# The vision workloads: resnet-cifar as the main study trains it (width 8, one block per stage, batch 64)
# and a VGG-11 at width 16, where fewer, larger convolutions carry the FLOPs.
RESNET = {"workload.name": "resnet-cifar", "workload.width": 8, "workload.blocks": 1, "workload.batch_size": 64,
          "workload.samples": 2000, "workload.test_samples": 100}
VGG = {"workload.name": "vgg-cifar", "workload.width": 16, "workload.batch_size": 64, "workload.samples": 2000,
       "workload.test_samples": 100}
CNN_CONFIGS: list[tuple[str, int, dict]] = [
    (strategy, world, {**workload, **network}) for workload in (RESNET, VGG)
    for strategy, world, network in (("ddp", 2, {}), ("ddp", 4, {}), ("fsdp", 2, {}), ("ps-sync", 2, {}),
                                     ("ddp", 2, CUSTOM))
]
CONFIGS: list[tuple[str, int, dict]] = [
    ("ddp", 2, {}), ("ddp", 4, {}), ("fsdp", 2, {}), ("fsdp", 4, {}), ("ps-sync", 2, {}), ("ps-async", 2, {}),
    ("ddp", 2, CUSTOM), ("ddp", 4, CUSTOM), ("fsdp", 2, CUSTOM), ("ps-sync", 2, CUSTOM),
    ("ps-async", 2, CUSTOM), ("ps-sync", 4, CUSTOM),
]
# --servers: parameter servers sharded over two server ranks (not in the 12 the targets are for).
TWO_SERVERS = {"strategy.servers": 2}
SERVER_CONFIGS: list[tuple[str, int, dict]] = [
    ("ps-sync", 2, TWO_SERVERS), ("ps-async", 2, TWO_SERVERS),
    ("ps-async", 2, {**TWO_SERVERS, "strategy.block_cyclic": True}),
    ("ps-sync", 2, {**TWO_SERVERS, **CUSTOM}), ("ps-async", 4, {**TWO_SERVERS, **CUSTOM}),
]

# --dataparallel: the local SGD family and HPSGD (issue 19), reported apart like the sharded servers.
DATAPARALLEL_CONFIGS: list[tuple[str, int, dict]] = [
    ("localsgd", 2, {}), ("localsgd", 2, CUSTOM), ("diloco", 2, CUSTOM), ("cocod", 2, CUSTOM),
    ("hpsgd", 2, {}), ("hpsgd", 2, CUSTOM), ("osp", 2, CUSTOM), ("gossip", 2, CUSTOM),
    ("gossip", 2, {**CUSTOM, "strategy.mode": "async"}), ("gossip", 2, {"strategy.dp_noise_multiplier": 1.0}),
    ("omnivore", 4, {**CUSTOM, "strategy.groups": 2}),
]

# --modelparallel: pipeline and tp on a small GPT, partitioned on the digits (issue 21), reported apart.
GPT = {"workload.name": "gpt-synthetic", "workload.layers": 4, "workload.hidden": 128, "workload.heads": 4,
       "workload.seq_len": 64, "workload.batch_size": 16, "workload.optimizer": "sgd"}
MODELPARALLEL_CONFIGS: list[tuple[str, int, dict]] = [
    ("pipeline", 2, {**GPT, "strategy.schedule": "gpipe", "strategy.micro_batches": 4}),
    ("pipeline", 2, {**GPT, "strategy.schedule": "1f1b", "strategy.micro_batches": 4}),
    ("pipeline", 2, {**GPT, "strategy.schedule": "interleaved", "strategy.chunks": 2, "strategy.micro_batches": 4}),
    ("pipeline", 2, {**GPT, "strategy.schedule": "zero-bubble", "strategy.chunks": 2, "strategy.micro_batches": 4}),
    ("pipeline", 2, {**GPT, "strategy.schedule": "1f1b", "strategy.micro_batches": 4, "strategy.recompute": [0, 1]}),
    ("tp", 2, GPT), ("single", 1, GPT),
    ("partitioned", 2, {}),
]

# --all: the registered strategies no set above runs, a row each (issue 38: every strategy has a row).
GRAPH = {"workload.name": "graph-transformer", "workload.nodes": 256, "workload.hidden": 32, "workload.layers": 2}
OTHER_CONFIGS: list[tuple[str, int, dict]] = [
    ("single", 1, {}), ("dbs", 2, {}), ("ssp", 2, {}), ("ps-stale-aware", 2, {}),
    ("fedavg", 2, {"strategy.local_steps": 4}), ("mm-psgd", 2, {"strategy.local_steps": 4}),
    ("mc-psgd", 2, {"strategy.local_steps": 4}),
    ("nodepar", 2, {**GRAPH, "strategy.mode": "node-parallel"}),
]


def config_group(strategy: str, world: int, overrides: dict) -> str:
    """Which set a configuration belongs to: the standard 12 (the targets are for them) or an extra one."""
    if (strategy, world, overrides) in CONFIGS or (strategy, world, overrides) in CNN_CONFIGS:
        return "standard"
    if (strategy, world, overrides) in MODELPARALLEL_CONFIGS:
        return "modelparallel"
    if (strategy, world, overrides) in OTHER_CONFIGS:
        return "other strategies"
    return "dataparallel" if (strategy, world, overrides) in DATAPARALLEL_CONFIGS else "sharded servers"


def selected_configs(args: argparse.Namespace) -> list[tuple[str, int, dict]]:
    """The configurations the flags ask for, in order (--only: of those, or of every set, its strategies')."""
    everything = CONFIGS + SERVER_CONFIGS + DATAPARALLEL_CONFIGS + MODELPARALLEL_CONFIGS + OTHER_CONFIGS
    if args.only:
        wanted = set(args.only)
        pool = CNN_CONFIGS if args.cnn else everything
        return [c for c in pool if c[0] in wanted]
    if args.all:
        return everything
    standard = CNN_CONFIGS if args.cnn else CONFIGS
    only = args.only_servers or args.only_dataparallel or args.only_modelparallel
    return (([] if only else standard) + (SERVER_CONFIGS if args.servers or args.only_servers else [])
            + (DATAPARALLEL_CONFIGS if args.dataparallel or args.only_dataparallel else [])
            + (MODELPARALLEL_CONFIGS if args.modelparallel or args.only_modelparallel else []))


def strategy_list(text: str) -> list[str]:
    """--only's value: registered strategy names, comma-separated (an unknown one is refused by argparse)."""
    from ddlscope.specs import STRATEGY_SPECS

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGY_SPECS.names()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown strategy {', '.join(unknown) or repr(text)}; registered: "
                                         f"{', '.join(STRATEGY_SPECS.names())}")
    return names


def config_label(strategy: str, world: int, overrides: dict) -> str:
    servers = overrides.get("strategy.servers", 1)
    extra = (f" {servers} servers" if servers > 1 else "") + (" block-cyclic" if overrides.get("strategy.block_cyclic")
                                                              else "")
    network = "custom" if overrides.get("cluster.network.profile") == "custom" else "local"
    workload = overrides.get("workload.name")
    if overrides.get("strategy.groups"):
        extra += f" {overrides['strategy.groups']} groups"
    if overrides.get("strategy.mode"):
        extra += f" {overrides['strategy.mode']}"
    if overrides.get("strategy.dp_noise_multiplier"):
        extra += f" dp noise {overrides['strategy.dp_noise_multiplier']}"
    if overrides.get("strategy.schedule"):
        extra += f" {overrides['strategy.schedule']} m{overrides.get('strategy.micro_batches', 4)}"
    if overrides.get("strategy.recompute"):
        extra += f" recompute {overrides['strategy.recompute']}"
    if overrides.get("strategy.local_steps"):
        extra += f" {overrides['strategy.local_steps']} local steps"
    return f"{workload + ' ' if workload else ''}{strategy} x{world} {network}{extra}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, default=None,
                        help="predict with this profile instead of calibrating first (with --rescore: instead "
                             "of the saved one)")
    parser.add_argument("--quick-calibration", action="store_true", help="calibrate with 3 repeats, not 5")
    parser.add_argument("--steps", type=int, default=12, help="the fewest steps a configuration runs (default 12)")
    parser.add_argument("--min-run-s", type=float, default=MIN_RUN_S,
                        help="run each configuration enough steps (beyond --steps) that its timed steps last about "
                             f"this long at its predicted step (default {MIN_RUN_S}; 0: --steps for all)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="run each configuration this many times: compared with the median run, judged "
                             "against the repeats' spread (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help="one repeat and a quick calibration: a smoke run (no spread, so no row is judged)")
    parser.add_argument("--only", type=strategy_list, default=None, metavar="STRATEGY[,..]",
                        help="just these strategies' configurations, from every set (with --cnn: the CNN set's)")
    parser.add_argument("--all", action="store_true",
                        help="every set but --cnn's, and a row for each strategy no set covers")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every row here, with the calibration, configs and facts that predicted it")
    parser.add_argument("--servers", action="store_true",
                        help="also run parameter servers sharded over 2 server ranks (reported apart)")
    parser.add_argument("--only-servers", action="store_true", help="run just the --servers configurations")
    parser.add_argument("--cnn", action="store_true", help="run the vision workloads' configurations instead")
    parser.add_argument("--dataparallel", action="store_true",
                        help="also run localsgd, diloco, cocod, hpsgd, osp and gossip (reported apart; give "
                             "--steps of at least twice diloco's period of 20, so that averages are in the mean)")
    parser.add_argument("--only-dataparallel", action="store_true", help="run just the --dataparallel ones")
    parser.add_argument("--modelparallel", action="store_true",
                        help="also run pipeline, tp (and a one-process reference) on a small GPT and partitioned "
                             "on the digits, reported apart")
    parser.add_argument("--only-modelparallel", action="store_true", help="run just the --modelparallel ones")
    parser.add_argument("--no-kernels", action="store_true",
                        help="price forward and backward from FLOPs and bytes at the calibrated rates, not from "
                             "each workload's own kernels timed alone on this machine (predict-run's default)")
    parser.add_argument("--rescore", type=Path, default=None, metavar="JSON",
                        help="run nothing: predict the runs a --json file holds again, with this code")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.quick_calibration = 1, True
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be at least 1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.rescore:
        return rescore(args.rescore, kernels=not args.no_kernels, calibration=args.calibration)

    from ddlscope.analysis.summary import summarize
    from ddlscope.calibrate import calibrate, load_profile, workload_facts, write_profile
    from ddlscope.predict.local import measured_from_summary
    from ddlscope.runtime.config import experiment_to_dict, load_experiment
    from ddlscope.runtime.launcher import launch
    from ddlscope.store import Store

    console = Console(width=WIDTH)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ddlscope-predict-local-") as tmp:
        if args.calibration:
            profile = load_profile(args.calibration)
        else:
            profile = calibrate([2, 3, 4], quick=args.quick_calibration)
            write_profile(profile, Path(tmp) / "calibration.toml")
        db = Path(tmp) / "bench.db"
        rows = []
        configs = selected_configs(args)
        for strategy, world, extra in configs:
            base = {} if "workload.name" in extra else WORKLOAD
            overrides = {**base, "strategy.name": strategy, "cluster.world_size": world,
                         "workload.steps": args.steps, **extra}
            exp = load_experiment(None, overrides)
            label = config_label(strategy, world, extra)
            repeats = []
            for repeat in range(args.repeats):
                # Each repeat is predicted from the kernels timed right before it: this machine's speed drifts
                # by a fifth within a minute (the GPT's forward and backward alone timed 99 ms in one --all run
                # and 135 ms in the next, where the runs they predicted stepped 91 and 101 ms), and a timing
                # minutes from its run read that drift as the predictor's error. Session 20: every pipeline
                # row -14..-29% off one timing of the GPT for all five.
                facts = workload_facts(experiment_to_dict(exp), time_kernels=not args.no_kernels)
                if repeat == 0 and args.min_run_s > 0:
                    exp = load_experiment(None, {**overrides, "workload.steps": run_steps(exp, facts, profile, args)})
                result = launch(exp, db)
                if result.status != "finished":  # e.g. another launch on this machine took the same free port
                    console.print(f"{label}: {result.status} ({result.error}); retrying once")
                    result = launch(exp, db)
                if result.status != "finished":
                    console.print(f"{label}: {result.status} {result.error}")
                    continue
                with Store(db) as store:
                    run = store.get_run(result.run_id)
                    measured = measured_from_summary(summarize(store, run).to_dict())
                repeats.append(predicted_repeat(run.config, run.environment, facts, measured, profile))
            if not repeats:
                continue
            # The repeat with the median error: this machine's noise between identical runs is not the
            # predictor's error.
            row = median_repeat(repeats)
            group = config_group(strategy, world, extra)
            rows.append({"config": label, "strategy": strategy, "target_set": group == "standard", "group": group,
                         **row, "measured_step_s_repeats": [r["measured"]["step_s"] for r in repeats],
                         "repeats": repeats})
            steps_ms = sorted(r["measured"]["step_s"] * 1e3 for r in repeats)
            errors = sorted(r["error"]["step_s_error"] * 100 for r in repeats)
            console.print(f"{label} ({exp.workload.steps} steps): step {row['predicted']['step_s'] * 1e3:.2f} ms predicted, "
                          f"{row['measured']['step_s'] * 1e3:.2f} ms measured, {errors[len(errors) // 2]:+.1f}%"
                          + (f" (repeats {steps_ms[0]:.2f}-{steps_ms[-1]:.2f} ms, each against its own kernel "
                             f"timing {errors[0]:+.1f}..{errors[-1]:+.1f}%)" if len(repeats) > 1 else ""))

    step_mape, mem_mape = print_results(console, rows)
    console.print(f"{len(rows)}/{len(configs)} configs in {time.perf_counter() - began:.0f}s, {args.repeats} "
                  f"repeat(s) each; load average at the end {load_average()}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "step_mape_pct": step_mape, "memory_mape_pct": mem_mape,
                                         "repeats": args.repeats, "min_run_s": args.min_run_s,
                                         "load_average": load_average(),
                                         "calibration": profile}, default=str))
    return 0 if rows else 1


def rescore(path: Path, kernels: bool = True, calibration: Path | None = None) -> int:
    """The runs of an earlier --json, predicted again by this code from the same calibration (or
    `calibration`'s: e.g. one with probes the saved one predates) and the kernel times saved with them
    (timed now for a file from before kernel timing). Each repeat is predicted from its own kernel timing
    where the file has one a repeat."""
    from ddlscope.calibrate import facts_key, load_profile, workload_facts

    saved = json.loads(path.read_text())
    if calibration is not None:
        saved["calibration"] = load_profile(calibration)
    rows, facts_cache = [], {}
    for row in saved["rows"]:
        key = facts_key(row["run_config"])
        if key not in facts_cache:  # the FLOPs and ops, and kernels timed now for a file that has none
            timed = (row.get("facts") or {}).get("kernels")
            facts_cache[key] = workload_facts(row["run_config"], time_kernels=kernels and not timed)
        # files from before each repeat had its own timing: the row's one timing, against its median run
        repeats = row.get("repeats") or [row]
        again = []
        for r in repeats:
            timed = (r.get("facts") or {}).get("kernels")
            facts = {**facts_cache[key], **({"kernels": timed} if kernels and timed else {})}
            again.append(predicted_repeat(r["run_config"], r["environment"], facts, r["measured"],
                                          saved["calibration"]))
        rows.append({**row, **median_repeat(again), "repeats": again})
    print_results(Console(width=WIDTH), rows)
    return 0


def run_steps(exp, facts: dict, profile: dict, args: argparse.Namespace) -> int:
    """Steps enough that a run's timed steps last about --min-run-s at its predicted step (from `facts`, its
    first repeat's), at least --steps, at most MAX_RUN_STEPS. This machine's speed varies on a scale of
    seconds: one process stepping the digits' MLP for 2 minutes, its mean step over windows of 0.1 / 0.5 /
    1 / 2 / 5 s spread 24 / 17 / 14 / 12 / 10% (10th to 90th percentile), and consecutive seconds
    correlated 0.41, seconds 5 apart 0.08. Twelve steps of a 15 ms step drew one tenth of a second of
    that: three repeats a minute apart stepped 11.8, 16.1 and 15.0 ms."""
    from ddlscope.predict.local import predict_local
    from ddlscope.runtime.config import experiment_to_dict
    from ddlscope.runtime.launcher import run_environment

    step_s = predict_local(experiment_to_dict(exp), run_environment(exp), facts, profile)["step_s"]
    # + 1: step 0 (the warm-up) is not in the measured mean
    return max(args.steps, min(MAX_RUN_STEPS, math.ceil(args.min_run_s / step_s) + 1))


def predicted_repeat(run_config: dict, environment: dict, facts: dict, measured: dict, profile: dict) -> dict:
    """One repeat of a configuration, predicted from its own facts and compared with its own measurement."""
    from ddlscope.predict.local import compare, predict_local

    predicted = predict_local(run_config, environment, facts, profile)
    return {"predicted": predicted, "measured": measured, "error": compare(predicted, measured),
            # enough to predict the repeat again offline (another model, the same runs)
            "run_config": run_config, "environment": environment, "facts": facts}


def median_repeat(repeats: list[dict]) -> dict:
    """The repeat whose step-time error is the median of the repeats' (the upper one of an even count)."""
    ordered = sorted(repeats, key=lambda r: r["error"]["step_s_error"])
    return ordered[len(ordered) // 2]


def mape(rows: list[dict], key: str) -> float:
    return statistics.fmean(abs(r["error"][key]) for r in rows) * 100 if rows else float("nan")


def load_average() -> str:
    """The machine's 1/5/15-minute load averages, quoted beside every figure (this machine is shared)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def spread_ms(row: dict) -> tuple[float, float] | None:
    """(min, max) of the row's repeats' measured step times in ms; None with one repeat."""
    repeats = row.get("measured_step_s_repeats") or []
    return (min(repeats) * 1e3, max(repeats) * 1e3) if len(repeats) > 1 else None


def within_noise(row: dict) -> bool | None:
    """Whether the prediction lies inside the repeats' measured min..max (None: one repeat, nothing to judge)."""
    spread = spread_ms(row)
    if spread is None:
        return None
    return spread[0] <= row["predicted"]["step_s"] * 1e3 <= spread[1]


def row_strategy(row: dict) -> str:
    """The row's strategy (rows saved before the key existed: the first word of the label after the workload)."""
    return row.get("strategy") or row["run_config"]["strategy"]["name"]


def per_strategy(rows: list[dict]) -> dict[str, list[float]]:
    """|step error| of each strategy's rows, by strategy in the rows' order."""
    errors: dict[str, list[float]] = {}
    for r in rows:
        errors.setdefault(row_strategy(r), []).append(abs(r["error"]["step_s_error"]))
    return errors


# A rank's forward and backward ran 1.01-1.08x its thread CPU time on a quiet machine, 1.5-2x beside the test suite
DISTURBED_WALL_OVER_CPU = 1.1


def print_results(console: Console, rows: list[dict]) -> tuple[float, float]:
    table = Table("config", "step pred ms", "step meas ms (min..max)", "err", "noise", "compute wall/CPU",
                  "states pred B", "states meas B", "err", title="local predictor vs measured (the median repeat)")
    for r in rows:
        p, m, e = r["predicted"], r["measured"], r["error"]
        spread = spread_ms(r)
        noise = {None: "-", True: "within", False: "outside"}[within_noise(r)]
        ratio = m.get("compute_wall_over_cpu")
        table.add_row(r["config"], f"{p['step_s'] * 1e3:.2f}",
                      f"{m['step_s'] * 1e3:.2f}" + (f" ({spread[0]:.2f}..{spread[1]:.2f})" if spread else ""),
                      f"{e['step_s_error'] * 100:+.1f}%", noise, "-" if ratio is None else f"{ratio:.2f}",
                      str(p["model_state_bytes"]), str(m["model_state_bytes"]), f"{e['model_state_error'] * 100:+.1f}%")
    console.print(table)
    disturbed = [r["config"] for r in rows if (r["measured"].get("compute_wall_over_cpu") or 0) > DISTURBED_WALL_OVER_CPU]
    if disturbed:
        console.print(f"{len(disturbed)} row(s) computed over {DISTURBED_WALL_OVER_CPU}x their CPU time (other work "
                      f"took turns on the cores, or more ranks than cores): {', '.join(disturbed)}")
    targeted = [r for r in rows if r.get("target_set", True)]
    step_mape = mape(targeted, "step_s_error")
    mem_mape = mape(targeted, "model_state_error")
    if targeted:
        step_median = statistics.median(abs(r["error"]["step_s_error"]) for r in targeted) * 100
        console.print(f"step time MAPE {step_mape:.1f}% (target <= 10%), median {step_median:.1f}%   model-state "
                      f"memory MAPE {mem_mape:.1f}% (target <= 5%), over the {len(targeted)} standard configurations")
    for group in ("sharded servers", "dataparallel", "modelparallel", "other strategies"):
        others = [r for r in rows if not r.get("target_set", True) and r.get("group", "sharded servers") == group]
        if others:
            console.print(f"{group} ({len(others)} configurations, no target): step time MAPE "
                          f"{mape(others, 'step_s_error'):.1f}%, model-state memory MAPE "
                          f"{mape(others, 'model_state_error'):.1f}%")
    print_per_strategy(console, rows)
    return step_mape, mem_mape


def print_per_strategy(console: Console, rows: list[dict]) -> None:
    """Issue 38's judgement: per strategy the median |step error| of its rows (target <= 10%), the worst
    strategy's (target <= 15%), and how many rows lie inside their repeats' spread."""
    errors = per_strategy(rows)
    table = Table("strategy", "rows", "median |err|", "worst |err|", "within noise", title="per strategy")
    for name, errs in errors.items():
        judged = [within_noise(r) for r in rows if row_strategy(r) == name]
        noise = f"{sum(1 for j in judged if j)}/{sum(1 for j in judged if j is not None)}"
        table.add_row(name, str(len(errs)), f"{statistics.median(errs) * 100:.1f}%", f"{max(errs) * 100:.1f}%", noise)
    console.print(table)
    medians = {name: statistics.median(errs) * 100 for name, errs in errors.items()}
    worst = max(medians, key=medians.__getitem__)
    over = sorted(n for n, m in medians.items() if m > 10)
    console.print(f"per-strategy median |error|: worst {worst} {medians[worst]:.1f}% (target <= 15%); above 10%: "
                  f"{', '.join(over) or 'none'} ({len(medians)} strategies)")


if __name__ == "__main__":
    sys.exit(main())
