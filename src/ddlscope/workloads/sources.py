"""The user's own models: `torchvision:NAME`, `timm:NAME`, `hf:ARCH` and `module:PKG.MOD:FACTORY`.

Each source is one registered workload whose `name` carries the model
(`--workload torchvision:resnet50`); everything behind it (strategies, the
loop, the store, reports) is the machinery the built-in workloads use.

- Weights are never downloaded: torchvision and timm models are built with
  `weights=None` / `pretrained=False`, Hugging Face models from their config
  class with random weights, and the hub is switched off before transformers
  is imported.
- Data, by default, is synthetic *with structure to learn*: images are the
  synthetic CIFAR-like gratings of `workloads/vision.py` (resized to the
  model's input resolution), token sequences come from seeded Markov chains
  (a causal LM can bring its perplexity down to the chain's branching
  factor; an encoder tells apart which of 10 chains wrote a sequence). A
  user's own CIFAR-10 or MNIST folder in torchvision's on-disk format is read
  from disk, never downloaded.
- Every spec is checked before any process starts (`Workload.validate`):
  the model is built on the meta device and run once on a meta batch, so a
  wrong name, a knob the architecture lacks or a resolution the model cannot
  take is one line naming what can, not a traceback in a rank.

`module:` is the user's own code; its protocol is in docs/models.md.
"""

from __future__ import annotations

import difflib
import importlib
import os
import warnings
import pickle
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor, nn
from torch.nn import functional as F

from ddlscope.specs import ConfigError, WorkloadSpec, remember_spec_class
from ddlscope.workloads import WORKLOADS
from ddlscope.workloads.base import Dataset, LossFn, Task, TensorDataset, Workload, cross_entropy
from ddlscope.workloads.blocks import wrap_units
from ddlscope.workloads.recompute import BlockRecompute, recompute_blocks
from ddlscope.workloads.vision import PIXEL_STD, synthetic_cifar

SYNTHETIC_CLASSES = 10  # the synthetic images' and the encoder's sequences' classes
MARKOV_BRANCHES = 4  # successors per token: a perfect causal LM reaches perplexity 4
META_BATCH = 2  # the batch of the meta-device forward that checks a model before launch


# --- importing the libraries ------------------------------------------------------------------------


def import_torchvision() -> Any:
    """torchvision, also where its compiled operators do not load.

    PyPI's torchvision wheel is built against the CUDA torch; beside the CPU
    torch its `_C` extension fails to load, and `import torchvision` then
    fails registering a fake kernel for `torchvision::nms`, an operator only
    that extension defines. The classification models use none of its
    operators, so we define the two schemas it registers unguarded (never
    their kernels: calling nms still fails, as it should) and import again.
    Where the extension loads (a matching build, e.g. on a GPU machine) the
    first import succeeds and nothing is defined.
    """
    try:
        import torchvision
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _define_torchvision_schemas()
        import torchvision
    return torchvision


def _torchvision_first() -> None:
    """timm and transformers import torchvision when it is installed: import it our way first."""
    try:
        import_torchvision()
    except ImportError:
        pass


_TORCHVISION_LIBRARY: list[Any] = []  # keeps the schema library alive for the process


def _define_torchvision_schemas() -> None:
    if _TORCHVISION_LIBRARY:
        return
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_LIBRARY.append(lib)


