"""`ddlscope study beyond`: what lies beyond data parallelism on one cluster, one section per idea.

The study is a list of sections (SECTIONS). A section is anything with a
`name`, `cells(quick)` (the runs it needs, possibly none) and `analyse(results,
quick)` returning a SectionReport (its table, headlines, decisions, notes); a
section that only predicts is a function wrapped by `predicted(name, fn)`.
Adding one is one line in SECTIONS. The study runs every section's cells
through the usual resumable runner (each cell labelled with its section),
hands each section back its own results, and joins their reports.

Sections here:
- federated (PAPERS.md item 5): FedAvg against the per-block predictors
  (MM-PSGD, MC-PSGD) on block-cyclic data, accuracy per block; the full study
  adds iid and Dirichlet references, client sampling and unbalanced clients.
- graph (PAPERS.md item 4): dense vs sparse vs node-parallel attention at three graph sizes, measured by
  the section itself (studies/beyond_graph.py).
- data (PAPERS.md item 6): the Parquet input pipeline vs the naive loader (studies/beyond_data.py).
- burst (PAPERS.md item 8): per-unit data-parallel degrees against uniform data
  parallelism, predicted step time and cluster throughput with a background job.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ddlscope.studies import STUDIES
from ddlscope.studies.base import Cell, CellResult, Findings, Study, build_cell, measurement_notes


@dataclass
class SectionReport:
    """What one section contributes to the study's findings."""

    title: str
    table: list[str]  # text lines, the section's table
    headlines: list[dict[str, str]] = field(default_factory=list)  # headline, paper, measured, predicted, verdict
    decisions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # the numbers behind the table (Findings.extra)


class Section(Protocol):
    name: str

    def cells(self, quick: bool) -> list[Cell]: ...

    def analyse(self, results: list[CellResult], quick: bool) -> SectionReport: ...


@dataclass
class predicted:  # noqa: N801 (used like a function: `predicted("burst", burst_section)`)
    """A section that stores no runs: `fn(quick)` makes its report (a prediction, or a measurement the
    section takes in-process)."""

    name: str
    fn: Callable[[bool], SectionReport]

    def cells(self, quick: bool) -> list[Cell]:
        return []

    def analyse(self, results: list[CellResult], quick: bool) -> SectionReport:
        return self.fn(quick)


# ---------------------------------------------------------------------------- federated
FEDERATED_WORLD = 2  # clients: one rank each, one per core here
FEDERATED_WORKLOAD = {"name": "mlp-digits", "batch_size": 32, "lr": 0.1, "steps": 16, "eval_every": 4}
BLOCK_CYCLIC = {"partition": "block-cyclic", "blocks": 2, "rounds_per_block": 2, "block_purity": 0.9}


def federated_cell(key: str, strategy: str, **knobs: Any) -> Cell:
    raw = {"seed": 0, "workload": dict(FEDERATED_WORKLOAD), "cluster": {"world_size": FEDERATED_WORLD},
           "strategy": {"name": strategy, **knobs}}
    return build_cell(f"federated/{key}", {"section": "federated", "strategy": strategy, "variant": key}, raw)


