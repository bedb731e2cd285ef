"""`ddlscope study paper`: the main study, reproduced on this machine.

DDP vs FSDP vs parameter servers (sync, async, SSP, staleness-aware), on the
study's fast and slow cluster networks (emulated, `scaled` so that the
communication-to-computation ratio matches the target GPUs), with
homogeneous workers and with one 2x straggler, at 1, 2 and 4 workers.
Accuracy cells train a CIFAR-style ResNet (`--workload resnet-cifar`, the
default: as many FLOPs per parameter per sample as ResNet-50 on CIFAR-10, so
the paper's compute-to-communication regime) or the small digits CNN
(`--workload cnn-digits`, communication-bound on any network) for the same
number of samples; memory cells train a GPT with tens of millions of
parameters for a few steps, where model states dominate.

`--models resnet50,vgg16,...` adds the paper's cells on those torchvision
networks (`torchvision:NAME`, random weights, CIFAR's 32x32 images) beside
the small model: a few steps each, read for step time and memory (training
them to an accuracy is hours on 2 cores), and the predicted column priced
from the same networks (paper_prediction.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ddlscope.specs import STRATEGY_SPECS, strategy_specs
# Asynchrony's implicit momentum (Omnivore, PAPERS.md item 15): one rule for this study and the omnivore tuner.
from ddlscope.specs.strategies.omnivore import compensated_momentum
from ddlscope.studies import STUDIES
from ddlscope.runtime.config import experiment_from_dict
from ddlscope.specs import ConfigError
from ddlscope.studies.base import Cell, CellResult, Findings, Study, build_cell, measurement_notes
from ddlscope.studies.paper_prediction import ModelLayers, paper_prediction, predicted_agreement, predicted_column

if TYPE_CHECKING:
    from ddlscope.predict.cnn import Layer


@dataclass(frozen=True)
class AccuracySetting:
    """What the accuracy cells train, and the accuracy their time to target is read at."""

    workload: dict[str, Any]
    target: float  # reached by the one-process synchronous baseline on every seed tried
    chance: float  # a run below it diverged rather than trained less (twice the 10% of guessing)
    regime: str  # what limits DDP here, for the verdict when it does not reach the paper's speedup


ACCURACY_SETTINGS: dict[str, AccuracySetting] = {
    # ResNet-18's layout at width 8 with one basic block per stage (78k parameters): 314 FLOPs per
    # parameter per sample, against ResNet-50's 331 on CIFAR-10 (the workload's default, width 16 with
    # two blocks, has 298 but costs 9x the compute; this keeps the quick study within minutes).
    # SGD with momentum 0.9 (ResNet's usual optimizer), batch 64, 150 steps (~1 epoch of the 10,000
    # generated images), target 0.85. lr 0.02 because the synchronous cells must reach the target
    # whatever the seed: with lr 0.05 one process ended seed 0 at 0.839 and 2-worker DDP (the same
    # SGD, another summation order) diverged on it (0.272); with 0.02 one process (seeds 0-3) and
    # DDP (seeds 0-1) all passed 0.85 by step 125 or 150 (best 0.887-0.942).
    "resnet-cifar": AccuracySetting(
        {"name": "resnet-cifar", "width": 8, "blocks": 1, "batch_size": 64, "steps": 150, "eval_every": 25,
         "test_samples": 1000, "optimizer": "sgd", "lr": 0.02, "momentum": 0.9},
        target=0.85, chance=0.2,
        regime="a CIFAR ResNet does as much compute per parameter and sample as the paper's models, but its "
               "78k parameters' gradients (0.3 MB) fit DDP's first 1 MiB bucket, so the all-reduce starts "
               "only after backward and no compute hides it"),
    # Batch 256 gives each rank as much compute per byte of gradient as digits allow; 100 steps (~18
    # epochs) of SGD reach 95% test accuracy when training is synchronous. Momentum 0.8 because the
    # baseline must reach that on every seed: one process, 5 seeds, lr 0.1 ended at 96.1-97.2% with
    # momentum 0.8 but 80.6-96.4% with 0.9 (2 of 5 reached 95%; lr 0.05 with 0.9: 94.7-96.1%).
    "cnn-digits": AccuracySetting(
        {"name": "cnn-digits", "channels": 16, "batch_size": 256, "steps": 100, "eval_every": 20,
         "lr": 0.1, "momentum": 0.8},
        target=0.95, chance=0.2,
        regime="this small model's gradients cost more to exchange than its compute, even on the fast network"),
}
MEMORY_WORKLOAD: dict[str, Any] = {
    "name": "gpt-synthetic", "layers": 8, "hidden": 512, "heads": 8, "seq_len": 32, "vocab_size": 256,
    "samples": 64, "batch_size": 8, "steps": 3, "optimizer": "adamw", "lr": 1e-4, "eval_batches": 1,
}
# The quick study times FSDP and the slow network's DDP over this many steps, without evaluating on the
# way: their SGD is DDP's (tests/test_fsdp.py), so accuracy at equal samples is the fast DDP cell's, and
# training them to the end was a third of the quick study's time. The full study trains every cell.
TIMING_STEPS = 40
# With --quick, the seeds beyond the first go to the cells of the async-vs-sync headline only.
QUICK_REPEATED = ("ps-sync", "ps-async")
NETWORKS: dict[str, dict[str, Any]] = {
    "fast": {"profile": "fast", "scaled": True},
    "slow": {"profile": "slow", "scaled": True},
}
STRAGGLER_SLOWDOWN = 2.0
QUICK_WORKERS = 2
# DDP's scaling on the fast network: one process, then these worker counts (the scaling figure's points).
SCALING_WORKERS = (2, 4)
# The study's subjects, by their traits: the synchronous collective strategies (DDP, FSDP) and the
# parameter-server architectures, simplest first (local SGD and its relatives, and the hybrids of a
# collective and a server, are `study dataparallel`'s).
DISTRIBUTED = tuple(c.registered_name for c in strategy_specs() if not c.traits.hybrid
                    and (c.traits.family == "server" or c.traits.family == "collective" and c.traits.synchronous))
PS_FAMILY = tuple(name for name in DISTRIBUTED if STRATEGY_SPECS.get(name).traits.family == "server")


def accuracy_cell(setting: AccuracySetting, strategy: str, network: str, workers: str, world: int,
                  variant: str = "", seed: int = 0, timing: bool = False) -> Cell:
    """A cell that trains `setting` to its end; with `timing`, TIMING_STEPS steps for the step time
    only (one evaluation of a single batch at the end, which the tables do not show)."""
    slowdown = [1.0] * (world - 1) + [STRAGGLER_SLOWDOWN] if workers == "straggler" else []
    workload = dict(setting.workload)
    if variant == MOMENTUM_COMPENSATED:
        workload["momentum"] = compensated_momentum(workload["momentum"], world)
    if timing:
        workload.update(steps=TIMING_STEPS, eval_every=0, eval_batches=1)
    raw = {
        "seed": seed,
        "workload": workload,
        "strategy": {"name": strategy},  # each strategy with its spec's defaults
        "cluster": {"world_size": world, "network": NETWORKS[network], "slowdown": slowdown},
    }
    name = f"{strategy}+{variant}" if variant else strategy
    group = f"{name}/{network}/{workers}/w{world}"
    labels = {"part": "timing" if timing else "accuracy", "strategy": name, "network": network, "workers": workers,
              "world_size": world, "target_metric": setting.target, "group": group, "seed": seed,
              "workload": workload["name"]}
    # Seed 0 keeps the plain key, so that runs stored before repeats existed are reused.
    key = f"{group}/timing" if timing else group
    return build_cell(key if seed == 0 else f"{key}/seed{seed}", labels, raw)


def repeated(setting: AccuracySetting, cells: list[Cell], repeats: int,
             strategies: tuple[str, ...] = PS_FAMILY) -> list[Cell]:
    """Seeds 1..repeats-1 of the parameter-server accuracy cells, run after every seed-0 cell.

    A server applies updates in the order they arrive, so these cells' accuracy
    and wall time change from run to run even with one seed (the plain ps-async
    cell, with momentum 0.9, finished anywhere between 10% and 91% accuracy);
    the headlines read their medians. ps-sync sums a round in worker order and
    gets the same bits on every run, but it runs with the same seeds so that the
    async headlines compare like with like (a seed changes the initial weights
    and the data order). The other cells compute the same SGD on every run of a
    seed.
    """
    out = []
    for cell in cells:
        labels = cell.labels
        strategy, _, variant = labels["strategy"].partition("+")
        if labels["part"] == "accuracy" and strategy in strategies:
            out += [accuracy_cell(setting, strategy, labels["network"], labels["workers"], labels["world_size"], variant, seed)
                    for seed in range(1, repeats)]
    return out


MOMENTUM_COMPENSATED = "mc"


def baseline_cell(setting: AccuracySetting) -> Cell:
    raw = {"seed": 0, "workload": setting.workload, "strategy": {"name": "single"}, "cluster": {"world_size": 1}}
    labels = {"part": "accuracy", "strategy": "single", "network": "none", "workers": "homogeneous",
              "world_size": 1, "target_metric": setting.target, "group": "single/w1", "seed": 0,
              "workload": setting.workload["name"]}
    return build_cell("single/w1", labels, raw)


def memory_cell(strategy: str, world: int) -> Cell:
    raw = {"seed": 0, "workload": MEMORY_WORKLOAD, "strategy": {"name": strategy}, "cluster": {"world_size": world}}
    labels = {"part": "memory", "strategy": strategy, "network": "local", "workers": "homogeneous",
              "world_size": world, "group": f"memory/{strategy}/w{world}", "seed": 0}
    return build_cell(f"memory/{strategy}/w{world}", labels, raw)


# ---------------------------------------------------------------------------- the paper's own models (--models)
MODEL_SOURCE = "torchvision"
# What every model cell trains: CIFAR's 32x32 images (the paper's CIFAR-10 runs), global batch 32 (16 images per
# worker at 2 workers: one step of VGG16 or ConvNeXt-L already takes seconds on 2 cores), 3 steps, of which the
# summary drops the first (warm-up): step time and memory only. No accuracy: training these networks to one
# takes hours here. The same workload in every cell, so the one-process cell is each model's speedup baseline,
# and the quick study's cells are the full study's (reused from the store).
MODEL_WORKLOAD: dict[str, Any] = {"image_size": 32, "batch_size": 32, "steps": 3, "eval_every": 0,
                                  "eval_batches": 1, "samples": 256, "test_samples": 32, "optimizer": "sgd",
                                  "lr": 0.01, "momentum": 0.9}
MODEL_WORKERS = 2  # 2 ranks on 2 cores; 4 ranks of ConvNeXt-L hold 9.4 GB of model states (SGD, momentum)
# DDP/FSDP memory per rank is read from cells on the real (loopback) network: memory does not depend on the
# link, and an emulated link would cost minutes per step for the larger models.
MEMORY_NETWORK = "local"


def model_workload(model: str) -> dict[str, Any]:
    return {"name": f"{MODEL_SOURCE}:{model}", **MODEL_WORKLOAD}


def parse_models(names: tuple[str, ...]) -> tuple[str, ...]:
    """torchvision model names as given to --models (a `torchvision:` prefix is allowed), checked for shape
    only; whether torchvision has them is the workload's check, when the cells are built."""
    models = tuple(n.strip().removeprefix(f"{MODEL_SOURCE}:") for n in names)
    spelled = ",".join(names)
    if not models or any(not m for m in models):
        raise ValueError(f"--models {spelled!r}: give comma-separated torchvision model names, e.g. "
                         "resnet50,vgg16,densenet121,efficientnet_v2_s,convnext_large")
    for m in models:
        if ":" in m or "/" in m:
            raise ValueError(f"--models {m!r}: give torchvision classification model names (e.g. resnet50); "
                             "other sources (timm:, hf:, module:) run through `ddlscope run` and `ddlscope sweep`")
    duplicates = sorted({m for m in models if models.count(m) > 1})
    if duplicates:
        raise ValueError(f"--models: {duplicates[0]} is given twice")
    return models


