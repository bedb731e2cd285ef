"""The main study's headlines as the predictor sees them on the study's own clusters and models.

The third column of `study paper`'s headline table: the paper's models (ResNet-50, VGG16,
DenseNet-121 at their CIFAR-10 shape, 32x32 and 10 classes) on the catalogue's `paper-fast`
(DGX A100: NVSwitch, HDR InfiniBand) and `paper-slow` (AWS g5.12xlarge: 4x A10G on PCIe, 40 Gb/s
Ethernet), priced by the same CNN model `ddlscope predict --model` uses (predict/cnn_predict.py).
Plain arithmetic, no torch: it costs milliseconds and needs no run.

Setting, stated in each sentence: 4 GPUs (the slow cluster's node; 4 of the fast node's 8),
SGD with momentum, fp32 (TF32 tensor cores), 128 images per GPU (weak scaling: DDP's speedup is
the 4-GPU throughput over one GPU's at the same per-GPU batch), a 2x straggler for the
parameter-server headline (one of the 4 workers computes half as fast).

With `study paper --models`, the column is computed for the models the study ran instead (torchvision's
networks at 32x32, the objects the runs train): each is priced from its layers as recorded from one real
forward (runtime/profiler.py, the path `ddlscope predict --model WORKLOAD` uses), passed in here as data.
A model whose layers could not be recorded faithfully has None, and its figures read "n/a (no model table
yet)" rather than numbers the predictor cannot back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ddlscope.predict.catalogue import make_cluster
from ddlscope.predict.cnn import CNNSpec, Layer
from ddlscope.predict.cnn_predict import CNNPrediction, predict_cnn
from ddlscope.predict.specs import ParallelSpec

PAPER_MODELS = ("resnet50", "vgg16", "densenet121")
CLUSTERS = {"fast": "paper-fast", "slow": "paper-slow"}
GPUS = 4
BATCH_PER_GPU = 128
STRAGGLER = 2.0
NO_MODEL_TABLE = "n/a (no model table yet)"
# A model's recorded layers (None: not predictable yet); None for the whole mapping: the paper's models above.
ModelLayers = Mapping[str, Optional[tuple[Layer, ...]]]


def _predict(model: str, network: str, gpus: int, strategy: str, straggler: float = 1.0,
             layers: tuple[Layer, ...] = ()) -> CNNPrediction:
    spec = CNNSpec(name=model, global_batch=BATCH_PER_GPU * gpus, image_size=32, classes=10, layers=layers)
    cluster = make_cluster(CLUSTERS[network], 1, gpus)
    return predict_cnn(spec, ParallelSpec(dp=gpus, micro_batch=BATCH_PER_GPU), cluster, strategy, straggler=straggler)


@dataclass(frozen=True)
class PaperPrediction:
    """Per model: the predicted figure behind each headline (None: the model is not predicted yet)."""

    ddp_speedup: dict[str, dict[str, float | None]]  # network -> model -> 4-GPU throughput / 1-GPU throughput
    fsdp_memory_ratio: dict[str, float | None]  # model -> FSDP / DDP memory per GPU (fast cluster)
    fsdp_step_ratio: dict[str, dict[str, float | None]]  # network -> model -> FSDP / DDP step time
    async_wall_change: dict[str, float | None]  # model -> ps-async / ps-sync step time - 1, with a straggler (slow)


@dataclass(frozen=True)
class _Model:
    """One model the column prices: its name and, for a model the study ran, its recorded layers."""

    name: str
    layers: tuple[Layer, ...] = ()

    def predict(self, network: str, gpus: int, strategy: str, straggler: float = 1.0) -> CNNPrediction:
        return _predict(self.name, network, gpus, strategy, straggler, self.layers)


def paper_prediction(models: ModelLayers | None = None) -> PaperPrediction:
    """The figures for the paper's models (`models` None) or for the given ones, in their order."""
    chosen = {m: _Model(m) for m in PAPER_MODELS} if models is None else \
        {name: _Model(name, layers) if layers else None for name, layers in models.items()}
    speedup: dict[str, dict[str, float | None]] = {}
    step_ratio: dict[str, dict[str, float | None]] = {}
    for network in CLUSTERS:
        speedup[network] = {m: _ddp_speedup(model, network) if model else None for m, model in chosen.items()}
        step_ratio[network] = {m: _fsdp_step_ratio(model, network) if model else None for m, model in chosen.items()}
    memory = {m: _fsdp_memory_ratio(model) if model else None for m, model in chosen.items()}
    async_change = {m: _async_change(model) if model else None for m, model in chosen.items()}
    return PaperPrediction(speedup, memory, step_ratio, async_change)