class FederatedSection:
    """FedAvg vs MM-PSGD vs MC-PSGD on block-cyclic digits: accuracy per block."""

    name = "federated"

    def cells(self, quick: bool) -> list[Cell]:
        cells = [federated_cell(f"{s}/block-cyclic", s, **BLOCK_CYCLIC) for s in ("fedavg", "mm-psgd", "mc-psgd")]
        if not quick:
            cells += [federated_cell("fedavg/iid", "fedavg"),
                      federated_cell("fedavg/dirichlet-0.3", "fedavg", partition="dirichlet", alpha=0.3),
                      federated_cell("fedavg/block-cyclic/sampled-unbalanced", "fedavg", client_fraction=0.5,
                                     size_skew=1.0, **BLOCK_CYCLIC),
                      federated_cell("mm-psgd/block-cyclic/sampled-unbalanced", "mm-psgd", client_fraction=0.5,
                                     size_skew=1.0, **BLOCK_CYCLIC)]
        return cells

    def analyse(self, results: list[CellResult], quick: bool) -> SectionReport:
        rows = [self._row(r) for r in results]
        blocks = BLOCK_CYCLIC["blocks"]
        header = (f"{'cell':44} {'predictor':14} " + " ".join(f"{'block ' + str(b):>8}" for b in range(blocks))
                  + f" {'mean':>7} {'test acc':>8} {'round ms':>9}")
        table = [header]
        for row in rows:
            for predictor, by_block in row["per_block"].items():
                cells = " ".join(f"{by_block.get(b, float('nan')):8.3f}" for b in range(blocks))
                mean = statistics.fmean(by_block.values()) if by_block else float("nan")
                table.append(f"{row['key']:44} {predictor:14} {cells} {mean:7.3f} {_f(row['accuracy'])} "
                             f"{_f(row['round_s'], 1e3, 9, 1)}")
        report = SectionReport("Federated: FedAvg vs per-block predictors on block-cyclic data", table,
                               data={"cells": rows})
        fedavg = _find(rows, "federated/fedavg/block-cyclic")
        for strategy in ("mm-psgd", "mc-psgd"):
            mine = _find(rows, f"federated/{strategy}/block-cyclic")
            if fedavg and mine and "global" in fedavg["per_block"] and "per-block" in mine["per_block"]:
                report.headlines.append(self._versus(strategy, mine, fedavg))
        if fedavg and "global" in fedavg["per_block"]:
            worst = min(fedavg["per_block"]["global"].items(), key=lambda kv: kv[1])
            report.decisions.append(
                f"FedAvg's one model is biased toward the block it trained last: block {worst[0]} gets "
                f"{worst[1]:.1%}; keep one predictor per block when client data cycle (MM-PSGD costs no training).")
        mm = _find(rows, "federated/mm-psgd/block-cyclic")
        if mm and {"last-in-block", "per-block"} <= set(mm["per_block"]):
            last, average = (statistics.fmean(mm["per_block"][p].values()) for p in ("last-in-block", "per-block"))
            if last > average:
                report.decisions.append(
                    f"With few cycles, MM-PSGD's average over cycles keeps the early, weak models: the model that "
                    f"last left each block scored {last:.1%} on average against the average's {average:.1%}.")
        report.notes.append(
            f"{FEDERATED_WORLD} clients (one rank each), {FEDERATED_WORKLOAD['name']}, {FEDERATED_WORKLOAD['steps']} "
            f"rounds of one local epoch (minibatch {FEDERATED_WORKLOAD['batch_size']}); block-cyclic: "
            f"{BLOCK_CYCLIC['blocks']} blocks (digits 0-4, 5-9) of {BLOCK_CYCLIC['rounds_per_block']} rounds, "
            f"{BLOCK_CYCLIC['block_purity']:.0%} of a block's samples from its own digits; block b's accuracy is "
            "on the test digits assigned to block b by the same rule.")
        report.notes.append("Predictors: global = the final model; last-in-block = the global model as it left "
                            "the block last; mm = MM-PSGD's average over cycles; chain = MC-PSGD's separate "
                            "chain; per-block = each strategy's own choice.")
        return report

    @staticmethod
    def _row(r: CellResult) -> dict[str, Any]:
        per_block: dict[str, dict[int, float]] = {}
        for e in r.summary.block_evals:
            per_block.setdefault(e["predictor"], {})[int(e["block"])] = float(e["accuracy"])
        final = r.summary.final_eval
        return {"key": r.cell.key, "strategy": r.cell.labels["strategy"], "per_block": per_block,
                "accuracy": final["metric"] if final and final["metric_name"] == "accuracy" else None,
                "round_s": r.summary.effective_step_s}

    @staticmethod
    def _versus(strategy: str, mine: dict[str, Any], fedavg: dict[str, Any]) -> dict[str, str]:
        ours, theirs = mine["per_block"]["per-block"], fedavg["per_block"]["global"]
        gain = statistics.fmean(ours.values()) - statistics.fmean(theirs.values())
        worst_gain = min(ours.values()) - min(theirs.values())
        return {"headline": f"{strategy} vs FedAvg, block-cyclic data",
                "paper": "per-block predictors beat one FedAvg model on block-cyclic data (Ding et al.)",
                "measured": ("per block " + ", ".join(f"{ours[b]:.1%} vs {theirs.get(b, float('nan')):.1%}"
                                                      for b in sorted(ours))
                             + f"; mean {gain * 100:+.1f} points, worst block {worst_gain * 100:+.1f} points"),
                "predicted": "-",
                "verdict": "agrees" if gain > 0 and worst_gain > 0 else "differs here"}