def model_cell(model: str, strategy: str, network: str, world: int, part: str, workers: str = "homogeneous",
               check: bool = False) -> Cell:
    """One cell of `model`: step time (`part` timing) or memory. `check` runs the workload's and the
    strategy's checks on the model (a meta-device build: a name torchvision lacks is refused here)."""
    slowdown = [1.0] * (world - 1) + [STRAGGLER_SLOWDOWN] if workers == "straggler" else []
    cluster: dict[str, Any] = {"world_size": world, "slowdown": slowdown}
    if network in NETWORKS:
        cluster["network"] = NETWORKS[network]
    raw = {"seed": 0, "workload": model_workload(model), "strategy": {"name": strategy}, "cluster": cluster}
    if strategy == "single":
        key = f"{model}/single/w1"
    elif part == "memory":
        key = f"{model}/memory/{strategy}/w{world}"
    else:
        key = f"{model}/{strategy}/{network}/{workers}/w{world}"
    # The strategy label names the model: the report's scaling series are keyed by strategy, network and
    # workers, and must not merge a model's cells with the small model's.
    labels = {"part": part, "strategy": f"{strategy} ({model})", "network": network, "workers": workers,
              "world_size": world, "group": key, "seed": 0, "workload": raw["workload"]["name"], "model": model}
    try:
        return Cell(key, labels, experiment_from_dict(raw, check_workload=check))
    except ConfigError as exc:
        raise ConfigError(f"--models {model}: {exc}") from None


