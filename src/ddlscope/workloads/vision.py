"""Vision workloads in the main study's regime: CIFAR-sized CNNs on 32x32x3 images, 10 classes.

    resnet-cifar: stem conv 3x3 -> 4 stages of basic blocks (width w, 2w, 4w, 8w; stride 2
                  from the second stage on) -> global average pool -> linear
    vgg-cifar:    VGG's conv stack from its config list (11/13/16/19 layers, channels scaled
                  by width / 64), five 2x2 max-pools (32 -> 1) -> linear

The data is synthetic (no download at run time; no installed package ships
CIFAR): `synthetic_cifar` draws, from the seed, three grating templates per
class (each class its own orientation, 5 of them, and spatial frequency, 2 of
them; each template in a random colour) and composes each image from three
templates of its class at a random position, scale (1-1.6x) and small
rotation, with a random per-channel gain, on a smooth random background with a
random colour cast, plus one class-independent clutter template (random
blocks) and pixel noise; images are stored as uint8 like CIFAR. Templates are
zero-mean in every channel, so every class's mean image is the same flat
grey: a linear model on raw pixels has almost nothing to use (logistic
regression: about 0.27 test accuracy), while a CNN learns oriented filters
that fire wherever the gratings sit (0.94 after 150 steps; tests/test_vision_workloads.py).

Normalisation is GroupNorm, not BatchNorm: no running-statistics buffers, so
nothing is per-rank state. DDP on a split global batch then computes exactly
what one process computes on the whole batch, and the parameter-server and
FSDP strategies (which move parameters only) need nothing more.

Both models keep their repeated units in `model.blocks` (an nn.ModuleList), so
FSDP shards them block by block (strategies/units.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import tempfile
from abc import abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn
from torch.nn import functional as F

from ddlscope.specs import WorkloadSpec, remember_spec_class
from ddlscope.workloads import WORKLOADS
from ddlscope.workloads.base import Task, Workload, cross_entropy
from ddlscope.workloads.recompute import RECOMPUTE_HELP, BlockRecompute, through_blocks

NUM_CLASSES = 10
CACHE_DIR_ENV = "DDLSCOPE_CACHE_DIR"  # where generated data sets are kept between runs
IMAGE_PX = 32
CHANNELS = 3
MAX_NORM_GROUPS = 8


def _norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with up to 8 groups (the largest count that divides the channels)."""
    return nn.GroupNorm(math.gcd(channels, MAX_NORM_GROUPS), channels)


# --- resnet-cifar -------------------------------------------------------------


class BasicBlock(nn.Module):
    """x -> conv3x3 -> norm -> relu -> conv3x3 -> norm, plus the shortcut, -> relu (He et al. 2016)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = _norm(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:  # projection shortcut: 1x1 conv to the new shape
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet: 3x3 stem (no max-pool), 4 stages of `blocks` basic blocks each (ResNet-18: 2)."""

    def __init__(self, width: int, blocks: int, num_classes: int = NUM_CLASSES, recompute: str = "none"):
        super().__init__()
        self.recompute = recompute
        self.stem = nn.Sequential(nn.Conv2d(CHANNELS, width, 3, padding=1, bias=False), _norm(width), nn.ReLU())
        units: list[nn.Module] = []
        c_in = width
        for stage in range(4):
            c_out = width * 2**stage
            for i in range(blocks):
                units.append(BasicBlock(c_in, c_out, stride=2 if stage > 0 and i == 0 else 1))
                c_in = c_out
        self.blocks = nn.ModuleList(units)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = through_blocks(self.blocks, self.stem(x), self.recompute)
        return self.head(x.mean(dim=(2, 3)))  # global average pool


# --- vgg-cifar ----------------------------------------------------------------