def import_transformers() -> Any:
    """transformers with the hub switched off: nothing is fetched, ever."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        _transformers_without_torchvision()
        import transformers
    except ImportError:
        raise ConfigError("hf: models need the transformers package (pip install transformers)") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _transformers_without_torchvision() -> None:
    """Tell transformers, once per process, that torchvision is absent unless it is loaded already.

    The text models built here need nothing of torchvision, yet transformers
    imports it for its image utilities whenever it is installed, and
    importing torchvision imports torch._dynamo: a second or more of every
    `predict --model hf:...`. transformers caches its answer to "is
    torchvision available" for the process, so it is asked while a None in
    sys.modules hides the package (find_spec then answers None), and the
    package is visible again right after, for torchvision and timm sources.
    """
    if "torchvision" in sys.modules:
        return
    sys.modules["torchvision"] = None  # type: ignore[assignment]
    try:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    finally:
        if sys.modules.get("torchvision", 0) is None:
            del sys.modules["torchvision"]


def _library(source: str) -> Any:
    if source == "torchvision":
        return import_torchvision()
    _torchvision_first()
    try:
        return importlib.import_module(source)
    except ImportError:
        raise ConfigError(f"{source}: models need the {source} package (pip install {source})") from None


# --- specs ------------------------------------------------------------------------------------------


def _source_and_model(name: str, source: str) -> str:
    prefix, sep, model = name.partition(":")
    if prefix != source or not sep or not model.strip():
        raise ValueError(f"expected {source}:NAME, e.g. {SOURCE_EXAMPLES[source]}")
    return model


class SourceSpec(WorkloadSpec):
    """What every model source shares: the optimizer, the batch and the synthetic data's size."""

    batch_size: int = Field(32, ge=1, description="global batch: samples per step, summed over ranks")
    steps: int = Field(50, ge=1, description="optimizer steps to train")
    optimizer: Literal["sgd", "adamw"] = "adamw"
    lr: float = Field(1e-3, gt=0, description="learning rate")
    samples: int = Field(4_000, ge=10, le=200_000, description="training samples generated from the seed (synthetic data)")
    test_samples: int = Field(500, ge=10, le=100_000, description="test samples generated from the seed (synthetic data)")
    recompute: BlockRecompute = Field("none", description="activation recompute: none; full (each of the model's "
                                                          "repeated blocks keeps only its input and runs again in "
                                                          "backward; the blocks FSDP shards)")

    @property
    def model_name(self) -> str:
        """What follows `SOURCE:` in the name."""
        return self.name.partition(":")[2]

    @model_validator(mode="after")
    def _named_by_its_source(self) -> "SourceSpec":
        _source_and_model(self.name, self.source)
        return self

    source: ClassVar[str] = ""


class ImageSpec(SourceSpec):
    """An image classifier: its input resolution and classes, and where its images come from."""

    image_size: int = Field(32, ge=8, le=1024, description="input height and width in pixels (CIFAR's 32 by default)")
    channels: Literal[1, 3] = Field(3, description="input channels")
    classes: int = Field(10, ge=2, le=100_000, description="output classes of the classifier")
    dataset: Literal["synthetic", "cifar10", "mnist"] = Field(
        "synthetic", description="synthetic: CIFAR-like gratings made from the seed (10 classes); cifar10 / mnist: "
                                 "torchvision's on-disk format in data_dir (never downloaded)")
    data_dir: str | None = Field(None, description="folder holding cifar-10-batches-py/ or MNIST/raw/ (dataset cifar10 / mnist)")

    @model_validator(mode="after")
    def _data_fits(self) -> "ImageSpec":
        if self.dataset != "synthetic" and not self.data_dir:
            raise ValueError(f"dataset {self.dataset!r} needs workload.data_dir, the folder that holds it")
        if self.dataset == "synthetic" and self.data_dir:
            raise ValueError("data_dir is read only with dataset = 'cifar10' or 'mnist'")
        if self.classes < SYNTHETIC_CLASSES:
            raise ValueError(f"classes = {self.classes}: the data has {SYNTHETIC_CLASSES} classes; give at least that")
        return self


class TorchvisionSpec(ImageSpec):
    source: ClassVar[str] = "torchvision"
    name: str = Field("torchvision:resnet18", description="torchvision:NAME, any classification model of torchvision's registry")


class TimmSpec(ImageSpec):
    source: ClassVar[str] = "timm"
    name: str = Field("timm:resnet18", description="timm:NAME, any model timm.list_models() names")