def model_cells(model: str, quick: bool) -> list[Cell]:
    """The paper's cells on one model: the quick study measures DDP's speedup on the fast network and DDP vs
    FSDP memory (4 cells); the full study adds DDP at 4 workers and on the slow network, FSDP's step time
    on both networks, and sync vs async parameter servers with a 2x straggler (step time only)."""
    w = MODEL_WORKERS
    plan = [("single", "none", 1, "timing", "homogeneous"), ("ddp", "fast", w, "timing", "homogeneous")]
    plan += [(s, MEMORY_NETWORK, w, "memory", "homogeneous") for s in ("ddp", "fsdp")]
    if not quick:
        plan += [("ddp", "fast", world, "timing", "homogeneous") for world in SCALING_WORKERS if world != w]
        plan += [("ddp", "slow", w, "timing", "homogeneous")]
        plan += [("fsdp", n, w, "timing", "homogeneous") for n in NETWORKS]
        plan += [(s, "fast", w, "timing", "straggler") for s in ("ps-sync", "ps-async")]
    # The checks depend on the model and the strategy only: one per strategy (each costs a meta-device
    # build, up to a second for the larger networks; checking all 50 cells of the full study took 21 s).
    checked: set[str] = set()
    cells = []
    for strategy, network, world, part, workers in plan:
        cells.append(model_cell(model, strategy, network, world, part, workers, check=strategy not in checked))
        checked.add(strategy)
    return cells


# Seconds per step measured here (2 cores shared with other work, so noisy) for DDP at 2 ranks, 16 images per
# rank, 32x32, on the loopback network: `ddlscope run --workload torchvision:NAME --strategy ddp
# --world-size 2 --steps 3` (2026-12-07). The expected time of a models study reads them; another model
# gets DEFAULT_STEP_S.
MEASURED_STEP_S = {"resnet50": 2.4, "vgg16": 7.2, "densenet121": 1.1, "efficientnet_v2_s": 4.7,
                   "convnext_large": 9.3}
DEFAULT_STEP_S = 5.0
CELL_START_S = 10.0  # launching the ranks, building the model and data, the final one-batch evaluation
LOCAL_MATMUL_FLOPS = 7.3e10  # this machine's fp32 matmul rate, as the emulation's probe measured it
def traffic_per_gradient_byte(strategy: str, world: int) -> float:
    """Bytes on the busiest emulated link per step, in units of the model's gradient bytes: a ring
    all-reduce sends 2 (n-1)/n of them per rank; FSDP gathers the parameters twice (forward, backward) and
    reduce-scatters the gradients, (n-1)/n each; a parameter server's link carries every worker's push and
    pull."""
    if strategy in PS_FAMILY:
        return 2.0 * world
    return (3.0 if strategy == "fsdp" else 2.0) * (world - 1) / world


def expected_cell_s(cell: Cell, gradient_bytes: float) -> float:
    """About how long a model cell takes here: its steps' compute (measured above) plus the emulated
    link's time for its traffic (the `scaled` bandwidth, as the emulation computes it)."""
    exp = cell.experiment
    compute_s = MEASURED_STEP_S.get(cell.labels["model"], DEFAULT_STEP_S)
    comm_s = 0.0
    link = exp.cluster.network.link()
    if link is not None and exp.cluster.world_size > 1:
        bandwidth_bytes_per_s = link[1]
        if exp.cluster.network.scaled:
            bandwidth_bytes_per_s /= exp.cluster.network.target_flops() / LOCAL_MATMUL_FLOPS
        traffic = traffic_per_gradient_byte(exp.strategy.name, exp.cluster.world_size)
        comm_s = traffic * gradient_bytes / bandwidth_bytes_per_s
    return CELL_START_S + exp.workload.steps * (compute_s + comm_s)


def gradient_bytes(model: str) -> float:
    """fp32 gradient bytes of the model, counted on the meta device (no memory, milliseconds)."""
    import torch

    from ddlscope.workloads.sources import TorchvisionSpec, image_model

    with torch.device("meta"):
        return 4.0 * sum(p.numel() for p in image_model(TorchvisionSpec(**model_workload(model))).parameters())


def expected_models_s(cells: list[Cell]) -> float:
    """About how long the model cells take on this machine, if none is in the store yet."""
    sizes = {m: gradient_bytes(m) for m in dict.fromkeys(c.labels["model"] for c in cells if "model" in c.labels)}
    return sum(expected_cell_s(c, sizes[c.labels["model"]]) for c in cells if "model" in c.labels)


def recorded_layers(results: list[CellResult]) -> ModelLayers:
    """Each model's network as predict/cnn.py prices it, recorded from one real forward of the model the
    cells built (runtime/profiler.py, the path of `ddlscope predict --model torchvision:NAME`), with the
    units FSDP shards it into. None for a model whose recorded layers price its forward FLOPs (as torch
    counts them) off by more than studies/recorded.py's tolerance, or whose recording fails: the predicted column
    says n/a rather than pricing another network, and the study's report is still written."""
    specs = {}
    for r in results:
        model = r.cell.labels.get("model")
        if model and model not in specs:
            specs[model] = r.cell.experiment.workload
    return {model: _layers_of(spec) for model, spec in specs.items()}


_LAYERS: dict[str, "tuple[Layer, ...] | None"] = {}  # by the workload spec: one recording per process


def _layers_of(spec: Any) -> "tuple[Layer, ...] | None":
    key = spec.model_dump_json()
    if key not in _LAYERS:
        try:
            _LAYERS[key] = _record_layers(spec)
        except Exception:  # noqa: BLE001 (a model the recorder cannot run is not predicted; the cells stand)
            _LAYERS[key] = None
    return _LAYERS[key]


def _record_layers(spec: Any) -> "tuple[Layer, ...] | None":
    from ddlscope.studies.recorded import priced_well, recorded_layers

    layers, priced = recorded_layers(spec)
    return layers if priced_well(priced) else None