# Simonyan & Zisserman's configurations A, B, D, E: channels of each 3x3 conv, "M" a 2x2 max-pool.
VGG_CONFIGS: dict[int, list[int | str]] = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    """VGG's conv stack for 32x32 inputs (five pools: 32 -> 1), then one linear layer, as CIFAR
    VGGs do (no 4096-wide classifier). Each conv (with the pool after it) is one unit."""

    def __init__(self, depth: int, width: int, num_classes: int = NUM_CLASSES, recompute: str = "none"):
        super().__init__()
        self.recompute = recompute
        units: list[nn.Module] = []
        c_in = CHANNELS
        config = VGG_CONFIGS[depth]
        for i, item in enumerate(config):
            if item == "M":
                continue
            c_out = int(item) * width // 64
            layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), _norm(c_out), nn.ReLU()]
            if i + 1 < len(config) and config[i + 1] == "M":
                layers.append(nn.MaxPool2d(2))
            units.append(nn.Sequential(*layers))
            c_in = c_out
        self.blocks = nn.ModuleList(units)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = through_blocks(self.blocks, x, self.recompute)
        return self.head(x.flatten(1))  # 1x1 after five pools


# --- convnext-cifar -----------------------------------------------------------


class ConvNeXtBlock(nn.Module):
    """x -> depthwise 7x7 -> norm -> 1x1 (4x channels) -> GELU -> 1x1 (back) -> x layer-scaled, + x
    (Liu et al. 2022). The norm is GroupNorm with one group: LayerNorm over (C, H, W), the
    channels-first stand-in CIFAR ConvNeXts use; the 1x1 convs are ConvNeXt's pointwise linears.
    Layer scale starts at 1, not the paper's 1e-6: with 1e-6 every block starts as the identity and
    150 steps on the synthetic set reached 0.22 accuracy (width 16), against 0.54 from 1."""

    def __init__(self, channels: int, layer_scale: float = 1.0):
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.GroupNorm(1, channels)
        self.expand = nn.Conv2d(channels, 4 * channels, 1)
        self.reduce = nn.Conv2d(4 * channels, channels, 1)
        self.gamma = nn.Parameter(torch.full((channels, 1, 1), layer_scale))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.gamma * self.reduce(F.gelu(self.expand(self.norm(self.depthwise(x)))))


class ConvNeXt(nn.Module):
    """CIFAR ConvNeXt: a 2x2 stride-2 patchify stem (32 -> 16), four stages of `depth` blocks at
    width w, 2w, 4w, 8w, each later stage entered by norm + 2x2 stride-2 conv (16 -> 8 -> 4 -> 2),
    global average pool, norm, linear. Downsampling layers join the block after them as one unit."""

    def __init__(self, width: int, depth: int, num_classes: int = NUM_CLASSES, recompute: str = "none"):
        super().__init__()
        self.recompute = recompute
        self.stem = nn.Sequential(nn.Conv2d(CHANNELS, width, 2, stride=2), nn.GroupNorm(1, width))
        units: list[nn.Module] = []
        c_in = width
        for stage in range(4):
            c_out = width * 2**stage
            for i in range(depth):
                down: list[nn.Module] = ([nn.GroupNorm(1, c_in), nn.Conv2d(c_in, c_out, 2, stride=2)]
                                         if stage > 0 and i == 0 else [])
                units.append(nn.Sequential(*down, ConvNeXtBlock(c_out)))
                c_in = c_out
        self.blocks = nn.ModuleList(units)
        self.head_norm = nn.LayerNorm(c_in)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = through_blocks(self.blocks, self.stem(x), self.recompute)
        return self.head(self.head_norm(x.mean(dim=(2, 3))))


# --- data: a synthetic CIFAR-like set -----------------------------------------

TEMPLATES_PER_CLASS = 3
CLUTTER_TEMPLATES = 8
TEMPLATE_PX = 16  # side of a template before scaling
GRATING_FREQUENCIES = (0.12, 0.2)  # cycles per pixel: classes 0-4, 5-9
OBJECTS_PER_IMAGE = 3  # templates of the image's own class
SCALE_RANGE = (1.0, 1.6)
MAX_ROTATION_RAD = math.pi / 18
GAIN_RANGE = (0.6, 1.4)  # per-channel colour gain of each object
BACKGROUND_STD = 0.3
NOISE_STD = 0.25
PIXEL_STD = 48.0  # unit of the composed image, in uint8 levels around 128
CHUNK = 2048  # images composed at a time (bounds the memory of grid_sample)


