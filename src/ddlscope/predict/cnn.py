"""Convolutional networks as explicit layer lists (torch-free): parameters, multiply-adds,
activation bytes and per-layer compute time.

Each architecture is built by a small function that walks the network the way
torchvision's model does, one `Layer` per operation that costs time or keeps
memory (convolution, linear, batch norm, ReLU, pooling, residual add,
concatenation, dropout), with the spatial size carried along. At
`image_size` 224 it is the ImageNet network (torchvision's `resnet50`,
`vgg16`, `densenet121`); at 32 the CIFAR variant (see `CNNSpec`).

Counts, per sample:

* parameters: conv `c_out (c_in / g) k^2 (+ c_out bias)`, linear
  `c_out c_in + c_out`, batch norm `2 c` (weight and bias; the running
  statistics are buffers).
* multiply-adds (MACs): conv `h_out^2 c_out (c_in / g) k^2`, linear
  `c_out c_in`; convolutions and linear layers only, the convention behind
  the published "GFLOPs" of these models (torchvision lists ResNet-50 at
  4.09, VGG16 at 15.47, DenseNet-121 at 2.83: multiply-adds). Forward FLOPs
  are 2 x MACs.
* activation bytes saved for backward: every new tensor a backward needs
  (outputs of conv, norm, pooling, linear, concatenation, dropout, and the
  input image), at the activation dtype, plus max-pool indices (int64) and
  dropout masks (1 byte). In-place ReLU and the in-place residual add make no
  new tensor; the downsample branch's norm output is added in place and
  freed (`saves_output=False`).

Time of one layer for a micro-batch of b (element-wise over numpy arrays):
a convolution is an implicit GEMM, per group M = b h_out^2, N = c_out / g,
K = (c_in / g) k^2, priced by `compute.gemm_s` (the GPT model's efficiency
curve and roofline, with the bytes an implicit GEMM really moves: input,
weights, output); backward is the data-gradient GEMM (M x N) @ (N x K) and
the weight-gradient GEMM (K x M) @ (M x N), 2 x the forward FLOPs (the
first convolution has no data gradient: the images need none). Norm, ReLU,
pooling, add, concat and dropout are memory-bound: bytes moved / achieved
memory bandwidth, backward moving `compute.BACKWARD_TRAFFIC_RATIO` times the
forward's bytes. Each layer pays one kernel gap forward and two backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ddlscope.predict import compute
from ddlscope.predict.catalogue import Device
from ddlscope.predict.specs import BYTES_PER_ELEMENT
from ddlscope.specs import ConfigError
from ddlscope.specs.prediction import CNN_MODELS, Optimizer  # one list for the CLI's input and the model

Kind = Literal["conv", "linear", "norm", "relu", "maxpool", "avgpool", "add", "concat", "dropout"]
IMAGE_SIZES = (224, 32)

# Bytes read + written per output element by the memory-bound layers' forward, in units of the
# activation dtype: batch norm reads its input twice (statistics, then normalise) and writes once;
# ReLU reads and writes; the residual add reads two and writes one; concatenation copies (read +
# write); dropout reads and writes (its 1-byte mask is added separately); pooling reads its inputs
# (k^2 / stride^2 per output, at least 1) and writes the output.
NORM_PASSES = 3
RELU_PASSES = 2
ADD_PASSES = 3
CONCAT_PASSES = 2
DROPOUT_PASSES = 2
KERNELS_FORWARD_PER_LAYER = 1
KERNELS_BACKWARD_PER_LAYER = 2
MAXPOOL_INDEX_BYTES = 8  # int64 argmax per output element, kept for backward
DROPOUT_MASK_BYTES = 1


@dataclass(frozen=True)
class Layer:
    """One operation of a CNN for one sample. Spatial sizes are square (h x h)."""

    kind: Kind
    name: str
    unit: int  # FSDP wrap unit (a residual block, a dense layer, a conv, the stem, the classifier)
    c_in: int
    c_out: int
    h_in: int
    h_out: int
    kernel: int = 1
    stride: int = 1
    groups: int = 1
    bias: bool = False
    saves_output: bool = True  # its output is a new tensor a backward keeps
    first: bool = False  # consumes the images: no data gradient
    # Positions the layer runs at, each on its own, beside the h x h grid: a linear layer or norm applied
    # per pixel of a channels-last image or per token of a ViT (1 for a channels-first CNN's layers).
    positions: int = 1

    @property
    def params(self) -> int:
        if self.kind == "conv":
            return self.c_out * (self.c_in // self.groups) * self.kernel**2 + (self.c_out if self.bias else 0)
        if self.kind == "linear":
            return self.c_out * self.c_in + self.c_out
        if self.kind == "norm":
            return 2 * self.c_out
        return 0

    @property
    def macs(self) -> int:
        """Multiply-adds per sample (convolutions and linear layers only)."""
        if self.kind in ("conv", "linear"):
            return self.h_out**2 * self.positions * self.c_out * (self.c_in // self.groups) * self.kernel**2
        return 0

    @property
    def in_elements(self) -> int:
        return self.c_in * self.h_in**2 * self.positions

    @property
    def out_elements(self) -> int:
        return self.c_out * self.h_out**2 * self.positions

    @property
    def gemm(self) -> tuple[int, int, int, int]:
        """(M per sample, N, K, groups) of the implicit GEMM of a conv or linear layer."""
        return (self.h_out**2 * self.positions, self.c_out // self.groups, (self.c_in // self.groups) * self.kernel**2,
                self.groups)

    def saved_bytes(self, act_bytes: int) -> int:
        """Bytes this layer adds to what autograd keeps for backward, per sample."""
        out = self.out_elements * act_bytes if self.saves_output and self.kind not in ("relu", "add") else 0
        if self.first:
            out += self.in_elements * act_bytes  # the images, kept by the first convolution
        if self.kind == "maxpool":
            out += self.out_elements * MAXPOOL_INDEX_BYTES
        if self.kind == "dropout":
            out += self.out_elements * DROPOUT_MASK_BYTES
        return out

    def forward_elements_moved(self) -> float:
        """Elements read + written by a memory-bound layer's forward (0 for conv/linear)."""
        if self.kind == "norm":
            return NORM_PASSES * self.out_elements
        if self.kind == "relu":
            return RELU_PASSES * self.out_elements
        if self.kind == "add":
            return ADD_PASSES * self.out_elements
        if self.kind == "concat":
            return CONCAT_PASSES * self.out_elements
        if self.kind == "dropout":
            return DROPOUT_PASSES * self.out_elements
        if self.kind in ("maxpool", "avgpool"):
            return max(self.in_elements, self.out_elements) + self.out_elements
        return 0.0