@STUDIES.register("paper")
class PaperStudy(Study):
    description = "the main study: DDP vs FSDP vs parameter servers on fast/slow networks, with stragglers"
    workload_choices = tuple(ACCURACY_SETTINGS)

    def __init__(self, workload: str | None = None, models: tuple[str, ...] = ()):
        super().__init__(workload)
        self.models = parse_models(models) if models else ()

    def cells(self, quick: bool, repeats: int = 1) -> list[Cell]:
        """The small model's cells (unchanged by --models), then each model's, model after model."""
        return self._own_cells(quick, repeats) + [c for m in self.models for c in model_cells(m, quick)]

    def _own_cells(self, quick: bool, repeats: int) -> list[Cell]:
        setting = ACCURACY_SETTINGS[self.workload]

        def cell(strategy: str, network: str, workers: str, world: int, variant: str = "",
                 timing: bool = False) -> Cell:
            return accuracy_cell(setting, strategy, network, workers, world, variant, timing=timing)

        cells = [baseline_cell(setting)]
        if quick:
            # The cells each headline needs, at 2 workers (2 ranks on this machine's 2 cores are not
            # oversubscribed); memory at 4, where sharding shows most.
            # DDP's scaling at 1, 2 and 4 on the fast network, where the paper's speedup is claimed; the slow
            # one at 2 (at 4, ranks outnumber cores and the slow link's cell is the study's longest).
            # FSDP and the slow network serve step-time headlines: timed over TIMING_STEPS.
            cells += [cell("ddp", "fast", "homogeneous", world) for world in SCALING_WORKERS]
            cells.append(cell("ddp", "slow", "homogeneous", QUICK_WORKERS, timing=True))
            cells += [cell("fsdp", n, "homogeneous", QUICK_WORKERS, timing=True) for n in NETWORKS]
            cells.append(cell("ddp", "fast", "straggler", QUICK_WORKERS))
            # Every synchronous collective strategy once, where what sets it apart shows: dbs with the straggler.
            cells += [cell(s, "fast", "straggler", QUICK_WORKERS) for s in DISTRIBUTED
                      if s not in PS_FAMILY and s not in ("ddp", "fsdp")]
            # One server on the slow link is bound by its network whatever the workers do; on the
            # fast one compute matters, which is where stragglers (and asynchrony) make a difference.
            cells += [cell(s, "fast", "straggler", QUICK_WORKERS) for s in PS_FAMILY]
            cells.append(cell("ps-async", "fast", "straggler", QUICK_WORKERS, MOMENTUM_COMPENSATED))
            cells += [memory_cell(s, 4) for s in ("ddp", "fsdp")]
        else:
            cells += [cell(s, n, w, world) for world in SCALING_WORKERS for n in NETWORKS
                      for w in ("homogeneous", "straggler") for s in DISTRIBUTED]
            cells += [cell("ps-async", n, "straggler", world, MOMENTUM_COMPENSATED)
                      for world in SCALING_WORKERS for n in NETWORKS]
            cells += [memory_cell(s, world) for world in SCALING_WORKERS for s in ("ddp", "fsdp")]
        return cells + repeated(setting, cells, repeats, QUICK_REPEATED if quick else PS_FAMILY)

    def analyse(self, results: list[CellResult], quick: bool) -> Findings:
        own = [r for r in results if "model" not in r.cell.labels]
        models = [r for r in results if "model" in r.cell.labels]
        return _Analysis(own, _setting_of(own, self.workload), _ModelAnalysis(models)).findings()


def _setting_of(results: list[CellResult], default: str | None) -> AccuracySetting:
    """The accuracy setting the results were trained with: their label, else their stored workload's
    name (runs stored before the label existed), else the study's choice."""
    for r in results:
        if r.cell.labels.get("part") == "accuracy":
            name = r.cell.labels.get("workload") or r.run.config.get("workload", {}).get("name")
            if name in ACCURACY_SETTINGS:
                return ACCURACY_SETTINGS[name]
    return ACCURACY_SETTINGS[default or next(iter(ACCURACY_SETTINGS))]


