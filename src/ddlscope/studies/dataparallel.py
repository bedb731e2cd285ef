"""`ddlscope study dataparallel`: when and with whom workers synchronise, and how much each one computes.

Local SGD, DiLoCo, CoCoD-SGD, HPSGD, OSP and gossip (full study) against DDP (synchronous, every step)
and asynchronous PS (nobody waits), on the main study's workload, emulated
networks and straggler (studies/paper.py: cnn-digits, 100 steps of global
batch 256, so every cell trains on the same samples; the fast and slow
networks `scaled` to the target GPUs' compute). HPSGD also runs with its
momentum lowered for the staleness' implicit momentum (the main study's `mc`
variant). DBS (re-split batches by measured throughput) runs in every regime,
ddp with batches by speed (`+speeds`) and async PS with them and lock-free
updates (`+hogbatch`, Hogbatch) where a straggler makes speeds differ.
The report gives per cell throughput, exposed communication, bytes
per step, accuracy at equal samples and time to the target accuracy, the
papers' claims against what was measured, and which strategy wins in which
regime, with the numbers behind each verdict. --quick keeps every strategy, in fewer regimes and
seeds. The full study also runs DDP with each
gradient compression hook (slow network), localsgd's bf16 average, and DDP's bucket plans (one per
layer, MG-WFBP) on both networks; --quick runs ddp+topk and ddp+mgwfbp on the slow one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddlscope.runtime.config import experiment_to_dict
from ddlscope.studies import STUDIES
from ddlscope.studies.base import Cell, CellResult, Findings, Study, build_cell, measurement_notes, median_or_none
from ddlscope.studies.paper import (
    ACCURACY_SETTINGS, MOMENTUM_COMPENSATED, NETWORKS, QUICK_WORKERS, accuracy_cell, repeated)

# The digits CNN, as `study paper --workload cnn-digits` trains it: synchronisation-bound, where
# cutting synchronisation shows most.
SETTING = ACCURACY_SETTINGS["cnn-digits"]
ACCURACY_WORKLOAD, TARGET_ACCURACY = SETTING.workload, SETTING.target

# The strategies of this study, then its references; "+mc" is the momentum-compensated variant.
SUBJECTS = ("localsgd", "diloco", "cocod", "hpsgd", f"hpsgd+{MOMENTUM_COMPENSATED}", "osp", "gossip")
REFERENCES = ("ddp", "ps-async")
REGIMES = tuple((network, workers) for network in NETWORKS for workers in ("homogeneous", "straggler"))


def cell(name: str, network: str, workers: str, world: int = QUICK_WORKERS, seed: int = 0) -> Cell:
    strategy, _, variant = name.partition("+")
    if (strategy, variant) in KNOB_CELLS:
        return knob_cell(strategy, variant, network, workers, world, seed)
    return accuracy_cell(SETTING, strategy, network, workers, world, variant, seed)


# --- DDP's gradient compression and bucket plans (strategies/compression.py, specs/bucketing.py) -----------
# "ddp+<variant>": DDP with these knobs. Compression is studied on the slow network, where bytes cost;
# bucket plans (MG-WFBP's optimal merge against one bucket per layer; plain ddp is DDP's 25 MB buckets)
# on both networks.
COMPRESSION_KNOBS: dict[str, dict[str, object]] = {
    "fp16": {"comm_hook": "fp16"}, "bf16": {"comm_hook": "bf16"},
    "powersgd": {"comm_hook": "powersgd", "powersgd_rank": 2},
    "topk": {"comm_hook": "topk", "topk_ratio": 0.01}, "qsgd": {"comm_hook": "qsgd", "qsgd_levels": 4},
    "minmax8": {"comm_hook": "minmax8"}}
BUCKET_KNOBS: dict[str, dict[str, object]] = {"per_layer": {"buckets": "per_layer"}, "mgwfbp": {"buckets": "mgwfbp"}}
# "+speeds" splits the batch by the declared speeds, "+hogbatch" also updates lock-free (Hogbatch); localsgd's
# compressed average sends each model's change since the last average in bf16.
KNOB_CELLS: dict[tuple[str, str], dict[str, object]] = {
    **{("ddp", v): knobs for v, knobs in {**COMPRESSION_KNOBS, **BUCKET_KNOBS}.items()},
    ("localsgd", "bf16"): {"compression": "bf16"},
    ("ddp", "speeds"): {"batch_split": "cluster"},
    ("ps-async", "hogbatch"): {"batch_split": "cluster", "lock_free": True},
    ("gossip", "async"): {"mode": "async"},  # asynchronous gossip: studied where it should win, with a straggler
    # private gossip (DP-SGD, PAPERS.md item 11): what the privacy costs in step time and accuracy, and its epsilon
    ("gossip", "dp"): {"dp_noise_multiplier": 1.0, "dp_clip_norm": 1.0},
    ("omnivore", "g2"): {"groups": 2}}  # Omnivore: two compute groups, synchronous inside, asynchronous across
OMNIVORE_WORKERS = 4
SERVERS = ("ps-sync", "ps-async")
QUICK_KNOB_CELLS = ("ddp+topk", "ddp+mgwfbp")  # the quick study's two: on the slow network
TIE_FRACTION = 0.05  # exposed communication this close is one run's noise on a shared machine


def knob_cell(strategy: str, variant: str, network: str, workers: str, world: int = QUICK_WORKERS,
              seed: int = 0) -> Cell:
    """The strategy's accuracy cell with the knobs of `variant` (a compression hook, a bucket plan, a split
    by speed), validated like any config."""
    base = accuracy_cell(SETTING, strategy, network, workers, world, variant, seed)
    raw = experiment_to_dict(base.experiment)
    raw["strategy"] = {**raw["strategy"], **KNOB_CELLS[(strategy, variant)]}
    return build_cell(base.key, base.labels, raw)


def ddp_knob_cells(quick: bool) -> list[Cell]:
    if quick:
        return [cell(name, "slow", "homogeneous") for name in QUICK_KNOB_CELLS]
    return ([cell(f"ddp+{v}", "slow", "homogeneous") for v in COMPRESSION_KNOBS]
            + [cell(f"ddp+{v}", network, "homogeneous") for network in NETWORKS for v in BUCKET_KNOBS]
            + [cell("localsgd+bf16", "slow", "homogeneous")])


# -- heterogeneity-aware batching (issue 20): dbs in every regime; the static split (from the straggler
# profile) only where workers differ, since with equal workers it is its strategy's equal split.
BATCHING = "dbs"
STATIC_SPLITS = ("ddp+speeds", "ps-async+hogbatch")


def batching_cells(quick: bool) -> list[Cell]:
    """dbs and the static splits."""
    if quick:  # the three step times of issue 20 on the fast network (ddp/fast/straggler is there already)
        return [cell(BATCHING, "fast", "straggler"), cell("ddp", "fast", "homogeneous")]
    return ([cell(BATCHING, network, workers) for network, workers in REGIMES]
            + [cell(name, network, "straggler") for network in NETWORKS for name in STATIC_SPLITS])


def repeated_knob_cells(cells: list[Cell], repeats: int) -> list[Cell]:
    """Seeds 1.. of the asynchronous server's knob cells (its order of arrival varies run to run)."""
    return [cell(c.labels["strategy"], c.labels["network"], c.labels["workers"], seed=seed)
            for c in cells if c.labels["strategy"] == "ps-async+hogbatch" for seed in range(1, repeats)]