def _ddp_speedup(model: _Model, network: str) -> float:
    return GPUS * model.predict(network, 1, "ddp").step_time_s / model.predict(network, GPUS, "ddp").step_time_s


def _fsdp_step_ratio(model: _Model, network: str) -> float:
    return model.predict(network, GPUS, "fsdp").step_time_s / model.predict(network, GPUS, "ddp").step_time_s


def _fsdp_memory_ratio(model: _Model) -> float:
    return model.predict("fast", GPUS, "fsdp").memory_gb_per_gpu / model.predict("fast", GPUS, "ddp").memory_gb_per_gpu


def _async_change(model: _Model) -> float:
    return (model.predict("slow", GPUS, "ps-async", STRAGGLER).step_time_s
            / model.predict("slow", GPUS, "ps-sync", STRAGGLER).step_time_s - 1)


def _per_model(values: dict[str, float | None], fmt: str, unit: str = "x") -> str:
    return ", ".join(f"{model} {NO_MODEL_TABLE}" if value is None else f"{model} {format(value, fmt)}{unit}"
                     for model, value in values.items())


def _present(values: dict[str, float | None]) -> list[float]:
    return [v for v in values.values() if v is not None]


def predicted_column(p: PaperPrediction) -> dict[str, str]:
    """The sentence for each headline (keyed by the headline's title)."""
    setting = f"{GPUS} GPUs, {BATCH_PER_GPU} CIFAR images per GPU"
    return {
        "DDP speedup over one device": (
            f"fast cluster {_per_model(p.ddp_speedup['fast'], '.2f')}; slow cluster "
            f"{_per_model(p.ddp_speedup['slow'], '.2f')} ({setting})"),
        "FSDP peak memory per device": (
            f"{_per_model(p.fsdp_memory_ratio, '.2f')} DDP's memory per GPU (model states shard {GPUS}-way; "
            f"activations of {BATCH_PER_GPU} images do not)"),
        "FSDP step time vs DDP": (
            f"slow cluster {_per_model(p.fsdp_step_ratio['slow'], '.2f')} DDP's step; fast "
            f"{_per_model(p.fsdp_step_ratio['fast'], '.2f')} ({setting})"),
        "Async PS vs sync PS": (
            f"with a {STRAGGLER:g}x straggler on the slow cluster, async step time "
            f"{_per_model(p.async_wall_change, '+.0%', '')} vs sync (one CPU server, "
            f"{GPUS} workers); accuracy is not predicted"),
        "Staleness-aware protocol": "not modelled by the predictor",
    }


def predicted_agreement(headline: str, p: PaperPrediction) -> str:
    """How the prediction compares with the paper's claim, in a few words."""
    if not _present(p.fsdp_memory_ratio):  # every model n/a: nothing to compare
        return ""
    if headline == "DDP speedup over one device":
        fast = min(_present(p.ddp_speedup["fast"]))
        slow = min(_present(p.ddp_speedup["slow"]))
        if fast > 3:
            return (f"predicted above the paper's 2-3x on the fast cluster (at least {fast:.1f}x: 4 GPUs of one "
                    f"NVSwitch node hide the all-reduce behind backward), at least {slow:.1f}x on the slow one")
        return "predicted within or below the paper's range"
    if headline == "FSDP peak memory per device":
        best = min(_present(p.fsdp_memory_ratio))
        return ("predicted agrees" if best < 0.4 else
                f"predicted differs: at most {1 - best:.0%} less, since activations, not model states, dominate "
                "these models' memory at this batch")
    if headline == "FSDP step time vs DDP":
        worst = max(_present(p.fsdp_step_ratio["slow"]))
        return ("predicted agrees: FSDP slower on the slow cluster" if worst > 1.05 else
                f"predicted differs: FSDP at most {worst:.2f}x DDP's step on the slow cluster (the model hides its "
                "gathers behind compute)")
    if headline == "Async PS vs sync PS":
        best = min(_present(p.async_wall_change))
        return (f"predicted agrees on speed (up to {-best:.0%} less time)" if best < 0 else
                "predicted differs: async not faster")
    return ""
