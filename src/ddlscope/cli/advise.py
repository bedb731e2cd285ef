"""`advise`: rank DDP, FSDP and the parameter-server strategies for an experiment on a GPU cluster.

Bad input raises `ddlscope.specs.ConfigError`; the CLI's main() prints its one-line message
and exits with status 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ddlscope.cli.common import DEFAULT_DB, JsonOption, cluster_from_text, db_option, wide_when_piped
from ddlscope.specs import ConfigError

PIPED_WIDTH = 140  # the ranking table's nine columns: one line per strategy in a log or a file


def advise_command(
    config: Annotated[Optional[Path], typer.Argument(help="TOML experiment file (as for `ddlscope run`).")] = None,
    cluster: Annotated[Optional[str], typer.Option("--cluster", help="NAME:NODESxGPUS_PER_NODE, e.g. a100-80gb:4x8 "
                                                   "(local:1xN: this machine as calibrated); workers = its GPUs.")] = None,
    stragglers: Annotated[float, typer.Option("--stragglers", help="One worker this many times slower (1 = none).")] = 1.0,
    sustained_fraction: Annotated[Optional[float], typer.Option(
        "--sustained-fraction", help="Scale the published kernel rates by what your stack sustains (catalogue: "
                                     "1; see `ddlscope predict --measured-step-s`).")] = None,
    stack: Annotated[Optional[str], typer.Option(
        "--stack", help="A named software stack (catalogue.toml \\[stacks]; default ideal, today's kernel ceiling): "
                        "its one efficiency figure, from one named published run, scales the kernel rates; "
                        "--sustained-fraction replaces it with your own.")] = None,
    workload: Annotated[Optional[str], typer.Option("--workload", "-w", help="Workload name (overrides the file).")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", help="A CNN priced from its layer list instead of the workload: resnet50, vgg16, densenet121 "
                        "(the experiment still gives batch size, optimizer and steps).")] = None,
    image_size: Annotated[Optional[int], typer.Option("--image-size", help="With --model: 224 or 32.")] = None,
    classes: Annotated[Optional[int], typer.Option("--classes", help="With --model: output classes.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps of the experiment.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Global batch size (split over the cluster's GPUs).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override any field: section.key=value (repeatable).")] = None,
    db: Annotated[Path, db_option("SQLite store with local runs (for the staleness penalty).")] = DEFAULT_DB,
    as_json: JsonOption = False,
    calibration: Annotated[Optional[Path], typer.Option(
        "--calibration", help="For a local:1xN cluster: profile TOML from `ddlscope calibrate` "
                              "(default: the newest in the store, else ./ddlscope-calibration.toml).")] = None,
) -> None:
    """Rank the registered strategies (ddp, fsdp, the parameter servers, local SGD and its relatives, ...) for an
    experiment on a GPU cluster, and explain."""
    from ddlscope.predict import get_stack

    the_stack = get_stack(stack, "--stack")  # before the imports that load torch: bad input refused at once
    from ddlscope.advise import advise
    from ddlscope.runtime.config import load_experiment, parse_override

    if not cluster:
        raise ConfigError("--cluster is required, e.g. --cluster a100-80gb:4x8")
    the_cluster = cluster_from_text(cluster, calibration, db)  # fail fast, before building anything
    if sustained_fraction is not None:
        the_cluster = the_cluster.with_sustained_fraction(sustained_fraction)
    elif the_stack.has_figure:
        the_cluster = the_cluster.with_sustained_fraction(the_stack.sustained_fraction)
    overrides: dict[str, Any] = {}
    for key, value in (("workload.name", workload), ("workload.steps", steps), ("workload.batch_size", batch_size)):
        if value is not None:
            overrides[key] = value
    for item in set_ or []:
        key, value = parse_override(item)
        overrides[key] = value
    # The local cluster section describes `ddlscope run`'s ranks, not the target cluster: keep it out of the way.
    overrides.setdefault("cluster.world_size", 1)
    if model is None and (image_size is not None or classes is not None):
        raise ConfigError("--image-size and --classes go with --model (resnet50, vgg16, densenet121)")
    if model is not None:
        overrides.setdefault("name", model)
    exp = load_experiment(config, overrides)
    profile = None
    if model is not None:
        from ddlscope.advise import cnn_workload_profile

        profile = cnn_workload_profile(exp, model, the_cluster.n_gpus, image_size if image_size is not None else 224,
                                       classes if classes is not None else 1000)
    result = advise(exp, the_cluster, stragglers=stragglers, db=db, profile=profile)
    if as_json:
        out = result.to_dict()
        out["stack"] = the_stack.to_dict("your measurement" if sustained_fraction is not None else None,
                                         the_cluster.device.efficiency.sustained_fraction)
        print(json.dumps(out, default=str))
        return
    if the_stack.has_figure and sustained_fraction is None:
        print(f"stack {the_stack.name}: sustained_fraction {the_stack.sustained_fraction:.3f} from one published run: "
              f"{the_stack.figure_run} ({the_stack.figure_source})")
    _print(result)


def _print(result: Any) -> None:
    from ddlscope.advise import duration_text

    with wide_when_piped(PIPED_WIDTH) as out:
        out.print(f"[bold]{escape(str(result.experiment))}[/bold] ({escape(str(result.workload['name']))}, "
                  f"{result.workload['params'] / 1e6:.4g}M parameters) on {escape(str(result.cluster))}: {result.workers} workers"
                  + (f", one {result.stragglers:g}x slower" if result.stragglers > 1 else ""))
        table = Table("#", "strategy", "step", "comm (waited)", "samples/s", "GiB/GPU", "fits", "$/step", "experiment")
        for r in result.strategies:
            table.add_row(str(r.rank), escape(r.strategy), _ms(r.step_s), f"{_ms(r.comm_s)} ({_ms(r.exposed_comm_s)})",
                          f"{r.samples_per_s:.4g}", f"{r.memory_gib_per_gpu:.3g}", "yes" if r.fits else "[red]no[/red]",
                          f"{r.cost_usd_per_step:.3g}", duration_text(r.experiment_time_s))
        out.print(table)
        for r in result.strategies:
            if not r.synchronous:
                out.print(f"staleness penalty, {r.strategy}: {r.staleness_penalty}", markup=False, highlight=False)
        out.print(f"[bold]recommendation: {escape(str(result.recommendation))}[/bold]")
        for reason in result.reasons:
            out.print(f"- {reason}", markup=False, highlight=False)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
