"""Handwritten digits (scikit-learn's bundled 8x8 set): small, offline, real accuracy.

1797 images of 8x8 pixels, 10 classes. The train/test split is fixed (seed
0, stratified) and independent of the run seed, so runs with different
seeds or strategies are evaluated on the same test images.
"""

from __future__ import annotations

from functools import lru_cache
from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn

from ddlscope.specs import WorkloadSpec, remember_spec_class
from ddlscope.workloads import WORKLOADS
from ddlscope.workloads.base import Task, TensorDataset, Workload, cross_entropy

NUM_CLASSES = 10
IMAGE_SIDE_PX = 8
TEST_FRACTION = 0.2
SPLIT_SEED = 0  # fixed: every run sees the same split, whatever its own seed


@lru_cache(maxsize=1)
def _digits_split() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_test, y_test); x is float32 in [0, 1], shape (N, 64)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(data.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x.numpy(), y.numpy(), test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y.numpy()
    )
    return (torch.from_numpy(x_train), torch.from_numpy(y_train), torch.from_numpy(x_test), torch.from_numpy(y_test))


def _datasets(image_shape: tuple[int, ...]) -> tuple[TensorDataset, TensorDataset]:
    x_train, y_train, x_test, y_test = _digits_split()
    return (
        TensorDataset(x_train.reshape(-1, *image_shape), y_train),
        TensorDataset(x_test.reshape(-1, *image_shape), y_test),
    )


def _task(model: nn.Module, train: TensorDataset, test: TensorDataset) -> Task:
    return Task(
        model=model, train=train, test=test, loss_fn=cross_entropy, metric_name="accuracy", higher_is_better=True
    )


# --- mlp-digits ---------------------------------------------------------------


class MlpDigitsSpec(WorkloadSpec):
    name: str = "mlp-digits"
    batch_size: int = Field(64, ge=1, description="global batch: samples per step, summed over ranks")
    lr: float = Field(0.1, gt=0, description="learning rate")
    hidden: int = Field(128, ge=1, description="width of each hidden layer")
    layers: int = Field(2, ge=1, description="number of hidden layers")


remember_spec_class(MlpDigitsSpec)


def build_mlp(hidden: int, layers: int) -> nn.Sequential:
    """64 -> hidden (-> hidden ...) -> 10, ReLU between layers."""
    widths = [IMAGE_SIDE_PX * IMAGE_SIDE_PX] + [hidden] * layers
    modules: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:]):
        modules += [nn.Linear(width_in, width_out), nn.ReLU()]
    modules.append(nn.Linear(widths[-1], NUM_CLASSES))
    return nn.Sequential(*modules)


@WORKLOADS.register("mlp-digits")
class MlpDigits(Workload):
    spec_class: ClassVar[type[WorkloadSpec]] = MlpDigitsSpec
    description: ClassVar[str] = "MLP on scikit-learn's 8x8 handwritten digits (1437 train / 360 test), accuracy"

    @classmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        spec = cls.checked(spec)
        train, test = _datasets((IMAGE_SIDE_PX * IMAGE_SIDE_PX,))
        torch.manual_seed(seed)
        return _task(build_mlp(spec.hidden, spec.layers), train, test)


# --- cnn-digits ---------------------------------------------------------------


class CnnDigitsSpec(WorkloadSpec):
    name: str = "cnn-digits"
    channels: int = Field(16, ge=1, description="channels of the first conv layer (the second has twice as many)")


remember_spec_class(CnnDigitsSpec)


def build_cnn(channels: int) -> nn.Sequential:
    """Two 3x3 convs, one 2x2 max-pool (8x8 -> 4x4), two linear layers."""
    pooled_side_px = IMAGE_SIDE_PX // 2
    return nn.Sequential(
        nn.Conv2d(1, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * pooled_side_px * pooled_side_px, 64),
        nn.ReLU(),
        nn.Linear(64, NUM_CLASSES),
    )


@WORKLOADS.register("cnn-digits")
class CnnDigits(Workload):
    spec_class: ClassVar[type[WorkloadSpec]] = CnnDigitsSpec
    description: ClassVar[str] = "small CNN on scikit-learn's 8x8 handwritten digits (1437 train / 360 test), accuracy"

    @classmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        spec = cls.checked(spec)
        train, test = _datasets((1, IMAGE_SIDE_PX, IMAGE_SIDE_PX))
        torch.manual_seed(seed)
        return _task(build_cnn(spec.channels), train, test)
