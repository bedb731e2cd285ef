"""What every workload provides: a model, train/test data, a loss and a metric.

Datasets live in memory as tensors and are indexed by sample ids, so the
runtime owns the data order (seeded, identical on every rank) and each rank
simply takes its slice of the global batch.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol

import torch
from torch import Tensor, nn

from ddlscope.specs import WorkloadSpec


class Dataset(Protocol):
    def __len__(self) -> int: ...

    def get(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """Inputs and targets for the given sample ids (a 1-D int64 tensor)."""
        ...


@dataclass
class TensorDataset:
    inputs: Tensor
    targets: Tensor

    def __len__(self) -> int:
        return len(self.targets)

    def get(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        return self.inputs[indices], self.targets[indices]


@dataclass
class EvalResult:
    metric_name: str  # "accuracy", "perplexity" or "loss"
    metric: float
    loss: float


LossFn = Callable[[Tensor, Tensor], Tensor]


def cross_entropy(output: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy; flattens (batch, seq, vocab) logits for language models."""
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


@dataclass
class Task:
    """A built workload, ready to train."""

    model: nn.Module
    train: Dataset
    test: Dataset
    loss_fn: LossFn
    metric_name: str
    higher_is_better: bool
    eval_batch_size: int = 256

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device, max_batches: int = 0) -> EvalResult:
        """Mean loss over the test split (or its first `max_batches` batches) and the metric."""
        was_training = model.training
        model.eval()
        total_loss, correct, seen, batches = 0.0, 0, 0, 0
        for start in range(0, len(self.test), self.eval_batch_size):
            if max_batches and batches >= max_batches:
                break
            ids = torch.arange(start, min(start + self.eval_batch_size, len(self.test)))
            x, y = (t.to(device) for t in self.test.get(ids))
            out = model(x)
            total_loss += self.loss_fn(out, y).item() * len(ids)
            if self.metric_name == "accuracy":
                correct += (out.argmax(-1) == y).sum().item()
            seen += len(ids)
            batches += 1
        model.train(was_training)
        loss = total_loss / max(seen, 1)
        if self.metric_name == "accuracy":
            return EvalResult("accuracy", correct / max(seen, 1), loss)
        if self.metric_name == "perplexity":
            return EvalResult("perplexity", math.exp(min(loss, 50.0)), loss)
        return EvalResult("loss", loss, loss)


class Workload(ABC):
    """A registered workload: its knob model and how to build a Task from it."""

    spec_class: ClassVar[type[WorkloadSpec]]
    description: ClassVar[str]
    # False for synthetic data: throughput and memory studies only, never accuracy.
    accuracy_meaningful: ClassVar[bool] = True

    @classmethod
    def checked(cls, spec: WorkloadSpec) -> Any:
        """The spec, after making sure it is this workload's own spec class."""
        if not isinstance(spec, cls.spec_class):
            raise TypeError(f"{cls.__name__} needs a {cls.spec_class.__name__}, got {type(spec).__name__}")
        return spec

    @classmethod
    def validate(cls, spec: WorkloadSpec) -> None:
        """Refuse, with a ConfigError of one line, what the spec's fields alone cannot (a model name
        the library lacks, an input the model cannot take): called before any process starts."""

    @classmethod
    def meta_model(cls, spec: WorkloadSpec) -> nn.Module | None:
        """The spec's model on the meta device (no memory), where the workload can build it alone;
        None where it cannot (the built-in workloads build model and data together)."""
        return None

    @classmethod
    @abstractmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        """Build model and data. Same spec and seed -> identical model and data."""