@STUDIES.register("dataparallel")
class DataParallelStudy(Study):
    description = ("local SGD, DiLoCo, CoCoD-SGD, HPSGD, OSP, gossip, DBS and batches by speed vs DDP and async PS "
                   "on fast/slow networks, with stragglers; DDP's compression hooks and bucket plans")
    cell_columns = ("step ms", "samples/s", "accuracy", "to target s", "wall s", "staleness")

    def cells(self, quick: bool, repeats: int = 1) -> list[Cell]:
        if quick:
            # The slow network is where synchronising less pays; the straggler where waiting costs (ps-async's
            # seeds there are in the main study's quick cells and in the full one here).
            # Every strategy the study is about has a cell (fewer regimes and seeds, not fewer strategies).
            cells = [cell(s, "slow", "homogeneous") for s in ("ddp", "ps-sync", "ps-async", "localsgd", "cocod",
                                                               f"hpsgd+{MOMENTUM_COMPENSATED}", "diloco", "osp", "gossip")]
            cells += [cell(s, "fast", "straggler") for s in ("ddp", "localsgd")]
            cells.append(cell("omnivore+g2", "slow", "straggler", world=OMNIVORE_WORKERS))
        else:
            cells = [cell(s, network, workers) for network, workers in REGIMES for s in REFERENCES + SUBJECTS]
            cells += [cell("gossip+async", network, "straggler") for network in NETWORKS]
            cells.append(cell("gossip+dp", "fast", "homogeneous"))
            # Omnivore needs 4 workers for groups to be neither ps-sync (1 group) nor ps-async (a group a
            # worker): 2 groups of 2 against both servers at the same size, slow network, one straggler.
            cells += [cell(s, "slow", "straggler", world=OMNIVORE_WORKERS) for s in ("omnivore+g2", *SERVERS)]
        cells += ddp_knob_cells(quick)
        # The knob cells' seeds come from repeated_knob_cells: `repeated` rebuilds a cell without its knobs.
        batching = batching_cells(quick)
        return cells + batching + repeated(SETTING, cells, repeats) + repeated_knob_cells(batching, repeats)

    def analyse(self, results: list[CellResult], quick: bool) -> Findings:
        return _Analysis(results).findings()