class HFSpec(SourceSpec):
    """A Hugging Face transformers model built from its config class (random weights, no hub)."""

    source: ClassVar[str] = "hf"
    name: str = Field("hf:gpt2", description="hf:ARCH, a model type transformers builds as a causal LM or a "
                                             "sequence classifier (gpt2, llama, mistral, qwen2, bert, ...)")
    hidden: int = Field(64, ge=1, le=65_536, description="hidden size")
    layers: int = Field(2, ge=1, le=1_024, description="transformer layers")
    heads: int = Field(4, ge=1, le=1_024, description="attention heads")
    kv_heads: int | None = Field(None, ge=1, le=1_024, description="key/value heads (grouped-query attention; default: heads)")
    intermediate: int | None = Field(None, ge=1, le=1_048_576, description="MLP width (default: 4 x hidden)")
    vocab: int = Field(256, ge=8, le=1_048_576, description="vocabulary size")
    seq_len: int = Field(64, ge=2, le=1_048_576, description="tokens per sequence")

    @model_validator(mode="after")
    def _heads_fit(self) -> "HFSpec":
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be divisible by heads {self.heads}")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must be divisible by kv_heads {self.kv_heads}")
        return self


class ModuleSpec(ImageSpec):
    """The user's own model: `module:package.module:factory` (docs/models.md)."""

    source: ClassVar[str] = "module"
    name: str = Field("module:examples.my_model:build",
                      description="module:PACKAGE.MODULE:FACTORY, a function returning an nn.Module or a UserWorkload")
    args: dict[str, int | float | str | bool] = Field(default_factory=dict, description="keyword arguments for the factory")
    vocab: int = Field(256, ge=8, le=1_048_576, description="vocabulary size (a UserWorkload with inputs = 'tokens')")
    seq_len: int = Field(64, ge=2, le=1_048_576, description="tokens per sequence (inputs = 'tokens')")

    @model_validator(mode="after")
    def _factory_named(self) -> "ModuleSpec":
        module, sep, factory = self.model_name.rpartition(":")
        if not sep or not module or not factory.isidentifier():
            raise ValueError("expected module:PACKAGE.MODULE:FACTORY, e.g. module:examples.my_model:build")
        return self


for _spec in (TorchvisionSpec, TimmSpec, HFSpec, ModuleSpec):
    remember_spec_class(_spec)

SOURCE_EXAMPLES = {"torchvision": "torchvision:resnet50", "timm": "timm:vit_tiny_patch16_224", "hf": "hf:llama",
                   "module": "module:examples.my_model:build"}


# --- the user's own workload (module:) ----------------------------------------------------------------


@dataclass
class UserWorkload:
    """What a `module:` factory may return instead of a bare nn.Module (docs/models.md).

    `inputs` says what the model takes: "image" (float images of the spec's
    channels x image_size x image_size, classified into `classes`) or
    "tokens" (int64 ids of the spec's vocab x seq_len; the model returns
    logits per position, next-token prediction). `datasets(seed)` replaces the
    synthetic data with the user's own (train, test); anything with
    `__len__` and `get(indices) -> (inputs, targets)`, e.g. `TensorDataset`.
    `loss(output, targets)` replaces cross entropy.
    """

    model: nn.Module
    inputs: Literal["image", "tokens"] = "image"
    datasets: Callable[[int], tuple[Dataset, Dataset]] | None = None
    loss: LossFn | None = None
    metric: Literal["accuracy", "perplexity", "loss"] | None = None


# --- data -------------------------------------------------------------------------------------------