# ---------------------------------------------------------------------------- burst
# (model, global batch, cluster): strong scaling, where burst parallelism pays (DeepPool's setting), and
# a large per-GPU batch, where it should not.
BURST_CASES_QUICK = (("vgg16", 64, "a100-80gb:4x8"), ("vgg16", 1024, "a100-80gb:4x8"), ("resnet50", 64, "a100-80gb:4x8"))
BURST_CASES_FULL = BURST_CASES_QUICK + (("densenet121", 64, "a100-80gb:4x8"), ("vgg16", 64, "paper-slow:4x4"),
                                        ("resnet50", 256, "paper-slow:4x4"))


def burst_section(quick: bool) -> SectionReport:
    """Predicted: uniform data parallelism against the fastest burst plan and the plan of highest cluster
    throughput (predict/burst.py), on a few CNNs and clusters."""
    from ddlscope.predict.burst import burst, degree_runs
    from ddlscope.predict.catalogue import parse_cluster
    from ddlscope.predict.cnn import CNNSpec

    table = [f"{'model':12} {'batch':>5} {'cluster':18} {'uniform ms':>10} {'burst ms':>9} {'gain':>6} "
             f"{'DDP ms':>8} {'vs DDP':>6} {'freed*':>7} {'cluster thr.*':>13}  fastest plan (units: GPUs)"]
    data = []
    for model, batch, cluster in (BURST_CASES_QUICK if quick else BURST_CASES_FULL):
        r = burst(CNNSpec(model, batch), parse_cluster(cluster))
        data.append(r.to_dict())
        table.append(f"{model:12} {batch:5d} {cluster:18} {r.uniform.step_s * 1e3:10.3f} "
                     f"{r.fastest.step_s * 1e3:9.3f} {r.fastest.speedup_vs_uniform:5.2f}x "
                     f"{_f(r.ddp_step_s, 1e3, 8, 3)} {_ratio(r.ddp_step_s, r.fastest.step_s)} "
                     f"{r.best_cluster.freed_fraction:7.1%} {r.best_cluster.cluster_throughput:13.3f}  "
                     f"{degree_runs(r.fastest.degrees)}")
    table.append("* the plan of highest cluster throughput whose step is not slower than uniform's; the freed "
                 "GPU-seconds run a background job")
    gains = [d["fastest"]["speedup_vs_uniform"] for d in data]
    throughputs = [d["best_cluster"]["cluster_throughput"] for d in data]
    headline = {"headline": "Burst parallelism vs uniform data parallelism",
                "paper": "DeepPool: 1.2-2.3x cluster throughput from bursts of GPUs for the layers that scale",
                "measured": "-",
                "predicted": (f"step gain {min(gains):.2f}-{max(gains):.2f}x, cluster throughput "
                              f"{min(throughputs):.2f}-{max(throughputs):.2f} (background job on the freed GPUs)"),
                "verdict": ("agrees where layers scale unevenly (small per-GPU batch, large classifier)"
                            if max(throughputs) >= 1.2 else "smaller than the paper's")}
    decisions = ["Give the fully connected layers of a VGG-like network fewer GPUs at small per-GPU batches: "
                 "their gradient all-reduce costs more than their compute saves (`ddlscope plan --burst`)."]
    notes = ["Burst numbers are predictions (predict/burst.py) on the catalogue's GPUs; gradient all-reduces "
             "exposed for uniform and burst alike, DDP's overlapped step beside them; the cluster throughput "
             "assumes the background job uses every freed GPU-second and the job is not slowed."]
    return SectionReport("Burst parallelism: per-unit data-parallel degrees (predicted)", table, [headline],
                         decisions, notes, {"cases": data})