@dataclass(frozen=True)
class CNNSpec:
    """A vision model and the batch it trains with.

    `image_size` 224: the ImageNet network (torchvision's); 32: the CIFAR
    variant (ResNet-50 and DenseNet-121 with a 3x3 stride-1 stem and no max
    pool; VGG16 with its 13 convolutions and one 512 -> classes linear
    classifier, the usual CIFAR VGG). `dtype`: of the activations and the
    tensor-core work; "fp32" runs at the TF32 peak (PyTorch's cuDNN default),
    "bf16"/"fp16" is automatic mixed precision. Weights, gradients and
    optimizer states stay fp32 either way (PyTorch AMP keeps fp32 parameters).
    """

    name: str
    global_batch: int
    image_size: int = 224
    classes: int = 1000
    dtype: str = "fp32"
    optimizer: Optimizer = "sgd-momentum"
    # A registered workload's own network, recorded from its forward (`ddlscope predict --model
    # resnet-cifar`); empty for the built-in models, which `name` picks.
    layers: tuple[Layer, ...] = ()

    @property
    def activation_bytes(self) -> int:
        return BYTES_PER_ELEMENT.get(self.dtype, 4)

    @property
    def compute_dtype(self) -> str:
        return "tf32" if self.dtype == "fp32" else self.dtype


def validate_cnn(spec: CNNSpec) -> None:
    if spec.name not in CNN_MODELS and not spec.layers:
        raise ConfigError(f"model = {spec.name!r}: allowed: gpt, {', '.join(CNN_MODELS)}")
    if spec.image_size not in IMAGE_SIZES and not spec.layers:
        raise ConfigError(f"image_size = {spec.image_size}: allowed: 224 (ImageNet), 32 (CIFAR)")
    if not 1 <= spec.classes <= 2**20:
        raise ConfigError(f"classes = {spec.classes}: must be between 1 and {2**20:,}")
    if not 1 <= spec.global_batch <= 2**24:
        raise ConfigError(f"global_batch = {spec.global_batch}: must be between 1 and {2**24:,}")
    if spec.dtype not in BYTES_PER_ELEMENT:
        raise ConfigError(f"dtype = {spec.dtype!r}: allowed: {', '.join(BYTES_PER_ELEMENT)}")
    if spec.optimizer not in ("sgd", "sgd-momentum", "adamw"):
        raise ConfigError(f"optimizer = {spec.optimizer!r}: allowed: sgd, sgd-momentum, adamw")