def _generator(seed: int, stream: int) -> torch.Generator:
    """An independent generator per (seed, stream): templates, train and test never share draws."""
    state = np.random.SeedSequence([seed, stream]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def _window() -> Tensor:
    """(T, T): 1 in the middle, falling to 0 at the rim, so a placed template has no hard edge."""
    r = torch.linspace(-1, 1, TEMPLATE_PX)
    return (1.3 * (1 - (r[:, None] ** 2 + r[None, :] ** 2))).clamp(0, 1)


def _zero_mean(pattern: Tensor, window: Tensor) -> Tensor:
    """Remove each channel's mean under the window: a template adds nothing to an image's mean."""
    return pattern - pattern.mean(dim=(-2, -1), keepdim=True) * window / window.mean()


def _colour(count: int, gen: torch.Generator) -> Tensor:
    """(count, 3, 1, 1) random colours of norm sqrt(3)."""
    colour = torch.randn(count, CHANNELS, 1, 1, generator=gen)
    return colour / colour.norm(dim=1, keepdim=True) * math.sqrt(CHANNELS)


def _class_templates(gen: torch.Generator) -> Tensor:
    """(classes, K, 3, T, T): gratings, each class its own orientation and spatial frequency (5 x 2),
    every template a little off its class's, in its own random colour."""
    classes = torch.arange(NUM_CLASSES).repeat_interleave(TEMPLATES_PER_CLASS)
    n = len(classes)
    angle = (classes % 5) * math.pi / 5 + torch.randn(n, generator=gen) * 0.05
    freq = torch.tensor(GRATING_FREQUENCIES)[classes // 5] * (1 + torch.randn(n, generator=gen) * 0.05)
    r = torch.arange(TEMPLATE_PX) - (TEMPLATE_PX - 1) / 2
    along = r[None, None, :] * torch.cos(angle)[:, None, None] + r[None, :, None] * torch.sin(angle)[:, None, None]
    phase = torch.rand(n, 1, 1, generator=gen) * 2 * math.pi
    window = _window()
    grating = _zero_mean(torch.cos(2 * math.pi * freq[:, None, None] * along + phase) * window, window)
    templates = grating[:, None] * _colour(n, gen)
    return templates.reshape(NUM_CLASSES, TEMPLATES_PER_CLASS, CHANNELS, TEMPLATE_PX, TEMPLATE_PX)


def _clutter_templates(gen: torch.Generator) -> Tensor:
    """(CLUTTER_TEMPLATES, 3, T, T): random +-1 blocks (4 x 4 cells), in random colours, no class."""
    cells = torch.randint(2, (CLUTTER_TEMPLATES, 1, 4, 4), generator=gen).float() * 2 - 1
    window = _window()
    blocks = _zero_mean(F.interpolate(cells, size=(TEMPLATE_PX, TEMPLATE_PX), mode="nearest") * window, window)
    return blocks * _colour(CLUTTER_TEMPLATES, gen)


def _place(templates: Tensor, gen: torch.Generator) -> Tensor:
    """Each (3, T, T) template onto a 32x32 canvas at a random position, scale, rotation and colour gain."""
    n = len(templates)
    scale = torch.empty(n).uniform_(*SCALE_RANGE, generator=gen) * TEMPLATE_PX / IMAGE_PX
    angle = torch.empty(n).uniform_(-MAX_ROTATION_RAD, MAX_ROTATION_RAD, generator=gen)
    shift = torch.empty(n, 2).uniform_(-0.7, 0.7, generator=gen)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    # grid_sample maps each output pixel to template coordinates: A (p - shift), A = R(-angle) / scale
    a = torch.stack([torch.stack([cos, sin], -1), torch.stack([-sin, cos], -1)], 1)  # (n, 2, 2)
    theta = torch.cat([a, -(a @ shift[:, :, None])], dim=2)
    gain = torch.empty(n, CHANNELS, 1, 1).uniform_(*GAIN_RANGE, generator=gen)
    grid = F.affine_grid(theta, [n, CHANNELS, IMAGE_PX, IMAGE_PX], align_corners=False)
    return F.grid_sample(templates * gain, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _compose(labels: Tensor, templates: Tensor, clutter: Tensor, gen: torch.Generator) -> Tensor:
    """uint8 images (n, 3, 32, 32) of the given labels."""
    n = len(labels)
    coarse = torch.randn(n, CHANNELS, 4, 4, generator=gen) * BACKGROUND_STD
    image = F.interpolate(coarse, size=(IMAGE_PX, IMAGE_PX), mode="bilinear", align_corners=True)
    image = image + torch.randn(n, CHANNELS, 1, 1, generator=gen) * BACKGROUND_STD  # overall colour cast
    for _ in range(OBJECTS_PER_IMAGE):
        which = torch.randint(TEMPLATES_PER_CLASS, (n,), generator=gen)
        image = image + _place(templates[labels, which], gen)
    image = image + _place(clutter[torch.randint(len(clutter), (n,), generator=gen)], gen)
    image = image + torch.randn(image.shape, generator=gen) * NOISE_STD
    return (image * PIXEL_STD + 128).round().clamp(0, 255).to(torch.uint8)


@lru_cache(maxsize=2)
def synthetic_cifar(seed: int, train_samples: int, test_samples: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_test, y_test): uint8 images (n, 3, 32, 32), int64 labels, classes balanced
    (label i is i mod 10, so the data order alone shuffles them). A pure function of the arguments.

    Generating the default 12,000 images costs every rank about 2 s of CPU, more than a short run's
    training on this machine, so the result is kept in a file cache (`DDLSCOPE_CACHE_DIR`, else
    ~/.cache/ddlscope) named by the arguments and a digest of this module and of torch's version
    (what the images are a function of): other ranks and later runs load it instead. A cache that
    cannot be read is regenerated; one that cannot be written is skipped.
    """
    path = _cache_dir() / f"synthetic-cifar-{_generator_digest()}-{seed}-{train_samples}-{test_samples}.pt"
    try:
        x_train, y_train, x_test, y_test = torch.load(path, weights_only=True)
        return x_train, y_train, x_test, y_test
    except Exception:  # noqa: BLE001 (absent, truncated or foreign: any failure means generate)
        pass
    data = _generate_synthetic_cifar(seed, train_samples, test_samples)
    _write_atomically(path, data)
    return data


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get(CACHE_DIR_ENV) or Path(base) / "ddlscope")


@lru_cache(maxsize=1)
def _generator_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes() + torch.__version__.encode()).hexdigest()[:16]


def _write_atomically(path: Path, data: tuple[Tensor, ...]) -> None:
    """Write to a private temporary file beside `path`, then rename: a reader sees all or nothing."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
        os.replace(tmp, path)
    except OSError:  # a read-only or full disk: the cache is only a speed-up
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _generate_synthetic_cifar(seed: int, train_samples: int, test_samples: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with torch.device("cpu"):  # real tensors even when the model is built on the meta device
        gen = _generator(seed, 0)
        templates = _class_templates(gen)
        clutter = _clutter_templates(gen)
        splits = []
        for stream, n in ((1, train_samples), (2, test_samples)):
            split_gen = _generator(seed, stream)
            labels = torch.arange(n) % NUM_CLASSES
            images = torch.cat([_compose(labels[i : i + CHUNK], templates, clutter, split_gen)
                                for i in range(0, n, CHUNK)]) if n else torch.empty(0, CHANNELS, IMAGE_PX, IMAGE_PX, dtype=torch.uint8)
            splits += [images, labels]
    return splits[0], splits[1], splits[2], splits[3]


@dataclass
class ImageDataset:
    """uint8 images, kept as such (a quarter of float32's memory on every rank); `get` scales them."""

    images: Tensor  # (n, 3, 32, 32) uint8
    labels: Tensor  # (n,) int64

    def __len__(self) -> int:
        return len(self.labels)

    def get(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        return (self.images[indices].float() - 128) / PIXEL_STD, self.labels[indices]


def _task(model: nn.Module, spec: "VisionSpec", seed: int) -> Task:
    x_train, y_train, x_test, y_test = synthetic_cifar(seed, spec.samples, spec.test_samples)
    return Task(model=model, train=ImageDataset(x_train, y_train), test=ImageDataset(x_test, y_test),
                loss_fn=cross_entropy, metric_name="accuracy", higher_is_better=True)


# --- workloads ----------------------------------------------------------------


class VisionSpec(WorkloadSpec):
    """What both vision workloads share: the batch, the optimizer, the synthetic data's size."""

    name: str = "resnet-cifar"
    batch_size: int = Field(32, ge=1, description="global batch: images per step, summed over ranks")
    optimizer: Literal["sgd", "adamw"] = "adamw"
    lr: float = Field(2e-3, gt=0, description="learning rate")
    samples: int = Field(10_000, ge=10, le=200_000, description="training images generated from the seed")
    test_samples: int = Field(2_000, ge=10, le=100_000, description="test images generated from the seed")
    recompute: BlockRecompute = Field("none", description=RECOMPUTE_HELP)


class ResnetCifarSpec(VisionSpec):
    name: str = "resnet-cifar"
    width: int = Field(16, ge=1, le=512, description="channels of the first stage (then 2x, 4x, 8x); ResNet-18 has 64")
    blocks: int = Field(2, ge=1, le=16, description="basic blocks per stage (2: the ResNet-18 layout)")


class VggCifarSpec(VisionSpec):
    name: str = "vgg-cifar"
    depth: Literal[11, 13, 16, 19] = Field(11, description="VGG configuration: conv layers + 1 (A, B, D, E)")
    width: int = Field(32, ge=1, le=512, description="channels of the first conv (VGG has 64; the rest scale with it)")


class ConvnextCifarSpec(VisionSpec):
    name: str = "convnext-cifar"
    width: int = Field(24, ge=1, le=512, description="channels of the first stage (then 2x, 4x, 8x); ConvNeXt-T has 96")
    depth: int = Field(1, ge=1, le=16, description="ConvNeXt blocks per stage (ConvNeXt-T: 3, 3, 9, 3)")


remember_spec_class(ResnetCifarSpec)
remember_spec_class(VggCifarSpec)
remember_spec_class(ConvnextCifarSpec)

DATA_NOTE = "synthetic CIFAR-like 32x32x3 gratings, 10 classes"


class _VisionWorkload(Workload):
    """What the vision workloads share: seed the initialisation, build the network, add the data."""

    @classmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        spec = cls.checked(spec)
        torch.manual_seed(seed)
        return _task(cls.network(spec), spec, seed)

    @staticmethod
    @abstractmethod
    def network(spec) -> nn.Module:  # noqa: ANN001 (each subclass's own spec class)
        """The untrained network the spec describes."""


@WORKLOADS.register("resnet-cifar")
class ResnetCifar(_VisionWorkload):
    spec_class: ClassVar[type[WorkloadSpec]] = ResnetCifarSpec
    description: ClassVar[str] = f"CIFAR ResNet (basic blocks, GroupNorm) on {DATA_NOTE}, accuracy"

    @staticmethod
    def network(spec: ResnetCifarSpec) -> nn.Module:
        return ResNet(spec.width, spec.blocks, recompute=spec.recompute)


@WORKLOADS.register("vgg-cifar")
class VggCifar(_VisionWorkload):
    spec_class: ClassVar[type[WorkloadSpec]] = VggCifarSpec
    description: ClassVar[str] = f"VGG (config list, GroupNorm) on {DATA_NOTE}, accuracy"

    @staticmethod
    def network(spec: VggCifarSpec) -> nn.Module:
        return VGG(spec.depth, spec.width, recompute=spec.recompute)


@WORKLOADS.register("convnext-cifar")
class ConvnextCifar(_VisionWorkload):
    spec_class: ClassVar[type[WorkloadSpec]] = ConvnextCifarSpec
    description: ClassVar[str] = f"CIFAR ConvNeXt (depthwise 7x7, inverted bottleneck, GELU) on {DATA_NOTE}, accuracy"

    @staticmethod
    def network(spec: ConvnextCifarSpec) -> nn.Module:
        return ConvNeXt(spec.width, spec.depth, recompute=spec.recompute)