@dataclass
class Measured:
    """One cell's numbers (medians over its seeds)."""

    strategy: str
    step_s: float | None
    samples_per_s: float | None
    exposed_comm_s: float | None
    bytes_per_step: float | None
    accuracy: float | None
    to_target_s: float | None
    wall_s: float | None
    seeds: int


class _Analysis:
    def __init__(self, results: list[CellResult]):
        self.results = results
        groups: dict[tuple[str, str, str], list[CellResult]] = {}
        for r in results:
            labels = r.cell.labels
            # Cells at another worker count than the study's 2 (omnivore's comparison at 4) keep it in their
            # name: their seeds must not pool with the 2-worker cells of the same strategy.
            world = labels.get("world_size", QUICK_WORKERS)
            name = labels["strategy"] if world == QUICK_WORKERS else f"{labels['strategy']} x{world}"
            groups.setdefault((name, labels["network"], labels["workers"]), []).append(r)
        self.cells = {key: _measure(key[0], members) for key, members in groups.items()}

    def get(self, strategy: str, network: str, workers: str = "homogeneous") -> Measured | None:
        return self.cells.get((strategy, network, workers))

    def findings(self) -> Findings:
        headlines = [h for h in (self._local_sgd(), self._cocod(), self._hpsgd(), self._osp(), self._diloco(),
                                 self._compression(), self._buckets("fast"), self._buckets("slow"),
                                 self._dbs(), self._static_split(), self._private_gossip()) if h]
        regimes = self._regimes()
        decisions = [line for _, line in regimes]
        table = self._table()
        text = "\n".join(table + [""] + [f"- {h['headline']}: paper: {h['paper']} | measured: {h['measured']} | "
                                        f"{h['verdict']}" for h in headlines]
                         + ["", "Which strategy wins where:"] + [f"- {d}" for d in decisions])
        notes = measurement_notes(self.results) + [
            f"Same samples in every cell: {ACCURACY_WORKLOAD['steps']} steps x global batch "
            f"{ACCURACY_WORKLOAD['batch_size']}; target accuracy {TARGET_ACCURACY:.0%}; winners are the first to "
            "reach it (time to target on the effective clock), or the most accurate where none does.",
            f"hpsgd+{MOMENTUM_COMPENSATED}: momentum {ACCURACY_WORKLOAD['momentum']} lowered by a one-step delay's "
            "implicit momentum (as for 2 asynchronous workers, studies/paper.py: compensated_momentum)."]
        return Findings(headlines, decisions, notes, text,
                        extra={"regimes": [{"regime": key, "verdict": line} for key, line in regimes],
                               "table": table})

    # -- the summary table ------------------------------------------------------
    def _table(self) -> list[str]:
        lines = [f"{'cell':36} {'step ms':>8} {'samples/s':>9} {'exposed ms':>10} {'KB/step':>8} "
                 f"{'accuracy':>8} {'to 95% s':>8} {'wall s':>7}"]
        for (strategy, network, workers), m in self.cells.items():
            lines.append(f"{strategy + '/' + network + '/' + workers:36} {_f(m.step_s, 1e3, 8, 1)} "
                         f"{_f(m.samples_per_s, 1, 9, 0)} {_f(m.exposed_comm_s, 1e3, 10, 1)} "
                         f"{_f(m.bytes_per_step, 1e-3, 8, 1)} {_f(m.accuracy, 100, 7, 1)}% "
                         f"{_f(m.to_target_s, 1, 8, 1)} {_f(m.wall_s, 1, 7, 1)}")
        return lines

    # -- the papers' claims -----------------------------------------------------
    def _versus(self, mine: str, theirs: str, network: str) -> tuple[Measured, Measured] | None:
        a, b = self.get(mine, network), self.get(theirs, network)
        return (a, b) if a and b and a.step_s and b.step_s and a.accuracy is not None and b.accuracy is not None \
            else None

    def _local_sgd(self) -> dict[str, str] | None:
        pair = self._versus("localsgd", "ddp", "slow")
        if not pair:
            return None
        local, ddp = pair
        ratio = local.step_s / ddp.step_s
        points = (local.accuracy - ddp.accuracy) * 100
        measured = (f"slow network: step {local.step_s * 1e3:.1f} ms vs DDP's {ddp.step_s * 1e3:.1f} ms "
                    f"({ratio:.2f}x), {_kb(local.bytes_per_step)} vs {_kb(ddp.bytes_per_step)} a step, accuracy "
                    f"{local.accuracy:.1%} vs {ddp.accuracy:.1%} ({points:+.1f} points)")
        verdict = ("agrees: fewer all-reduces, faster steps, accuracy within 2 points" if ratio < 1 and points > -2
                   else "partly: faster, but accuracy fell by more than 2 points" if ratio < 1
                   else "differs: not faster than DDP here")
        return {"headline": "Local SGD vs DDP", "paper": "averaging every H steps cuts communication H-fold at "
                "little accuracy cost for small H (Lin et al. 2020)", "measured": measured, "verdict": verdict}

    def _cocod(self) -> dict[str, str] | None:
        pair, local = self._versus("cocod", "ddp", "slow"), self.get("localsgd", "slow")
        if not pair:
            return None
        cocod, ddp = pair
        speedup = ddp.step_s / cocod.step_s
        measured = (f"slow network, 2 workers: {speedup:.2f}x DDP's throughput, exposed communication "
                    f"{_ms(cocod.exposed_comm_s)} a step vs DDP's {_ms(ddp.exposed_comm_s)}"
                    + (f" and local SGD's {_ms(local.exposed_comm_s)}" if local else "")
                    + f"; accuracy {cocod.accuracy:.1%} vs {ddp.accuracy:.1%}")
        hides = local is not None and (cocod.exposed_comm_s or 0) <= (local.exposed_comm_s or 0)
        verdict = ("agrees on the direction: " if speedup > 1 else "differs: ") + (
            f"{speedup:.2f}x at 2 workers (the paper's 2-3x is at 16 GPUs)")
        if local is not None:
            verdict += ("; the in-flight average hid communication local SGD exposed" if hides
                        else "; it exposed no less communication than local SGD here")
        return {"headline": "CoCoD-SGD vs synchronous SGD", "paper": "2-3x over synchronous SGD on 16 GPUs "
                "(PAPERS.md item 19)", "measured": measured, "verdict": verdict}

    def _hpsgd(self) -> dict[str, str] | None:
        ddp = self.get("ddp", "slow")
        variants = [m for m in (self.get("hpsgd", "slow"), self.get(f"hpsgd+{MOMENTUM_COMPENSATED}", "slow")) if m]
        if not ddp or not variants or not ddp.step_s:
            return None
        parts = [f"{m.strategy}: step {_ms(m.step_s)} ({(m.step_s or math.nan) / ddp.step_s:.2f}x DDP's), exposed "
                 f"{_ms(m.exposed_comm_s)} vs {_ms(ddp.exposed_comm_s)}, accuracy {_pct(m.accuracy)}"
                 for m in variants]
        measured = "slow network: " + "; ".join(parts) + f"; DDP {_pct(ddp.accuracy)}"
        faster = all((m.step_s or math.inf) < ddp.step_s for m in variants)
        best = max((m.accuracy or 0.0) for m in variants)
        verdict = ("agrees: the overlap shortens the step" if faster else "differs: no shorter step here")
        verdict += ("; staleness cost accuracy" if best < (ddp.accuracy or 0) - 0.02 else "; accuracy kept")
        return {"headline": "HPSGD vs DDP", "paper": "synchronisation in parallel with the next step's compute, "
                "with one-step-stale gradients (PAPERS.md item 10)", "measured": measured, "verdict": verdict}

    def _osp(self) -> dict[str, str] | None:
        pair = self._versus("osp", "ddp", "slow")
        if not pair:
            return None
        osp, ddp = pair
        gain = ddp.step_s / osp.step_s - 1
        points = (osp.accuracy - ddp.accuracy) * 100
        measured = (f"slow network: {gain:+.0%} throughput over DDP, exposed communication {_ms(osp.exposed_comm_s)} "
                    f"vs {_ms(ddp.exposed_comm_s)} a step, accuracy {osp.accuracy:.1%} vs {ddp.accuracy:.1%} "
                    f"({points:+.1f} points)")
        verdict = ("agrees: more throughput at about DDP's accuracy" if gain > 0 and points > -2 else
                   "partly: more throughput, less accuracy" if gain > 0 else "differs: no more throughput here")
        return {"headline": "OSP vs DDP", "paper": "up to 50% more throughput, accuracy kept by the local-gradient "
                "correction (PAPERS.md item 16)", "measured": measured, "verdict": verdict}

    def _diloco(self) -> dict[str, str] | None:
        pair = self._versus("diloco", "localsgd", "slow")
        ddp = self.get("ddp", "slow")
        if not pair or not ddp or not ddp.bytes_per_step:
            return None
        diloco, local = pair
        less = ddp.bytes_per_step / (diloco.bytes_per_step or math.nan)
        measured = (f"slow network: {less:.0f}x fewer bytes than DDP, step {_ms(diloco.step_s)} vs local SGD's "
                    f"{_ms(local.step_s)}, accuracy {diloco.accuracy:.1%} vs local SGD's {local.accuracy:.1%} and "
                    f"DDP's {_pct(ddp.accuracy)}")
        verdict = ("agrees: rare averages kept the accuracy" if diloco.accuracy >= (ddp.accuracy or 0) - 0.02
                   else "partly: far less communication, but accuracy fell by more than 2 points")
        return {"headline": "DiLoCo", "paper": "hundreds of times less communication at similar quality (outer "
                "Nesterov momentum, Douillard et al. 2023)", "measured": measured, "verdict": verdict}

    def _private_gossip(self) -> dict[str, str] | None:
        pair = self._versus("gossip+dp", "gossip", "fast")
        if not pair:
            return None
        private, plain = pair
        epsilon = median_or_none([m["value"] for r in self.results if r.cell.labels["strategy"] == "gossip+dp"
                                  for m in r.summary.strategy_metrics if m["name"] == "privacy_epsilon"])
        points = (private.accuracy - plain.accuracy) * 100
        measured = (f"fast network: step {_ms(private.step_s)} vs {_ms(plain.step_s)} without privacy "
                    f"({private.step_s / plain.step_s:.1f}x: the per-sample gradients), accuracy {private.accuracy:.1%} "
                    f"vs {plain.accuracy:.1%} ({points:+.1f} points), epsilon "
                    + (f"{epsilon:.2f}" if epsilon is not None else "n/a") + " at delta 1e-5 (noise multiplier 1, clip 1)")
        verdict = ("agrees: privacy at a bounded epsilon, paid in step time" + (
            " and accuracy" if points < -2 else ", accuracy within 2 points"))
        return {"headline": "Private gossip (DP-SGD)", "paper": "gossip averaging with Gaussian noise makes the "
                "shared models differentially private (A(DP)^2SGD, PAPERS.md item 11)",
                "measured": measured, "verdict": verdict}

    def _compression(self) -> dict[str, str] | None:
        ddp = self.get("ddp", "slow")
        hooks = [(v, m) for v in COMPRESSION_KNOBS if (m := self.get(f"ddp+{v}", "slow"))]
        local, local_bf16 = self.get("localsgd", "slow"), self.get("localsgd+bf16", "slow")
        if not ddp or not hooks or not ddp.bytes_per_step or not ddp.step_s:
            return None
        parts = [f"{v}: {(m.bytes_per_step or math.nan) / ddp.bytes_per_step:.3f}x the bytes, step "
                 f"{(m.step_s or math.nan) / ddp.step_s:.2f}x, exposed {_ms(m.exposed_comm_s)}, accuracy "
                 f"{_pct(m.accuracy)}, to target {_s(m.to_target_s)}" for v, m in hooks]
        measured = (f"slow network, against DDP ({_kb(ddp.bytes_per_step)} and {_ms(ddp.step_s)} a step, exposed "
                    f"{_ms(ddp.exposed_comm_s)}, accuracy {_pct(ddp.accuracy)}): " + "; ".join(parts))
        faster = [v for v, m in hooks if (m.step_s or math.inf) < ddp.step_s
                  and (m.accuracy or 0) >= (ddp.accuracy or 0) - 0.02]
        if local and local_bf16 and local.bytes_per_step and local.step_s:
            measured += (f"; localsgd's bf16 average: {(local_bf16.bytes_per_step or math.nan) / local.bytes_per_step:.3f}x "
                         f"local SGD's bytes, step {(local_bf16.step_s or math.nan) / local.step_s:.2f}x, accuracy "
                         f"{_pct(local_bf16.accuracy)} vs {_pct(local.accuracy)}")
        verdict = (f"faster at DDP's accuracy (within 2 points): {', '.join(faster)}" if faster
                   else "no hook was faster at DDP's accuracy here")
        return {"headline": "Gradient compression vs DDP", "paper": "fp16/bf16 halve the bytes, PowerSGD, top-k "
                "with error feedback, QSGD and 8-bit quantisation cut them further at little accuracy cost",
                "measured": measured, "verdict": verdict}

    def _buckets(self, network: str) -> dict[str, str] | None:
        size, per_layer, optimal = (self.get(n, network) for n in ("ddp", "ddp+per_layer", "ddp+mgwfbp"))
        if not size or not per_layer or not optimal:
            return None
        measured = (f"{network} network, exposed communication a step: MG-WFBP {_ms(optimal.exposed_comm_s)}, "
                    f"25 MB buckets {_ms(size.exposed_comm_s)}, one per layer {_ms(per_layer.exposed_comm_s)}; step "
                    f"{_ms(optimal.step_s)} / {_ms(size.step_s)} / {_ms(per_layer.step_s)}")
        best = min((optimal, size, per_layer), key=lambda m: m.exposed_comm_s if m.exposed_comm_s is not None
                   else math.inf)
        within = (optimal.exposed_comm_s or math.inf) <= (best.exposed_comm_s or 0) * (1 + TIE_FRACTION)
        verdict = ("agrees: the optimal merge exposed the least" if best is optimal
                   else f"a tie: {best.strategy} exposed less, by under {TIE_FRACTION:.0%}" if within
                   else f"differs: {best.strategy} exposed less here (the plan's layer times are one rank's, "
                        "timed alone; see `ddlscope buckets RUN` for its prediction)")
        return {"headline": f"MG-WFBP buckets ({network} network)", "paper": "merging layer gradients optimally "
                "under the alpha-beta model hides more communication than per-layer or fixed-size buckets "
                "(PAPERS.md item 12)", "measured": measured, "verdict": verdict}

    def _dbs(self) -> dict[str, str] | None:
        homogeneous, straggler, dbs = (self.get("ddp", "fast"), self.get("ddp", "fast", "straggler"),
                                       self.get(BATCHING, "fast", "straggler"))
        if not (homogeneous and straggler and dbs and homogeneous.step_s and straggler.step_s and dbs.step_s):
            return None
        gap = straggler.step_s - homogeneous.step_s
        closed = (straggler.step_s - dbs.step_s) / gap if gap > 0 else math.nan
        measured = (f"fast network, one 2x straggler: step {_ms(dbs.step_s)} vs DDP's {_ms(straggler.step_s)} with "
                    f"it and {_ms(homogeneous.step_s)} without: {closed:.0%} of the gap closed (a split by speed "
                    f"can close at most 67%: shares 2/3 and 1/3); accuracy {_pct(dbs.accuracy)} vs "
                    f"{_pct(straggler.accuracy)}")
        verdict = ("no straggler gap measured here" if math.isnan(closed) else
                   "agrees: most of the way to the homogeneous step" if closed >= 0.5 else
                   "partly: some of the way back" if closed > 0 else "differs: no faster than DDP here")
        return {"headline": "DBS vs DDP with a straggler", "paper": "each epoch the batch is re-split in proportion "
                "to measured throughput, so a straggler stops holding the others back (PAPERS.md item 3)",
                "measured": measured, "verdict": verdict}

    def _static_split(self) -> dict[str, str] | None:
        split, ddp = self.get("ddp+speeds", "fast", "straggler"), self.get("ddp", "fast", "straggler")
        hog, ps = self.get("ps-async+hogbatch", "fast", "straggler"), self.get("ps-async", "fast", "straggler")
        if not (split and ddp and split.step_s and ddp.step_s):
            return None
        measured = (f"fast network, one 2x straggler: ddp with batches by speed {_ms(split.step_s)} a step vs "
                    f"{_ms(ddp.step_s)} with equal ones")
        if hog and ps:
            measured += (f"; async PS with them and lock-free updates: accuracy {_pct(hog.accuracy)}, to target "
                         f"{_s(hog.to_target_s)} vs plain async PS {_pct(ps.accuracy)}, {_s(ps.to_target_s)}")
        verdict = ("agrees: the declared speeds balance the step" if split.step_s < ddp.step_s
                   else "differs: no faster than the equal split here")
        return {"headline": "Heterogeneity-aware static batching (Hogbatch)", "paper": "each device gets a batch "
                "in proportion to its speed, with lock-free updates (PAPERS.md item 1)", "measured": measured,
                "verdict": verdict}

    # -- which strategy wins where ------------------------------------------------
    def _regimes(self) -> list[tuple[str, str]]:
        out = []
        for network, workers in REGIMES:
            cells = [m for (s, n, w), m in self.cells.items() if n == network and w == workers]
            if not cells:
                continue
            reached = [m for m in cells if m.to_target_s is not None]
            if reached:
                best = min(reached, key=lambda m: m.to_target_s or math.inf)
                why = f"first to {TARGET_ACCURACY:.0%} accuracy in {best.to_target_s:.1f} s"
            else:
                best = max(cells, key=lambda m: m.accuracy or 0.0)
                why = f"none reached {TARGET_ACCURACY:.0%}; the most accurate"
            others = sorted((m for m in cells if m is not best), key=lambda m: m.to_target_s or math.inf)
            behind = ", ".join(f"{m.strategy} {_s(m.to_target_s)} ({_pct(m.accuracy)})" for m in others)
            line = (f"{network} network, {workers} workers: {best.strategy} wins ({why}; accuracy "
                    f"{_pct(best.accuracy)}, step {_ms(best.step_s)}, {_kb(best.bytes_per_step)} a step)"
                    + (f"; then {behind}" if behind else ""))
            out.append((f"{network}/{workers}", line))
        return out