# ---------------------------------------------------------------------------- building the layer lists
@dataclass
class _Builder:
    channels: int
    size: int
    unit: int = 0
    layers: list[Layer] = field(default_factory=list)

    def conv(self, name: str, c_out: int, kernel: int, stride: int = 1, padding: int = 0, groups: int = 1,
             bias: bool = False, c_in: int | None = None, size: int | None = None, advance: bool = True) -> Layer:
        c_in = self.channels if c_in is None else c_in
        h_in = self.size if size is None else size
        h_out = (h_in + 2 * padding - kernel) // stride + 1
        layer = Layer("conv", name, self.unit, c_in, c_out, h_in, h_out, kernel, stride, groups, bias,
                      first=not self.layers)
        self.layers.append(layer)
        if advance:
            self.channels, self.size = c_out, h_out
        return layer

    def same(self, kind: Kind, name: str, saves_output: bool = True, channels: int | None = None,
             size: int | None = None) -> None:
        """A layer that keeps the shape (norm, relu, add, dropout)."""
        c = self.channels if channels is None else channels
        h = self.size if size is None else size
        self.layers.append(Layer(kind, name, self.unit, c, c, h, h, saves_output=saves_output))

    def pool(self, kind: Kind, name: str, kernel: int, stride: int, padding: int = 0) -> None:
        h_out = (self.size + 2 * padding - kernel) // stride + 1
        self.layers.append(Layer(kind, name, self.unit, self.channels, self.channels, self.size, h_out, kernel, stride))
        self.size = h_out

    def global_pool(self, name: str, out: int = 1) -> None:
        self.layers.append(Layer("avgpool", name, self.unit, self.channels, self.channels, self.size, out,
                                 max(self.size // out, 1), max(self.size // out, 1)))
        self.size = out

    def linear(self, name: str, c_out: int) -> None:
        c_in = self.channels * self.size**2  # flatten
        self.layers.append(Layer("linear", name, self.unit, c_in, c_out, 1, 1, bias=True))
        self.channels, self.size = c_out, 1

    def next_unit(self) -> None:
        self.unit += 1


def resnet50_layers(image_size: int = 224, classes: int = 1000) -> list[Layer]:
    """torchvision resnet50 (v1.5: stride on the 3x3 conv); at 32 the CIFAR stem (3x3/1, no max pool)."""
    b = _Builder(channels=3, size=image_size)
    if image_size >= 64:
        b.conv("conv1", 64, 7, stride=2, padding=3)
        b.same("norm", "bn1")
        b.same("relu", "relu")
        b.pool("maxpool", "maxpool", 3, 2, 1)
    else:
        b.conv("conv1", 64, 3, stride=1, padding=1)
        b.same("norm", "bn1")
        b.same("relu", "relu")
    for stage, (blocks, planes, stride) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), (1, 2, 2, 2)), 1):
        for i in range(blocks):
            b.next_unit()
            s = stride if i == 0 else 1
            c_in, h_in = b.channels, b.size
            p = f"layer{stage}.{i}"
            b.conv(f"{p}.conv1", planes, 1)
            b.same("norm", f"{p}.bn1")
            b.same("relu", f"{p}.relu1")
            b.conv(f"{p}.conv2", planes, 3, stride=s, padding=1)
            b.same("norm", f"{p}.bn2")
            b.same("relu", f"{p}.relu2")
            b.conv(f"{p}.conv3", planes * 4, 1)
            b.same("norm", f"{p}.bn3")
            if i == 0:  # projection shortcut: its norm output is added in place and freed
                b.conv(f"{p}.downsample.0", planes * 4, 1, stride=s, c_in=c_in, size=h_in, advance=False)
                b.same("norm", f"{p}.downsample.1", saves_output=False)
            b.same("add", f"{p}.add")
            b.same("relu", f"{p}.relu3")
    b.next_unit()
    b.global_pool("avgpool")
    b.linear("fc", classes)
    return b.layers