@dataclass
class ResizedImages:
    """uint8 images kept as such; `get` scales them and resizes to the model's resolution and channels."""

    images: Tensor  # (n, c, h, w) uint8
    labels: Tensor  # (n,) int64
    size: int
    channels: int

    def __len__(self) -> int:
        return len(self.labels)

    def get(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        x = (self.images[indices].float() - 128) / PIXEL_STD
        if x.shape[1] != self.channels:  # grey -> colour by repeating, colour -> grey by averaging
            x = x.expand(-1, self.channels, -1, -1) if x.shape[1] == 1 else x.mean(dim=1, keepdim=True)
        if x.shape[-1] != self.size or x.shape[-2] != self.size:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return x.contiguous(), self.labels[indices]


def image_splits(spec: ImageSpec, seed: int) -> tuple[ResizedImages, ResizedImages]:
    """(train, test) images for the spec: synthetic from the seed, or the user's folder."""
    if spec.dataset == "synthetic":
        x_train, y_train, x_test, y_test = synthetic_cifar(seed, spec.samples, spec.test_samples)
    else:
        x_train, y_train, x_test, y_test = read_image_folder(spec.dataset, Path(spec.data_dir or "."))
    return (ResizedImages(x_train, y_train, spec.image_size, spec.channels),
            ResizedImages(x_test, y_test, spec.image_size, spec.channels))


FOLDER_LAYOUT = {"cifar10": "cifar-10-batches-py/ (data_batch_1..5, test_batch: the python version)",
                 "mnist": "MNIST/raw/ (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-...)"}


def read_image_folder(dataset: str, root: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CIFAR-10 or MNIST from `root` in torchvision's on-disk format (never downloaded).
    Images come back as (n, c, h, w) uint8 and labels as int64."""
    try:
        if dataset == "cifar10":
            return _read_cifar10(root / "cifar-10-batches-py")
        return _read_mnist(root)
    except (RuntimeError, OSError, ValueError, EOFError, KeyError, pickle.UnpicklingError) as exc:
        raise ConfigError(f"workload.data_dir = {str(root)!r}: no readable {dataset} in it ({_first_line(exc)}); "
                          f"expected {FOLDER_LAYOUT[dataset]}") from None


CIFAR_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))


def _read_cifar10(folder: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The python-version CIFAR-10 batches: pickles of {b"data": (n, 3072) uint8 in CHW order, b"labels"}.

    Read here rather than by torchvision.datasets.CIFAR10, which refuses any
    file whose md5 is not the official one: a user's re-packed or subset
    folder, and the tests' tiny files, would not load. Unpickling runs code
    from the file, as torchvision's loader does: read only folders you trust.
    """
    splits = []
    for names in (CIFAR_TRAIN_BATCHES, ("test_batch",)):
        images, labels = [], []
        for name in names:
            with open(folder / name, "rb") as f:
                batch = pickle.load(f, encoding="bytes")
            images.append(torch.as_tensor(np.asarray(batch[b"data"], dtype=np.uint8)).reshape(-1, 3, 32, 32))
            labels.append(torch.as_tensor(batch[b"labels"], dtype=torch.int64))
        splits += [torch.cat(images), torch.cat(labels)]
    return splits[0], splits[1], splits[2], splits[3]


def _read_mnist(root: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MNIST's idx files under root/MNIST/raw, by torchvision's reader (download=False)."""
    splits = []
    for train in (True, False):
        ds = import_torchvision().datasets.MNIST(root=str(root), train=train, download=False)
        splits += [ds.data.unsqueeze(1).contiguous().to(torch.uint8), torch.as_tensor(ds.targets, dtype=torch.int64)]
    return splits[0], splits[1], splits[2], splits[3]


def markov_sequences(vocab: int, samples: int, length: int, seed: int, chains: int = 1) -> tuple[Tensor, Tensor]:
    """(samples, length) token ids and each sequence's chain (0..chains-1), a pure function of the arguments.

    Each chain gives every token `MARKOV_BRANCHES` successors drawn at random
    from the vocabulary; a sequence starts at a random token and moves to one
    of its successors, uniformly. The best possible next-token perplexity is
    therefore MARKOV_BRANCHES, and different chains are told apart by which
    transitions occur.
    """
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab, (chains, vocab, MARKOV_BRANCHES), generator=gen)
    chain = torch.arange(samples) % chains
    tokens = torch.empty(samples, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab, (samples,), generator=gen)
    for t in range(1, length):
        branch = torch.randint(MARKOV_BRANCHES, (samples,), generator=gen)
        tokens[:, t] = successors[chain, tokens[:, t - 1], branch]
    return tokens, chain


def token_splits(vocab: int, seq_len: int, samples: int, test_samples: int, seed: int,
                 classify: bool) -> tuple[TensorDataset, TensorDataset]:
    """Next-token windows (causal LM), or whole sequences labelled with their chain (classifier)."""
    chains = SYNTHETIC_CLASSES if classify else 1
    length = seq_len if classify else seq_len + 1
    # One draw for both splits, so the test sequences come from the same chains as the training ones.
    tokens, chain = markov_sequences(vocab, samples + test_samples, length, seed, chains)
    if classify:
        x, y = tokens, chain
    else:
        x, y = tokens[:, :-1], tokens[:, 1:]
    return TensorDataset(x[:samples], y[:samples]), TensorDataset(x[samples:], y[samples:])


# --- models -----------------------------------------------------------------------------------------


class HFModel(nn.Module):
    """A transformers model as a plain tensor-in, logits-out module (the loop's contract)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.hf = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.hf(input_ids=input_ids, use_cache=False).logits if self._causal else self.hf(input_ids=input_ids).logits

    @property
    def _causal(self) -> bool:
        return bool(getattr(self.hf.config, "is_decoder", False)) or _is_causal(self.hf)


def _is_causal(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForCausalLM") or type(model).__name__.endswith("LMHeadModel")


def hf_architectures() -> tuple[list[str], list[str]]:
    """(causal LM model types, sequence-classifier model types) this transformers builds."""
    auto = import_transformers().models.auto.modeling_auto
    # BERT-like models are in the causal-LM table too (as decoders); a masked LM is an encoder here.
    encoders = set(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES) & set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    causal = set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - encoders
    return sorted(causal), sorted(encoders)


# What the spec's knobs are called in a transformers config (attribute_map maps GPT-2's n_embd etc.).
HF_KNOBS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size", "vocab": "vocab_size",
            "seq_len": "max_position_embeddings"}
HF_INTERMEDIATE_ALIASES = ("intermediate_size", "n_inner", "ffn_dim", "d_ff")


def hf_config(spec: HFSpec) -> Any:
    """The architecture's config class, with the spec's sizes (a knob it lacks, when set, is an error)."""
    transformers = import_transformers()
    arch = spec.model_name
    causal, encoders = hf_architectures()
    if arch not in causal and arch not in encoders:
        common = [a for a in ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi3", "gpt_neox", "opt", "bert",
                              "roberta", "distilbert") if a in causal or a in encoders]
        raise ConfigError(f"workload.name = {spec.name!r}: transformers {transformers.__version__} builds no causal LM "
                          f"or sequence classifier of type {arch!r}; e.g. {', '.join('hf:' + a for a in common)} "
                          f"({len(causal)} causal LMs and {len(encoders)} encoders in all)")
    config = transformers.AutoConfig.for_model(arch)
    values = {"hidden": spec.hidden, "layers": spec.layers, "heads": spec.heads,
              "kv_heads": spec.kv_heads if spec.kv_heads is not None else spec.heads,
              "intermediate": spec.intermediate if spec.intermediate is not None else 4 * spec.hidden,
              "vocab": spec.vocab, "seq_len": spec.seq_len}
    for knob, value in values.items():
        attribute = _hf_attribute(config, knob)
        if attribute is None:
            # Refused only where the user changed it: a spec read back from JSON lists every field as set.
            # The sequence length still sets the data's, whether the model has a position table or not.
            if knob != "seq_len" and getattr(spec, knob) != HFSpec.model_fields[knob].default:
                raise ConfigError(f"workload.{knob} = {value!r}: {spec.name} has no {HF_KNOBS[knob]}; "
                                  f"leave it out")
            continue
        setattr(config, attribute, value)
    if arch in encoders:
        config.num_labels = SYNTHETIC_CLASSES
    for attribute in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past a small vocabulary break embeddings
        if isinstance(getattr(config, attribute, None), int) and getattr(config, attribute) >= spec.vocab:
            setattr(config, attribute, 0)
    return config


def _hf_attribute(config: Any, knob: str) -> str | None:
    names = HF_INTERMEDIATE_ALIASES if knob == "intermediate" else (HF_KNOBS[knob],)
    for name in names:
        if name in getattr(config, "attribute_map", {}) or hasattr(config, name):
            return name
    return None


def hf_model(spec: HFSpec) -> HFModel:
    transformers = import_transformers()
    config = hf_config(spec)
    causal, _ = hf_architectures()
    auto = transformers.AutoModelForCausalLM if spec.model_name in causal else transformers.AutoModelForSequenceClassification
    return HFModel(auto.from_config(config))


def hf_decoder_facts(spec: HFSpec) -> dict[str, Any]:
    """What a step model of a decoder-only transformer needs from a transformers causal LM, read off
    its config and its model built on the meta device (no memory, any size): the shapes, whether the
    output layer is the input embedding, whether positions are a learned table, the parameters of one
    layer and of the whole model."""
    config = hf_config(spec)  # an architecture transformers lacks is refused here
    if spec.model_name not in hf_architectures()[0]:
        raise ConfigError(f"--model = {spec.name!r}: an encoder; predict and plan price decoder-only language "
                          "models (hf:gpt2, hf:llama, hf:mistral, ...)")
    # One layer is built and the rest counted from it: the layers of a decoder are alike, and a 70B
    # model's 80 layers, even on the meta device, take seconds to construct.
    with _on_meta():
        model = hf_model(spec.model_copy(update={"layers": 1}))
    units = [m for m in model.modules() if type(m).__name__ in set(model.hf._no_split_modules or [])]
    layer_params = sum(p.numel() for p in units[0].parameters()) if units else None
    position_tables = [m for m in model.modules() if isinstance(m, nn.Embedding)
                       and m.num_embeddings == spec.seq_len and m.num_embeddings != spec.vocab]
    return {"hidden": spec.hidden, "heads": spec.heads, "layers": spec.layers, "seq": spec.seq_len,
            "vocab": spec.vocab, "kv_heads": spec.kv_heads or spec.heads,
            "ffn_hidden": spec.intermediate if spec.intermediate is not None else 4 * spec.hidden,
            "tied_embeddings": bool(getattr(config, "tie_word_embeddings", True)),
            "learned_positions": bool(position_tables),
            # A mixture of experts (Mixtral, Qwen-MoE, ...): its configs name the experts in one of two ways.
            "experts": int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0),
            "top_k": int(getattr(config, "num_experts_per_tok", None) or 2),
            "layer_params": layer_params,
            "params": sum(p.numel() for p in model.parameters()) + (spec.layers - 1) * (layer_params or 0)}


def image_model(spec: ImageSpec) -> nn.Module:
    """A torchvision or timm classifier with random weights for the spec's classes and resolution."""
    library = _library(spec.source)
    name = spec.model_name
    known = _image_model_names(spec.source)
    if name not in known:
        close = difflib.get_close_matches(name, known, n=8, cutoff=0.5) or [k for k in COMMON_IMAGE_MODELS if k in known]
        raise ConfigError(f"workload.name = {spec.name!r}: {spec.source} has no classification model {name!r}; "
                          f"e.g. {', '.join(close)} ({len(known)} in all)")
    if spec.source == "torchvision":
        kwargs: dict[str, Any] = {"weights": None, "num_classes": spec.classes}
        if name.startswith(("vit_", "maxvit")):  # their positional embedding is built for one resolution
            kwargs["image_size"] = spec.image_size
        model = library.models.get_model(name, **kwargs)
        return _with_input_channels(model, spec.channels)
    try:
        return library.create_model(name, pretrained=False, num_classes=spec.classes, in_chans=spec.channels,
                                    img_size=spec.image_size)
    except TypeError:  # a convolutional timm model takes any size and has no img_size argument
        return library.create_model(name, pretrained=False, num_classes=spec.classes, in_chans=spec.channels)


COMMON_IMAGE_MODELS = ("resnet18", "resnet50", "vgg16", "densenet121", "efficientnet_v2_s", "efficientnet_b0",
                      "convnext_tiny", "convnext_large", "vit_b_16", "vit_tiny_patch16_224", "mobilenet_v3_small")


def _image_model_names(source: str) -> list[str]:
    if source == "torchvision":
        torchvision = import_torchvision()
        return list(torchvision.models.list_models(module=torchvision.models))
    return list(_library("timm").list_models())


def _with_input_channels(model: nn.Module, channels: int) -> nn.Module:
    """torchvision's classifiers take 3 channels; for 1, replace the first convolution by a 1-channel one."""
    if channels == 3:
        return model
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d) and child.in_channels == 3:
                setattr(parent, child_name, nn.Conv2d(channels, child.out_channels, child.kernel_size, child.stride,
                                                      child.padding, child.dilation, child.groups, child.bias is not None))
                return model
    raise ConfigError("workload.channels = 1: this model's first convolution was not found; use channels = 3")


def user_workload(spec: ModuleSpec) -> UserWorkload:
    """Call the user's factory with the spec's args; a bare nn.Module is an image classifier."""
    module_name, _, factory_name = spec.model_name.rpartition(":")
    if str(Path.cwd()) not in sys.path:  # as `python -m` does: the user's package beside where they run
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"workload.name = {spec.name!r}: cannot import {module_name} ({_first_line(exc)})") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError(f"workload.name = {spec.name!r}: {module_name} has no function {factory_name!r}")
    try:
        made = factory(**spec.args)
    except TypeError as exc:
        raise ConfigError(f"workload.args = {spec.args!r}: {factory_name} refused them ({_first_line(exc)})") from None
    if isinstance(made, nn.Module):
        return UserWorkload(model=made)
    if isinstance(made, UserWorkload):
        return made
    raise ConfigError(f"workload.name = {spec.name!r}: {factory_name} returned a {type(made).__name__}; "
                      "return an nn.Module or a ddlscope UserWorkload")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]