def graph_report(quick: bool) -> SectionReport:
    """Measured in-process (studies/beyond_graph.py): dense vs sparse vs node-parallel sparse attention."""
    from ddlscope.studies.beyond_graph import TITLE, graph_section

    rows, table = graph_section(quick)
    largest = max(r["nodes"] for r in rows)
    at = {r["attention"]: r for r in rows if r["nodes"] == largest}
    dense, sparse, split = at["dense"], at["sparse"], next(r for k, r in at.items() if k.startswith("nodepar"))
    headline = {"headline": "Sparse, node-parallel attention on a growing graph",
                "paper": "attention restricted to edges and sharded by node partition scales to graphs dense "
                         "attention cannot hold",
                "measured": (f"at {largest} nodes: activations {dense['activations MiB']:.1f} MiB dense, "
                             f"{sparse['activations MiB']:.1f} sparse, {split['activations MiB']:.1f} per rank "
                             f"node-parallel; step {dense['step ms']:.1f} / {sparse['step ms']:.1f} / "
                             f"{split['step ms']:.1f} ms"),
                "predicted": "-",
                "verdict": ("agrees: sparse attention saves memory and time, node-parallel halves it per rank"
                            if dense["activations MiB"] > sparse["activations MiB"] > split["activations MiB"]
                            else "differs: see the table")}
    return SectionReport(TITLE, table.splitlines(), [headline], [],
                         ["Graph cells are trained in-process and on a 2-rank gloo group by the section itself "
                          "(not stored as runs); times are this machine's, under whatever else it runs."],
                         {"rows": rows})


def data_report(quick: bool) -> SectionReport:
    """Measured in-process (studies/beyond_data.py): the Parquet pipeline vs the naive loader."""
    from ddlscope.studies.beyond_data import TITLE, data_section

    rows, table = data_section(quick)
    naive, pipeline = rows[0], rows[1]
    headline = {"headline": "Input pipeline vs naive loading on an input-bound workload",
                "paper": "a sharded, prefetching pipeline with decode/augment in workers removes data stalls",
                "measured": (f"{pipeline['samples/s']:.0f} vs {naive['samples/s']:.0f} samples/s, stall "
                             f"{pipeline['stall']:.0%} vs {naive['stall']:.0%}; same batches: "
                             f"{pipeline['same batches']}"),
                "predicted": "-",
                "verdict": ("agrees: fewer stalls, more samples/s" if pipeline["samples/s"] > naive["samples/s"]
                            else "differs: the workers had no free core to run on")}
    return SectionReport(TITLE, table.splitlines(), [headline], [], [], {"rows": rows})


# ---------------------------------------------------------------------------- the study
SECTIONS: list[Section] = [
    FederatedSection(),
    predicted("graph", graph_report),
    predicted("data", data_report),
    predicted("burst", burst_section),
]


@STUDIES.register("beyond")
class BeyondStudy(Study):
    description = ("beyond data parallelism: federated FedAvg vs per-block predictors on block-cyclic data, "
                   "sparse node-parallel graph attention, the Parquet input pipeline, burst parallelism "
                   "(predicted); one section per idea")
    cell_columns = ("step ms", "accuracy", "wall s")

    def __init__(self, workload: str | None = None, sections: list[Section] | None = None):
        super().__init__(workload)
        self.sections = SECTIONS if sections is None else sections

    def cells(self, quick: bool, repeats: int = 1) -> list[Cell]:
        cells = []
        for section in self.sections:
            for cell in section.cells(quick):
                cell.labels.setdefault("section", section.name)
                cells.append(cell)
        return cells

    def analyse(self, results: list[CellResult], quick: bool) -> Findings:
        reports = [section.analyse([r for r in results if r.cell.labels.get("section") == section.name], quick)
                   for section in self.sections]
        text = []
        for report in reports:
            text += [report.title, *report.table, ""]
        return Findings(headlines=[h for r in reports for h in r.headlines],
                        decisions=[d for r in reports for d in r.decisions],
                        notes=measurement_notes(results) + [n for r in reports for n in r.notes],
                        text="\n".join(text),
                        extra={"tables": {r.title: r.table for r in reports},
                               "sections": {s.name: {"title": r.title, "table": r.table, **r.data}
                                            for s, r in zip(self.sections, reports)}})


def _ratio(a: float | None, b: float) -> str:
    return f"{'-':>6}" if a is None else f"{a / b:5.2f}x"


def _find(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    return next((row for row in rows if row["key"] == key), None)


def _f(value: float | None, scale: float = 1.0, width: int = 8, digits: int = 3) -> str:
    return f"{'-':>{width}}" if value is None else f"{value * scale:{width}.{digits}f}"