VGG16_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16_layers(image_size: int = 224, classes: int = 1000) -> list[Layer]:
    """torchvision vgg16 (no batch norm; 7x7 adaptive pool, 4096-wide classifier with dropout);
    at 32 the CIFAR VGG16: the same convolutions, one 512 -> classes linear layer."""
    b = _Builder(channels=3, size=image_size)
    for i, v in enumerate(VGG16_CONFIG):
        if v == "M":
            b.pool("maxpool", f"features.{i}", 2, 2)
            continue
        b.next_unit() if b.layers else None
        b.conv(f"features.{i}", int(v), 3, padding=1, bias=True)
        b.same("relu", f"features.{i}.relu")
    b.next_unit()
    if image_size >= 64:
        b.global_pool("avgpool", 7)
        b.linear("classifier.0", 4096)
        b.same("relu", "classifier.1")
        b.same("dropout", "classifier.2")
        b.next_unit()
        b.linear("classifier.3", 4096)
        b.same("relu", "classifier.4")
        b.same("dropout", "classifier.5")
        b.next_unit()
        b.linear("classifier.6", classes)
    else:
        b.linear("classifier", classes)
    return b.layers


def densenet121_layers(image_size: int = 224, classes: int = 1000, growth: int = 32,
                       blocks: tuple[int, ...] = (6, 12, 24, 16), bn_size: int = 4,
                       compression: float = 0.5) -> list[Layer]:
    """torchvision densenet121 (memory_efficient=False: every dense layer concatenates its inputs
    into a new tensor); at 32 the CIFAR stem (3x3/1, no max pool)."""
    b = _Builder(channels=3, size=image_size)
    if image_size >= 64:
        b.conv("features.conv0", 64, 7, stride=2, padding=3)
        b.same("norm", "features.norm0")
        b.same("relu", "features.relu0")
        b.pool("maxpool", "features.pool0", 3, 2, 1)
    else:
        b.conv("features.conv0", 64, 3, stride=1, padding=1)
        b.same("norm", "features.norm0")
        b.same("relu", "features.relu0")
    for k, n_layers in enumerate(blocks, 1):
        block_in = b.channels
        for i in range(n_layers):
            b.next_unit()
            p = f"features.denseblock{k}.denselayer{i + 1}"
            c_in = block_in + i * growth
            if i > 0:  # torch.cat(inputs): a new c_in-channel tensor
                b.same("concat", f"{p}.cat", channels=c_in)
            b.channels = c_in
            b.same("norm", f"{p}.norm1")
            b.same("relu", f"{p}.relu1")
            b.conv(f"{p}.conv1", bn_size * growth, 1)
            b.same("norm", f"{p}.norm2")
            b.same("relu", f"{p}.relu2")
            b.conv(f"{p}.conv2", growth, 3, padding=1)
        b.channels = block_in + n_layers * growth
        b.same("concat", f"features.denseblock{k}.cat")
        if k < len(blocks):
            b.next_unit()
            p = f"features.transition{k}"
            b.same("norm", f"{p}.norm")
            b.same("relu", f"{p}.relu")
            b.conv(f"{p}.conv", int(b.channels * compression), 1)
            b.pool("avgpool", f"{p}.pool", 2, 2)
    b.next_unit()
    b.same("norm", "features.norm5")
    b.same("relu", "features.relu5")
    b.global_pool("avgpool")
    b.linear("classifier", classes)
    return b.layers


BUILDERS = {"resnet50": resnet50_layers, "vgg16": vgg16_layers, "densenet121": densenet121_layers}


def layers_of(spec: CNNSpec) -> list[Layer]:
    validate_cnn(spec)
    if spec.layers:
        return list(spec.layers)
    return _layers(spec.name, spec.image_size, spec.classes)


_CACHE: dict[tuple[str, int, int], list[Layer]] = {}


def _layers(name: str, image_size: int, classes: int) -> list[Layer]:
    key = (name, image_size, classes)
    if key not in _CACHE:
        _CACHE[key] = BUILDERS[name](image_size, classes)
    return _CACHE[key]


# ---------------------------------------------------------------------------- counts
@dataclass(frozen=True)
class CNNCounts:
    params: int
    macs_per_sample: int  # forward multiply-adds, conv + linear
    activation_bytes_per_sample: int  # saved for backward
    units: int  # FSDP wrap units
    largest_unit_params: int
    layers: int  # entries of the layer list

    @property
    def forward_flops_per_sample(self) -> int:
        return 2 * self.macs_per_sample


def counts(spec: CNNSpec) -> CNNCounts:
    layers = layers_of(spec)
    per_unit: dict[int, int] = {}
    for layer in layers:
        per_unit[layer.unit] = per_unit.get(layer.unit, 0) + layer.params
    with_params = [p for p in per_unit.values() if p > 0]
    return CNNCounts(params=sum(layer.params for layer in layers), macs_per_sample=sum(layer.macs for layer in layers),
                     activation_bytes_per_sample=sum(layer.saved_bytes(spec.activation_bytes) for layer in layers),
                     units=len(with_params), largest_unit_params=max(with_params), layers=len(layers))