# --- building and checking ---------------------------------------------------------------------------


@contextmanager
def _on_meta() -> Iterator[None]:
    with torch.device("meta"):
        yield


def _meta_or_real(build: Callable[[], Any]) -> Any:
    """`build()` on the meta device, or on the CPU for a model whose constructor reads its own weights
    (torchvision's RegNet copies an initialised tensor: no data on meta)."""
    try:
        with _on_meta():
            return build()
    except NotImplementedError:
        return build()


def model_of(spec: SourceSpec) -> nn.Module:
    """The spec's untrained model (on the current default device), its blocks recomputing if asked."""
    with warnings.catch_warnings():  # libraries' notes about future defaults, not the user's to act on
        warnings.simplefilter("ignore")
        return with_recompute(_model_of(spec), spec)


def with_recompute(model: nn.Module, spec: SourceSpec) -> nn.Module:
    """The model, its blocks recomputing their activations in backward where the spec asks."""
    if spec.recompute == "full":
        recompute_blocks(wrap_units(model))
    return model


def _model_of(spec: SourceSpec) -> nn.Module:
    if isinstance(spec, HFSpec):
        return hf_model(spec)
    if isinstance(spec, ModuleSpec):
        return user_workload(spec).model
    return image_model(spec)  # type: ignore[arg-type]