class _Analysis:
    def __init__(self, results: list[CellResult], setting: AccuracySetting, models: "_ModelAnalysis | None" = None):
        self.results = results
        self.setting = setting
        self.models = models or _ModelAnalysis([])
        # A cell's seeds form one group; its seed-0 result stands for the group, and the
        # step, wall time and accuracy read through it are the group's medians.
        self.groups: dict[str, list[CellResult]] = {}
        for r in results:
            self.groups.setdefault(_group(r), []).append(r)
        self.by_key = {key: members[0] for key, members in self.groups.items()}
        self.cells = list(self.by_key.values())
        self.single = self.by_key.get("single/w1")
        worlds = [r.cell.labels["world_size"] for r in self.cells
                  if r.cell.labels["part"] == "accuracy" and r.cell.labels["strategy"] != "single"]
        # Headlines compare cells at the fewest workers (DDP's scaling reads every count): with more,
        # ranks (and servers) outnumber this machine's cores and wall clocks measure the sharing as
        # much as the strategy.
        self.world = min(worlds, default=QUICK_WORKERS)
        self.more_workers = sorted(set(worlds) - {self.world})
        # The network the parameter-server headlines are read on: fast when those cells exist.
        self.ps_network = "fast" if self.get_on("ps-sync", "fast", "straggler") else "slow"

    # -- measured quantities --------------------------------------------------
    def get(self, strategy: str, network: str, workers: str = "homogeneous") -> CellResult | None:
        return self.get_on(strategy, network, workers)

    def get_on(self, strategy: str, network: str, workers: str) -> CellResult | None:
        return self.get_at(strategy, network, workers, getattr(self, "world", QUICK_WORKERS))

    def get_at(self, strategy: str, network: str, workers: str, world: int) -> CellResult | None:
        return self.by_key.get(f"{strategy}/{network}/{workers}/w{world}")

    def _seed_values(self, r: CellResult | None, value: Callable[[CellResult], float | None]) -> list[float]:
        """`value` of each seed of r's cell, where it has one."""
        if r is None:
            return []
        return [v for v in (value(m) for m in self.groups[_group(r)]) if v is not None]

    def _median(self, r: CellResult | None, value: Callable[[CellResult], float | None]) -> float | None:
        values = self._seed_values(r, value)
        return statistics.median(values) if values else None

    def step(self, r: CellResult | None) -> float | None:
        return self._median(r, lambda m: m.summary.effective_step_s)

    def wall(self, r: CellResult | None) -> float | None:
        return self._median(r, lambda m: m.summary.effective_wall_s)

    def accuracy(self, r: CellResult | None) -> float | None:
        return self._median(r, _final_accuracy)

    def accuracy_spread(self, r: CellResult | None) -> str:
        """'' for one seed; else the seeds' range, and how many ended at chance level."""
        accuracies = self._seed_values(r, _final_accuracy)
        if len(accuracies) < 2:
            return ""
        text = f"median of {len(accuracies)} seeds, {min(accuracies):.1%}-{max(accuracies):.1%}"
        failed = sum(a < self.setting.chance for a in accuracies)
        return text + (f", {failed} at chance level" if failed else "")

    def _walls(self, r: CellResult) -> list[float]:
        return self._seed_values(r, lambda m: m.summary.effective_wall_s)

    def walls_overlap(self, a: CellResult, b: CellResult) -> bool:
        """Whether two cells' seeds ran in overlapping wall times (never, for one seed each)."""
        wa, wb = self._walls(a), self._walls(b)
        if len(wa) < 2 and len(wb) < 2 or not wa or not wb:
            return False
        return min(wa) <= max(wb) and min(wb) <= max(wa)

    def wall_range(self, r: CellResult) -> str:
        walls = self._walls(r)
        return f"{min(walls):.1f}-{max(walls):.1f} s" if walls else "n/a"

    def time_to_target(self, r: CellResult | None) -> float:
        """The median over a cell's seeds of its training time to the target accuracy; inf if never."""
        reached = self._median(r, lambda m: m.summary.time_to_metric_s(self.setting.target))
        return reached if reached is not None else math.inf

    def speedup(self, r: CellResult | None) -> float | None:
        base, mine = self.step(self.single), self.step(r)
        return base / mine if base and mine else None

    @staticmethod
    def model_state_bytes(r: CellResult | None) -> float | None:
        if r is None or not r.summary.memory_bytes_by_rank:
            return None
        return max(sum(m.get(c, 0) for c in ("parameters", "gradients", "optimizer"))
                   for m in r.summary.memory_bytes_by_rank.values())

    @staticmethod
    def peak_tensor_bytes(r: CellResult | None) -> float | None:
        if r is None or not r.summary.memory_bytes_by_rank:
            return None
        return max(sum(m.get(c, 0) for c in ("parameters", "gradients", "optimizer", "activations"))
                   for m in r.summary.memory_bytes_by_rank.values())

    # -- headlines ------------------------------------------------------------
    def findings(self) -> Findings:
        headlines = [h for h in (self._ddp_speedup(), self._fsdp_memory(), self._fsdp_slowdown(),
                                 self._async_gain(), self._stale_aware()) if h]
        headlines = self.models.add_to(headlines)
        _add_predictions(headlines, recorded_layers(self.models.results) if self.models.names else None)
        notes = self._notes() + self.models.notes()
        decisions = self._decisions()
        text = "\n".join([f"- {h['headline']}: paper: {h['paper']} | measured: {h['measured']} | predicted there: "
                          f"{h['predicted']} | {h['verdict']}"
                          for h in headlines] + ["", "Decisions:"] + [f"- {d}" for d in decisions])
        return Findings(headlines, decisions, notes, text)

    def _ddp_speedup(self) -> dict[str, str] | None:
        worlds = [w for w in sorted({self.world, *self.more_workers}) if self.get_at("ddp", "fast", "homogeneous", w)]
        fast = {w: self.speedup(self.get_at("ddp", "fast", "homogeneous", w)) for w in worlds}
        if not fast or None in fast.values():
            return None
        top = max(worlds)
        # The slow network where it ran (the quick study runs it at its fewest workers only).
        slow = {w: s for w in worlds if (s := self.speedup(self.get_at("ddp", "slow", "homogeneous", w))) is not None}
        straggler = self.speedup(self.get("ddp", "fast", "straggler"))
        measured = ("on the fast network " + ", ".join(f"{fast[w]:.2f}x at {w} workers" for w in worlds)
                    + "; on the slow one " + (", ".join(f"{slow[w]:.2f}x at {w}" for w in slow) or "n/a"))
        if straggler is not None:
            measured += f"; {straggler:.2f}x on the fast one at {self.world} workers with a 2x straggler"
        if any(self.by_key[f"ddp/fast/homogeneous/w{w}"].summary.oversubscribed for w in worlds):
            measured += " (effective times: thread CPU time for compute where ranks outnumber cores)"
        best_on_fast = all(fast[w] >= slow[w] for w in slow) and fast[self.world] >= (straggler or 0)
        in_range = 2.0 <= fast[top] <= 3.0
        if best_on_fast and fast[top] >= 1.5:
            verdict = ("agrees: DDP speeds training up, most on a fast, homogeneous cluster"
                       + (f"; {fast[top]:.1f}x at {top} workers is within the paper's 2-3x" if in_range else
                          f"; {fast[top]:.1f}x at {top} workers is {'below' if fast[top] < 2 else 'above'} "
                          "the paper's 2-3x" + (self._below_why(top) if fast[top] < 2 else "")))
        elif best_on_fast:
            verdict = ("partly: the order agrees (fast, homogeneous is best), but there is no 2-3x here: "
                       + self.setting.regime + self._below_why(top))
        else:
            verdict = "differs: DDP did not gain most on the fast homogeneous cluster here"
        return _headline(DDP_SPEEDUP, measured, verdict)

    def _below_why(self, world: int) -> str:
        """Why the speedup falls short: each worker's share of the global batch, against the 128
        images per GPU of the paper's CIFAR runs, sets how much compute hides each gradient byte."""
        per_worker = self.setting.workload["batch_size"] // world
        exchange = self._exchange_phrase(world)
        return (f" ({per_worker} images per worker against the paper's 128 per GPU: less compute to hide each "
                f"gradient byte behind{'; ' + exchange if exchange else ''})")

    def _exchange_phrase(self, world: int) -> str:
        """'waiting for the gradient exchange took N% of a step at W workers', from the cell's phase
        breakdown; '' without one."""
        r = self.get_at("ddp", "fast", "homogeneous", world)
        share = r.summary.breakdown_fraction.get("comm_wait_s") if r else None
        return f"waiting for the gradient exchange took {share:.0%} of a step at {world} workers" if share else ""

    def _fsdp_memory(self) -> dict[str, str] | None:
        ddp, fsdp = self.by_key.get("memory/ddp/w4"), self.by_key.get("memory/fsdp/w4")
        states = _ratio(self.model_state_bytes(fsdp), self.model_state_bytes(ddp))
        peak = _ratio(self.peak_tensor_bytes(fsdp), self.peak_tensor_bytes(ddp))
        if states is None:
            return None
        rss = None
        if ddp and fsdp:
            rss = _ratio(max(m.get("peak_rss", 0) for m in fsdp.summary.memory_bytes_by_rank.values()),
                         max(m.get("peak_rss", 0) for m in ddp.summary.memory_bytes_by_rank.values()))
        measured = (f"model states per rank {states:.2f}x DDP's ({1 / states:.1f}x lower), model states + "
                    f"activations {_fmt(peak, 'x')}, process peak RSS {_fmt(rss, 'x')} (4 ranks, "
                    f"{MEMORY_WORKLOAD['layers']}-layer GPT, h={MEMORY_WORKLOAD['hidden']})")
        verdict = ("agrees: more than 60% less" if peak is not None and peak < 0.4
                   else "partly: model states shrink, but the rest of the process does not")
        return _headline(FSDP_MEMORY, measured, verdict)

    def _fsdp_slowdown(self) -> dict[str, str] | None:
        slow = _ratio(self.step(self.get("fsdp", "slow")), self.step(self.get("ddp", "slow")))
        fast = _ratio(self.step(self.get("fsdp", "fast")), self.step(self.get("ddp", "fast")))
        if slow is None:
            return None
        if slow <= 1:
            verdict = "differs: FSDP was not slower than DDP on the slow network here"
        elif fast is None or slow >= fast:
            verdict = "agrees: FSDP is slower per step than DDP, most on the slow network"
        else:
            verdict = ("agrees that FSDP is slower per step; here the gap was larger on the fast network, "
                       "where DDP's single all-reduce cost less and FSDP's per-unit collectives did not")
        return _headline(FSDP_STEP, f"{slow:.2f}x DDP's step time on the slow network, {_fmt(fast, 'x')} on the "
                         f"fast one ({self.world} workers)", verdict)

    def _async_gain(self) -> dict[str, str] | None:
        sync, asyn = (self.get(s, self.ps_network, "straggler") for s in ("ps-sync", "ps-async"))
        if not sync or not asyn:
            return None
        gain = 1 - self.wall(asyn) / self.wall(sync)
        acc_sync, acc_async = self.accuracy(sync), self.accuracy(asyn)
        loss_pts = (acc_sync - acc_async) * 100
        measured = (f"with a 2x straggler ({self.ps_network} network, {self.world} workers): wall time {-gain:+.0%} "
                    f"({self.wall(asyn):.1f} s vs {self.wall(sync):.1f} s), accuracy at equal samples {acc_async:.1%}"
                    f"{_parenthesised(self.accuracy_spread(asyn))} vs {acc_sync:.1%}"
                    f"{_parenthesised(self.accuracy_spread(sync))} ({loss_pts:+.1f} points lost)")
        equal_s = min(self.wall(asyn) or 0.0, self.wall(sync) or 0.0)
        at_async, at_sync = (self._median(r, lambda m: m.summary.metric_at_s(equal_s)) for r in (asyn, sync))
        if equal_s and at_async is not None and at_sync is not None:
            measured += f", at equal wall time ({equal_s:.1f} s) {at_async:.1%} vs {at_sync:.1%}"
        compensated = self.get(f"ps-async+{MOMENTUM_COMPENSATED}", self.ps_network, "straggler")
        if compensated is not None:
            measured += (f"; with momentum lowered to {compensated.run.config['workload']['momentum']} for "
                         f"asynchrony's implicit momentum: {self.accuracy(compensated):.1%}"
                         f"{_parenthesised(self.accuracy_spread(compensated))} in {self.wall(compensated):.1f} s")
        verdict = ("agrees: async is faster and less accurate" if gain > 0 and loss_pts > 0 else
                   "agrees on speed; no accuracy loss at this scale" if gain > 0 else
                   "differs: async was not faster here")
        if gain > 0 and self.walls_overlap(asyn, sync):
            verdict += (f" (but the speed-up is within the seeds' spread: {self.wall_range(asyn)} against "
                        f"{self.wall_range(sync)})")
        if loss_pts > 17:
            lowered = self.accuracy(compensated) if compensated is not None else None
            if lowered is not None and lowered <= acc_async:  # then momentum is not what costs the accuracy
                verdict += (f"; the loss exceeds the paper's 4-17 points, and lowering momentum did not recover it "
                            f"({lowered:.1%}): staleness itself costs the accuracy here, not asynchrony's implicit "
                            "momentum")
            else:
                verdict += (f"; the loss exceeds the paper's 4-17 points: with momentum "
                            f"{self.setting.workload['momentum']}, asynchrony's implicit momentum pushes the total "
                            "past stability")
        return _headline(ASYNC_PS, measured, verdict)

    def _stale_aware(self) -> dict[str, str] | None:
        sync, asyn, aware = (self.get(s, self.ps_network, "straggler") for s in ("ps-sync", "ps-async", "ps-stale-aware"))
        if not (sync and asyn and aware):
            return None
        measured = (f"wall {self.wall(aware):.1f} s (async {self.wall(asyn):.1f}, sync {self.wall(sync):.1f}); "
                    f"accuracy {self.accuracy(aware):.1%}{_parenthesised(self.accuracy_spread(aware))} (async "
                    f"{self.accuracy(asyn):.1%}, sync {self.accuracy(sync):.1%})")
        recovered = self.accuracy(aware) >= self.accuracy(asyn)
        slower = self.wall(aware) > self.wall(asyn)
        verdict = ("agrees: it recovers accuracy and pays for it in time" if recovered and slower else
                   f"partly: accuracy {'recovered' if recovered else 'not recovered'}, "
                   f"time {'higher' if slower else 'not higher'} than async")
        return {"headline": "Staleness-aware protocol", "paper": "recovers the accuracy, but its extra "
                "synchronisation eats the speed gain", "measured": measured, "verdict": verdict}

    # -- decisions -------------------------------------------------------------
    def _decisions(self) -> list[str]:
        out = []
        homogeneous = [r for r in self.cells if r.cell.labels["part"] == "accuracy"
                       and r.cell.labels["workers"] == "homogeneous" and r.cell.labels["world_size"] == self.world]
        for network in NETWORKS:
            cands = [r for r in homogeneous if r.cell.labels["network"] == network
                     and (self.accuracy(r) or 0) >= self.setting.target]
            if cands:
                best = min(cands, key=self.time_to_target)
                line = (f"Homogeneous, gang-scheduled workers on the {network} network: "
                        f"{best.cell.labels['strategy']}, the first of the {self.world}-worker strategies to reach "
                        f"{self.setting.target:.0%} accuracy ({self.time_to_target(best):.1f} s of training, "
                        f"{(self.step(best) or 0) * 1e3:.1f} ms per step).")
                if self.single is not None and self.time_to_target(self.single) < self.time_to_target(best):
                    line += (f" One process got there sooner ({self.time_to_target(self.single):.1f} s): at this "
                             f"model size the {network} network's synchronisation costs more than the workers save.")
                out.append(line)
        states = _ratio(self.model_state_bytes(self.by_key.get("memory/fsdp/w4")),
                        self.model_state_bytes(self.by_key.get("memory/ddp/w4")))
        slow = _ratio(self.step(self.get("fsdp", "slow")), self.step(self.get("ddp", "slow")))
        if states is not None:
            out.append(f"Memory-bound (the model states do not fit one device): FSDP, which held {states:.2f}x "
                       f"of DDP's model-state bytes per rank; expect {_fmt(slow, 'x')} DDP's step time on a slow "
                       "network, so use it only when DDP does not fit.")
        stragglers = [r for r in self.cells if r.cell.labels["workers"] == "straggler"
                      and r.cell.labels["network"] == self.ps_network and r.cell.labels["world_size"] == self.world]
        if stragglers:
            fastest = min(stragglers, key=lambda r: self.wall(r) or math.inf)
            accurate = [r for r in stragglers if (self.accuracy(r) or 0) >= self.setting.target]
            sentence = (f"Heterogeneous workers (one 2x straggler, {self.ps_network} network): "
                        f"{fastest.cell.labels['strategy']} finished first ({self.wall(fastest):.1f} s, "
                        f"accuracy {self.accuracy(fastest):.1%})")
            if accurate:
                best = min(accurate, key=lambda r: self.wall(r) or math.inf)
                sentence += (f"; the fastest to reach {self.setting.target:.0%} accuracy was "
                             f"{best.cell.labels['strategy']} ({self.wall(best):.1f} s)")
            servers = [r for r in accurate if r.cell.labels["strategy"] != "ps-sync"
                       and r.cell.labels["strategy"].partition("+")[0] in PS_FAMILY]
            sync = self.get("ps-sync", self.ps_network, "straggler")
            if servers and sync:
                best_ps = min(servers, key=lambda r: self.wall(r) or math.inf)
                ahead, behind = self.wall(best_ps) or 0.0, self.wall(sync) or 0.0
                if ahead < behind and not self.walls_overlap(best_ps, sync):
                    verdict = "workers run ahead pays when the staleness stays bounded"
                elif ahead < behind:
                    verdict = ("workers run ahead made no clear difference here: the seeds' wall times overlap "
                               f"({self.wall_range(best_ps)} against {self.wall_range(sync)})")
                else:
                    verdict = "workers run ahead did not pay here; waiting for the straggler was cheaper"
                sentence += (f". Among parameter servers, {best_ps.cell.labels['strategy']} reached it in "
                             f"{ahead:.1f} s against ps-sync's {behind:.1f} s: letting fast " + verdict)
            out.append(sentence + ".")
        return out

    def _notes(self) -> list[str]:
        notes = measurement_notes(self.results)
        seeds = max((len(members) for members in self.groups.values()), default=1)
        if seeds > 1:
            repeated_cells = sorted({key for key, members in self.groups.items() if len(members) == seeds})
            notes.append(f"{', '.join(repeated_cells)} ran with {seeds} seeds (a server applies updates in "
                         "arrival order, so accuracy and wall time change from run to run); headlines and "
                         "decisions read the medians, and the cell table lists every seed.")
        timing = sorted(_group(r) for r in self.cells if r.cell.labels.get("part") == "timing")
        if timing:
            notes.append(f"{', '.join(timing)}: timing cells ({TIMING_STEPS} steps, step time only; their SGD is "
                         "DDP's, so their accuracy at equal samples is the fast DDP cell's).")
        if self.more_workers:
            notes.append(f"Headlines read the {self.world}-worker cells, except DDP's speedup, which reads every "
                         f"worker count; the {', '.join(map(str, self.more_workers))}-worker cells (more ranks "
                         "than cores here) are in the cell table.")
        return notes + [
            f"Same samples in every accuracy cell: {self.setting.workload['steps']} steps x global batch "
            f"{self.setting.workload['batch_size']}. Times labelled 'effective' use thread CPU time for compute "
            "where ranks outnumber cores.",
        ]