def hardware_flops_per_sample(spec: CNNSpec) -> int:
    """GEMM FLOPs one sample's forward + backward executes (the first conv has no data gradient)."""
    total = 0
    for layer in layers_of(spec):
        if layer.kind in ("conv", "linear"):
            total += 2 * layer.macs * (2 if layer.first else 3)
    return total


# ---------------------------------------------------------------------------- time
def _conv_times_s(layer: Layer, b, device: Device, peak: float, bpe: int):
    m_per_sample, n, k, g = layer.gemm
    m = b * m_per_sample
    x = b * layer.in_elements * bpe  # the input tensor (an implicit GEMM reads it, not the k^2-times im2col)
    y = b * layer.out_elements * bpe
    w = layer.params * bpe
    forward = compute.gemm_s(m, n, k, device, peak, g, bpe, operand_bytes=x + w + y)
    weight_grad = compute.gemm_s(k, n, m, device, peak, g, bpe, operand_bytes=x + y + w)
    data_grad = 0.0 if layer.first else compute.gemm_s(m, k, n, device, peak, g, bpe, operand_bytes=y + w + x)
    return forward, weight_grad + data_grad


def layer_times_s(spec: CNNSpec, micro_batch, device: Device) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of one micro-batch through the whole network on one GPU."""
    b = np.asarray(micro_batch, dtype=float)
    peak = device.peak_flops.get(spec.compute_dtype) or device.peak(spec.dtype)
    bpe = spec.activation_bytes
    forward, backward = np.zeros_like(b), np.zeros_like(b)
    elementwise = 0.0
    for layer in layers_of(spec):
        if layer.kind in ("conv", "linear"):
            f, bw = _conv_times_s(layer, b, device, peak, bpe)
            forward, backward = forward + f, backward + bw
        else:
            elementwise += layer.forward_elements_moved() * bpe
    n_layers = len(layers_of(spec))
    gap = device.efficiency.kernel_overhead_s
    forward = forward + compute.memory_bound_s(b * elementwise, device) + KERNELS_FORWARD_PER_LAYER * n_layers * gap
    backward = (backward + compute.memory_bound_s(compute.BACKWARD_TRAFFIC_RATIO * b * elementwise, device)
                + KERNELS_BACKWARD_PER_LAYER * n_layers * gap)
    return forward, backward


def unit_times_s(spec: CNNSpec, micro_batch, device: Device) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of each unit (`Layer.unit`) for micro-batches `micro_batch` (an array):
    arrays of shape (units, len(micro_batch)), priced as `layer_times_s` prices the whole network (their
    sums over units are its totals)."""
    b = np.atleast_1d(np.asarray(micro_batch, dtype=float))
    peak = device.peak_flops.get(spec.compute_dtype) or device.peak(spec.dtype)
    bpe = spec.activation_bytes
    gap = device.efficiency.kernel_overhead_s
    layers = layers_of(spec)
    units = sorted({layer.unit for layer in layers})
    row = {unit: i for i, unit in enumerate(units)}
    forward, backward = np.zeros((len(units), len(b))), np.zeros((len(units), len(b)))
    for layer in layers:
        i = row[layer.unit]
        if layer.kind in ("conv", "linear"):
            f, bw = _conv_times_s(layer, b, device, peak, bpe)
        else:
            moved = layer.forward_elements_moved() * bpe
            f = compute.memory_bound_s(b * moved, device)
            bw = compute.memory_bound_s(compute.BACKWARD_TRAFFIC_RATIO * b * moved, device)
        forward[i] += f + KERNELS_FORWARD_PER_LAYER * gap
        backward[i] += bw + KERNELS_BACKWARD_PER_LAYER * gap
    return forward, backward


def unit_params(spec: CNNSpec) -> np.ndarray:
    """Parameters of each unit, in `unit_times_s`'s order."""
    layers = layers_of(spec)
    units = sorted({layer.unit for layer in layers})
    return np.array([sum(layer.params for layer in layers if layer.unit == u) for u in units], dtype=float)


def unit_output_elements(spec: CNNSpec) -> np.ndarray:
    """Elements per sample of each unit's output (its last layer's): what crosses to the next unit."""
    layers = layers_of(spec)
    units = sorted({layer.unit for layer in layers})
    return np.array([[layer for layer in layers if layer.unit == u][-1].out_elements for u in units], dtype=float)