def example_input(spec: SourceSpec, batch: int, device: torch.device | str = "cpu",
                  inputs: str | None = None) -> Tensor:
    """A batch of the spec's input shape (zeros; token ids 0)."""
    if isinstance(spec, HFSpec) or inputs == "tokens":
        return torch.zeros(batch, spec.seq_len, dtype=torch.int64, device=device)  # type: ignore[attr-defined]
    return torch.zeros(batch, spec.channels, spec.image_size, spec.image_size, device=device)  # type: ignore[attr-defined]


def check_model(spec: SourceSpec) -> None:
    """Build the model on the meta device and run one meta batch through it: every mistake a user can
    make in the name or the knobs shows here, before any process starts, in one line."""
    inputs = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(spec, ModuleSpec):
            made = _meta_or_real(lambda: user_workload(spec))
            model, inputs = made.model, made.inputs
        else:
            model = _meta_or_real(lambda: model_of(spec))
    if isinstance(spec, ImageSpec) and spec.dataset != "synthetic":
        _check_folder(spec.dataset, Path(spec.data_dir or "."))
    if isinstance(spec, HFSpec):
        return  # transformers builds what its config allows; its forward reads mask values (.item()), not meta-safe
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    try:
        with torch.no_grad():
            model(example_input(spec, META_BATCH, device, inputs))
    except Exception as exc:  # noqa: BLE001 (whatever the model raises, the user gets one line)
        hint = " (try a larger workload.image_size)" if isinstance(spec, ImageSpec) else ""
        raise ConfigError(f"workload.name = {spec.name!r}: the model cannot take a batch of {_input_text(spec, inputs)}: "
                          f"{_first_line(exc)}{hint}") from None