def _measure(strategy: str, members: list[CellResult]) -> Measured:
    def median(value) -> float | None:  # type: ignore[no-untyped-def]
        return median_or_none([value(r) for r in members])

    def to_target(r: CellResult) -> float | None:
        return r.summary.time_to_metric_s(TARGET_ACCURACY)

    return Measured(
        strategy=strategy,
        step_s=median(lambda r: r.summary.effective_step_s),
        samples_per_s=median(lambda r: _throughput(r)),
        exposed_comm_s=median(lambda r: r.summary.comm.get("exposed_s")),
        bytes_per_step=median(lambda r: r.summary.comm.get("bytes_sent_per_step")),
        accuracy=median(lambda r: r.summary.final_eval["metric"] if r.summary.final_eval else None),
        # a seed that never reached the target counts as never: the median is None when most did not
        to_target_s=_median_to_target([to_target(r) for r in members]),
        wall_s=median(lambda r: r.summary.effective_wall_s),
        seeds=len(members))


def _throughput(r: CellResult) -> float | None:
    from ddlscope.studies.base import effective_throughput

    return effective_throughput(r.summary)


def _median_to_target(values: list[float | None]) -> float | None:
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    middle = ordered[(len(ordered) - 1) // 2] if ordered else None
    return middle


def _f(value: float | None, scale: float, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value * scale:>{width}.{digits}f}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f} ms"


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _kb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e3:.1f} KB"