class _ModelAnalysis:
    """The model cells' figures (`--models`): added to the small model's headline rows, or rows of their own
    where the small model has none; step times and memory only (the model cells train no accuracy)."""

    def __init__(self, results: list[CellResult]):
        self.results = results
        self.by_key = {r.cell.key: r for r in results}
        self.names = list(dict.fromkeys(str(r.cell.labels["model"]) for r in results))

    def get(self, model: str, rest: str) -> CellResult | None:
        return self.by_key.get(f"{model}/{rest}")

    def _ratios(self, top: Callable[[str], float | None], bottom: Callable[[str], float | None]) -> dict[str, float]:
        """Per model, top / bottom where both were measured."""
        out = {}
        for m in self.names:
            ratio = _ratio(top(m), bottom(m))
            if ratio is not None:
                out[m] = ratio
        return out

    def step(self, model: str, rest: str) -> float | None:
        r = self.get(model, rest)
        return r.summary.effective_step_s if r else None

    def wall(self, model: str, rest: str) -> float | None:
        r = self.get(model, rest)
        return r.summary.effective_wall_s if r else None

    def speedups(self, network: str, world: int) -> dict[str, float]:
        """One process's step over DDP's, at the same global batch (the small model's definition)."""
        return self._ratios(lambda m: self.step(m, "single/w1"),
                            lambda m: self.step(m, f"ddp/{network}/homogeneous/w{world}"))

    def add_to(self, headlines: list[dict[str, str]]) -> list[dict[str, str]]:
        rows = {h["headline"]: h for h in headlines}
        parts = {DDP_SPEEDUP: self._ddp(), FSDP_MEMORY: self._memory(), FSDP_STEP: self._fsdp_step(),
                 ASYNC_PS: self._async()}
        for title, part in parts.items():
            if part is None:
                continue
            measured, verdict = part
            if title in rows:
                rows[title]["measured"] += f". {measured[0].upper()}{measured[1:]}"
                rows[title]["verdict"] += f"; {verdict}"
            else:
                rows[title] = _headline(title, measured[0].upper() + measured[1:], verdict)
        return sorted(rows.values(), key=lambda h: HEADLINE_ORDER.index(h["headline"]))

    def _setting(self, network: str = "fast") -> str:
        return (f"the paper's models (torchvision, {MODEL_WORKLOAD['image_size']}x{MODEL_WORKLOAD['image_size']}, "
                f"{MODEL_WORKLOAD['batch_size'] // MODEL_WORKERS} images per worker"
                + (f", {network} network" if network else "") + ")")

    def _ddp(self) -> tuple[str, str] | None:
        w = MODEL_WORKERS
        fast = self.speedups("fast", w)
        if not fast:
            return None
        measured = f"{self._setting()}: DDP {_listing(fast, '{:.2f}x')} at {w} workers"
        for world in SCALING_WORKERS:
            more = self.speedups("fast", world) if world != w else {}
            if more:
                measured += f"; {_listing(more, '{:.2f}x')} at {world}"
        slow = self.speedups("slow", w)
        if slow:
            measured += f"; on the slow network {_listing(slow, '{:.2f}x')} at {w}"
        slower = [m for m, v in fast.items() if v < 1]
        verdict = f"the paper's models: DDP faster than one process for {len(fast) - len(slower)} of {len(fast)}"
        waits = [share for m in slower if (r := self.get(m, f"ddp/fast/homogeneous/w{w}"))
                 and (share := r.summary.breakdown_fraction.get("comm_wait_s")) is not None]
        if slower:
            verdict += (f" ({', '.join(slower)} slower" + (f": waiting for the gradient exchange took "
                        f"{_span(waits, '{:.0%}')} of a step" if waits else "") + ")")
        return measured, verdict

    def _memory(self) -> tuple[str, str] | None:
        w = MODEL_WORKERS
        states = self._ratios(lambda m: _Analysis.model_state_bytes(self.get(m, f"memory/fsdp/w{w}")),
                              lambda m: _Analysis.model_state_bytes(self.get(m, f"memory/ddp/w{w}")))
        if not states:
            return None
        peak = self._ratios(lambda m: _Analysis.peak_tensor_bytes(self.get(m, f"memory/fsdp/w{w}")),
                            lambda m: _Analysis.peak_tensor_bytes(self.get(m, f"memory/ddp/w{w}")))
        measured = (f"{self._setting('')} at {w} ranks: FSDP's model states per rank {_listing(states, '{:.2f}x')} "
                    f"DDP's; with activations {_listing(peak, '{:.2f}x')}")
        verdict = (f"the paper's models: {w}-way sharding can at most halve model states "
                   f"({_span(states.values(), '{:.2f}x')} here), so more than 60% less needs more devices than {w}")
        return measured, verdict

    def _fsdp_step(self) -> tuple[str, str] | None:
        w = MODEL_WORKERS
        ratio = {n: self._ratios(lambda m: self.step(m, f"fsdp/{n}/homogeneous/w{w}"),
                                 lambda m: self.step(m, f"ddp/{n}/homogeneous/w{w}")) for n in NETWORKS}
        if not ratio["slow"] and not ratio["fast"]:
            return None
        measured = (f"{self._setting('')}: FSDP's step {_listing(ratio['slow'], '{:.2f}x') or 'n/a'} DDP's on the "
                    f"slow network, {_listing(ratio['fast'], '{:.2f}x') or 'n/a'} on the fast one ({w} workers)")
        slower = [m for m, v in ratio["slow"].items() if v > 1]
        verdict = (f"the paper's models: FSDP slower than DDP on the slow network for {len(slower)} of "
                   f"{len(ratio['slow'])}")
        return measured, verdict

    def _async(self) -> tuple[str, str] | None:
        w = MODEL_WORKERS
        change = {m: v - 1 for m, v in self._ratios(lambda m: self.wall(m, f"ps-async/fast/straggler/w{w}"),
                                                    lambda m: self.wall(m, f"ps-sync/fast/straggler/w{w}")).items()}
        if not change:
            return None
        measured = (f"{self._setting()}, {w} workers with a 2x straggler, {MODEL_WORKLOAD['steps']} steps: ps-async's "
                    f"wall time {_listing(change, '{:+.0%}')} vs ps-sync's")
        faster = [m for m, v in change.items() if v < 0]
        verdict = (f"the paper's models: async faster for {len(faster)} of {len(change)} (their accuracy is not "
                   "measured: a few steps each)")
        return measured, verdict

    def notes(self) -> list[str]:
        if not self.names:
            return []
        return [f"{', '.join(self.names)}: torchvision's networks (weights=None) at {MODEL_WORKLOAD['image_size']}x"
                f"{MODEL_WORKLOAD['image_size']} on the synthetic CIFAR-like images, global batch "
                f"{MODEL_WORKLOAD['batch_size']}, {MODEL_WORKLOAD['steps']} steps per cell (the first left out as "
                f"warm-up): step time and memory only, no accuracy; their memory cells ran at {MODEL_WORKERS} ranks "
                "on the loopback network. The predicted column prices these same networks from their layers "
                "recorded from one forward; n/a where that recording does not match torch's own parameter and "
                "FLOP counts (no model table for it yet)."]