def _input_text(spec: SourceSpec, inputs: str | None) -> str:
    if isinstance(spec, HFSpec) or inputs == "tokens":
        return f"{spec.seq_len} tokens"  # type: ignore[attr-defined]
    return f"{spec.channels}x{spec.image_size}x{spec.image_size} images"  # type: ignore[attr-defined]


def _check_folder(dataset: str, root: Path) -> None:
    marker = {"cifar10": root / "cifar-10-batches-py" / "test_batch", "mnist": root / "MNIST" / "raw"}[dataset]
    if not root.is_dir():
        raise ConfigError(f"workload.data_dir = {str(root)!r}: no such folder")
    if not marker.exists():
        raise ConfigError(f"workload.data_dir = {str(root)!r}: no {dataset} in it; expected {FOLDER_LAYOUT[dataset]}")


def _image_task(model: nn.Module, spec: ImageSpec, seed: int) -> Task:
    train, test = image_splits(spec, seed)
    return Task(model=model, train=train, test=test, loss_fn=cross_entropy, metric_name="accuracy",
                higher_is_better=True, eval_batch_size=64)


class _SourceWorkload(Workload):
    @classmethod
    def validate(cls, spec: WorkloadSpec) -> None:
        check_model(cls.checked(spec))

    @classmethod
    def meta_model(cls, spec: WorkloadSpec) -> nn.Module | None:
        return _meta_or_real(lambda: model_of(cls.checked(spec)))


