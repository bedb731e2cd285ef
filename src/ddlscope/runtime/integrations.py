"""ddlscope attached to a Hugging Face `Trainer` or a PyTorch Lightning `Trainer`, through their callbacks.

    trainer = transformers.Trainer(..., callbacks=[hf_trainer_callback(run="my-job")])
    trainer = lightning.Trainer(..., callbacks=[lightning_callback(run="my-job")])

Each callback attaches a meter (runtime/attach.py) when training starts, opens a step when the trainer
starts one and closes it when the trainer ends it, so every optimizer step is a row, under
`ddlscope launch` or the trainer's own launcher. The libraries are imported only when a callback is
made: neither is a dependency of ddlscope.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ddlscope.runtime.attach import AttachError, Meter, Step, attach
from ddlscope.workloads.model_table import flat_tensors


class StepMarker:
    """Opens and closes the meter's steps at a trainer's callback boundaries (which are not one block)."""

    def __init__(self, run: str | None, db: str | Path | None):
        self.run, self.db = run, db
        self.meter: Meter | None = None
        self._open: tuple[AbstractContextManager[Step], Step] | None = None

    def attach(self, model: nn.Module, optimizer: Any) -> None:
        # A trainer may hand a wrapper of the torch optimizer (accelerate's, Lightning's): the hooks go on
        # the optimizer that steps.
        while not _is_torch_optimizer(optimizer) and hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        self.meter = attach(model, optimizer, run=self.run, db=self.db)

    def begin(self, samples: int | None) -> None:
        if self.meter is None:
            raise AttachError("ddlscope: a training step began before training did (no meter attached)")
        self.end()
        context = self.meter.step(samples=samples)
        self._open = (context, context.__enter__())

    def end(self, loss: float | Tensor | None = None) -> None:
        if self._open is None:
            return
        context, step = self._open
        self._open = None
        if loss is not None:
            step.loss = loss
        context.__exit__(None, None, None)

    def close(self) -> None:
        self.end()
        if self.meter is not None:
            self.meter.close()


def _is_torch_optimizer(optimizer: Any) -> bool:
    import torch

    return isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "optimizer")


def hf_trainer_callback(run: str | None = None, db: str | Path | None = None) -> Any:
    """A `transformers.TrainerCallback` that measures every optimizer step of the Trainer.

    The model the callback sees is the Trainer's own (not accelerate's DDP wrapper), so gradient
    all-reduces are not timed separately: they count in backward, where DDP runs them. The loss is the
    model output's `loss`, when it has one."""
    from transformers import TrainerCallback

    class DdlscopeCallback(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.marker = StepMarker(run, db)

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                           **kwargs: Any) -> None:
            self.marker.attach(model, optimizer)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.marker.begin(args.per_device_train_batch_size * args.gradient_accumulation_steps)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.marker.end()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.marker.close()

    return DdlscopeCallback()


def lightning_callback(run: str | None = None, db: str | Path | None = None) -> Any:
    """A `lightning.pytorch.Callback` that measures every training batch of the Trainer (the DDP or FSDP
    wrapper its strategy made, so collectives are timed as in a plain loop); the loss is the step's."""
    from lightning.pytorch import Callback

    class DdlscopeCallback(Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.marker = StepMarker(run, db)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            wrapped = trainer.strategy.model if isinstance(trainer.strategy.model, nn.Module) else pl_module
            self.marker.attach(wrapped, trainer.optimizers[0])

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.marker.begin(_batch_size(batch))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self.marker.end(loss if isinstance(loss, Tensor) else None)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.marker.close()

    return DdlscopeCallback()


def _batch_size(batch: Any) -> int | None:
    """Samples in a batch: the first dimension of its first tensor that has one."""
    return next((int(t.shape[0]) for t in flat_tensors(batch) if t.dim()), None)