def _listing(values: dict[str, float], fmt: str) -> str:
    return ", ".join(f"{m} {fmt.format(v)}" for m, v in values.items())


def _span(values: Any, fmt: str) -> str:
    """'a' or 'a-b' (the smallest and the largest)."""
    values = sorted(values)
    low, high = fmt.format(values[0]), fmt.format(values[-1])
    return low if low == high else f"{low}-{high}"


# The headlines' titles and what the main study reports for each.
DDP_SPEEDUP, FSDP_MEMORY, FSDP_STEP, ASYNC_PS = ("DDP speedup over one device", "FSDP peak memory per device",
                                                 "FSDP step time vs DDP", "Async PS vs sync PS")
PAPER_CLAIMS = {
    DDP_SPEEDUP: "2-3x, best on homogeneous, gang-scheduled, high-bandwidth clusters",
    FSDP_MEMORY: "4-6x lower (more than 60% less)",
    FSDP_STEP: "higher communication; up to several times slower per step than DDP on a slow network",
    ASYNC_PS: "up to 28% less wall-clock time, 4-17% lower accuracy",
}
HEADLINE_ORDER = (DDP_SPEEDUP, FSDP_MEMORY, FSDP_STEP, ASYNC_PS, "Staleness-aware protocol")


def _headline(title: str, measured: str, verdict: str) -> dict[str, str]:
    return {"headline": title, "paper": PAPER_CLAIMS[title], "measured": measured, "verdict": verdict}


def _add_predictions(headlines: list[dict[str, str]], models: ModelLayers | None = None) -> None:
    """The third column: what the predictor says the paper's own models (or the study's `models`, priced
    from their recorded layers) do on its two clusters; the verdict then compares all three (paper,
    measured here, predicted there)."""
    prediction = paper_prediction(models)
    column = predicted_column(prediction)
    for h in headlines:
        h["predicted"] = column.get(h["headline"], "n/a")
        agreement = predicted_agreement(h["headline"], prediction)
        if agreement:
            h["verdict"] += f"; {agreement}"


def _group(r: CellResult) -> str:
    return str(r.cell.labels.get("group", r.cell.key))


def _final_accuracy(r: CellResult) -> float | None:
    if r.cell.labels.get("part") == "timing":  # stopped after a few steps: no accuracy to compare
        return None
    return r.summary.final_eval["metric"] if r.summary.final_eval else None


def _parenthesised(text: str) -> str:
    return f" ({text})" if text else ""


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.2f}{unit}"