@WORKLOADS.register("torchvision:NAME")
class TorchvisionModel(_SourceWorkload):
    spec_class: ClassVar[type[WorkloadSpec]] = TorchvisionSpec
    description: ClassVar[str] = ("any torchvision classification model (weights=None), on synthetic CIFAR-like "
                                  "images at image_size or your CIFAR-10/MNIST folder, accuracy")

    @classmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        spec = cls.checked(spec)
        torch.manual_seed(seed)
        return _image_task(model_of(spec), spec, seed)


@WORKLOADS.register("timm:NAME")
class TimmModel(TorchvisionModel):
    spec_class: ClassVar[type[WorkloadSpec]] = TimmSpec
    description: ClassVar[str] = "any timm model (pretrained=False), data as torchvision:NAME, accuracy"


@WORKLOADS.register("hf:ARCH")
class HFWorkload(_SourceWorkload):
    spec_class: ClassVar[type[WorkloadSpec]] = HFSpec
    description: ClassVar[str] = ("a Hugging Face transformers causal LM (perplexity) or encoder (accuracy) from its "
                                  "config class, random weights, on Markov-chain token sequences")

    @classmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        spec = cls.checked(spec)
        torch.manual_seed(seed)
        model = model_of(spec)
        causal = model._causal
        train, test = token_splits(spec.vocab, spec.seq_len, spec.samples, spec.test_samples, seed, classify=not causal)
        return Task(model=model, train=train, test=test, loss_fn=cross_entropy,
                    metric_name="perplexity" if causal else "accuracy", higher_is_better=not causal,
                    eval_batch_size=64)


@WORKLOADS.register("module:PKG.MOD:FACTORY")
class ModuleWorkload(_SourceWorkload):
    spec_class: ClassVar[type[WorkloadSpec]] = ModuleSpec
    description: ClassVar[str] = ("your own nn.Module: a factory returning the model (or a UserWorkload with its "
                                  "inputs, data, loss and metric); docs/models.md")

    @classmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        spec = cls.checked(spec)
        torch.manual_seed(seed)
        made = user_workload(spec)
        with_recompute(made.model, spec)
        tokens = made.inputs == "tokens"
        if made.datasets is not None:
            train, test = made.datasets(seed)
        elif tokens:
            train, test = token_splits(spec.vocab, spec.seq_len, spec.samples, spec.test_samples, seed, classify=False)
        else:
            train, test = image_splits(spec, seed)
        metric = made.metric or ("perplexity" if tokens else "accuracy")
        return Task(model=made.model, train=train, test=test, loss_fn=made.loss or cross_entropy, metric_name=metric,
                    higher_is_better=metric == "accuracy", eval_batch_size=64)
