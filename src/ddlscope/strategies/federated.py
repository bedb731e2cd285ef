"""Federated training's runtime: fedavg, mm-psgd, mc-psgd (specs/strategies/federated.py).

Each rank is one client. One run step is one round: the runtime hands the
client its whole round of samples (`batch_indices`: its part of the round's
block, `local_epochs` permutations, from workloads/partition.py), the client
trains its minibatches with a fresh optimizer state (as a Flower client
builds its optimizer in `fit`), and the models are averaged with weights n_k
/ n over the sampled clients (a client not sampled has weight 0, trains
nothing and receives the average). The weighted average is one all-reduce of
each rank's weight x parameters (strategies/averaging.py: weighted_sum),
accounted and emulated like every message.

Per-block predictors (mm-psgd, mc-psgd) are kept as flat parameter vectors;
after training each rank compares mc-psgd's candidates on its own block data
(one all-reduce), and rank 0 evaluates every predictor on each block's test
samples and records them as `block_eval` events (JSON), which the `beyond`
study reads.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ddlscope.specs.strategies.federated import FedAvgSpec, MCPSGDSpec, MMPSGDSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import ReplicatedModel, flat_parameters, load_flat_parameters, weighted_sum
from ddlscope.strategies.base import Batch, StepTimer
from ddlscope.workloads.base import Task
from ddlscope.workloads.partition import ClientData

EVAL_CHUNK = 512  # test samples per forward when evaluating predictors


@RUNTIMES.register(FedAvgSpec)
class FedAvg(ReplicatedModel):
    spec: FedAvgSpec

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.round = 0
        self.task: Task | None = None
        self.data: ClientData | None = None
        self.minibatches: list[int] = []

    @property
    def client(self) -> int:
        return self.ctx.rank

    def use_task(self, task: Task) -> None:
        if task.metric_name != "accuracy":
            raise RuntimeError(f"strategy {self.spec.name}: partitions split a labelled training set; workload "
                               f"{self.ctx.experiment.workload.name} measures {task.metric_name}, not accuracy")
        self.task = task
        labels = task.train.get(torch.arange(len(task.train)))[1]
        self.data = ClientData(self.spec, labels.numpy(), self.ctx.workers, self.ctx.experiment.seed)

    # ------------------------------------------------------------------ one round
    def batch_indices(self, sampler: Any, step: int, rank: int, per_rank: int) -> torch.Tensor:
        assert self.data is not None, "use_task() before the first round"
        if self.client not in self.data.weights(step):
            self.minibatches = []
            return torch.empty(0, dtype=torch.long)
        reading = self.data.round(self.client, step, self.ctx.experiment.workload.batch_size)
        self.minibatches = reading.minibatches
        return torch.from_numpy(reading.ids).long()

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        assert self.model is not None and self.data is not None
        weight = self.data.weights(self.round).get(self.client, 0.0)
        starts = self.round_starts()
        ends, loss = [], math.nan
        for i, start in enumerate(starts):
            load_flat_parameters(self.model, start)
            chain_loss = self.local_training(batch, timer) if weight else math.nan
            loss = chain_loss if i == 0 else loss
            ends.append(flat_parameters(self.model))
        with timer.phase("synchronize"):
            averaged = weighted_sum(torch.cat(ends), weight, self.comm, self.group)
        results = list(averaged.split([len(e) for e in ends]))
        load_flat_parameters(self.model, results[0])
        self.after_round(self.round, results)
        self.round += 1
        return loss

    def round_starts(self) -> list[torch.Tensor]:
        """The models each client trains this round, from where the last average left them: the global one."""
        assert self.model is not None
        return [flat_parameters(self.model)]

    def after_round(self, round_: int, averaged: list[torch.Tensor]) -> None:
        """What follows a round's average (the per-block variants keep their predictors)."""

    def local_training(self, batch: Batch, timer: StepTimer) -> float:
        """The client's minibatches of this round on the model as loaded; their mean loss."""
        assert self.model is not None and self.optimizer is not None and self.loss_fn is not None
        self.optimizer.state.clear()  # a fresh optimizer each round, as a federated client builds one per fit
        x, y = batch
        total, start = 0.0, 0
        for size in self.minibatches:
            xb, yb = x[start:start + size], y[start:start + size]
            start += size
            with timer.phase("forward"):
                loss = self.loss_fn(self.model(xb), yb)
            with timer.phase("backward"):
                loss.backward()
            with timer.phase("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            total += loss.item()
        return total / max(len(self.minibatches), 1)

    # ------------------------------------------------------------------ predictors
    def predictors(self) -> dict[str, list[torch.Tensor]]:
        """Named predictors, one flat model per block: FedAvg has one global model for every block."""
        assert self.model is not None and self.data is not None
        return {"global": [flat_parameters(self.model)] * self.data.blocks}

    def final_events(self) -> list[tuple[str, str]]:
        """Rank 0: every predictor on each block's test samples, and the clients' data layout."""
        if self.ctx.rank != 0 or self.task is None or self.data is None:
            return []
        test_labels = self.task.test.get(torch.arange(len(self.task.test)))[1]
        test_blocks = self.data.test_blocks(test_labels.numpy())
        events = [("federated_layout", self.data.describe())]
        for name, models in self.predictors().items():
            for block, (flat, ids) in enumerate(zip(models, test_blocks)):
                accuracy, loss = self.evaluate(flat, torch.from_numpy(ids).long(), self.task.test)
                events.append(("block_eval", json.dumps({"predictor": name, "block": block, "accuracy": accuracy,
                                                         "loss": loss, "samples": len(ids)})))
        return events

    @torch.no_grad()
    def evaluate(self, flat: torch.Tensor, ids: torch.Tensor, dataset: Any) -> tuple[float, float]:
        """(accuracy, mean loss) of the flat model on the given samples; the model is left as it was."""
        assert self.model is not None and self.loss_fn is not None
        current = flat_parameters(self.model)
        load_flat_parameters(self.model, flat)
        was_training = self.model.training
        self.model.eval()
        correct, loss_sum = 0, 0.0
        for chunk in ids.split(EVAL_CHUNK):
            x, y = (t.to(self.ctx.device) for t in dataset.get(chunk))
            out = self.model(x)
            loss_sum += self.loss_fn(out, y).item() * len(chunk)
            correct += int((out.argmax(-1) == y).sum().item())
        self.model.train(was_training)
        load_flat_parameters(self.model, current)
        n = max(len(ids), 1)
        return correct / n, loss_sum / n

    def checkpoint_state(self) -> dict[str, Any]:
        return {"round": self.round}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])


@RUNTIMES.register(MMPSGDSpec)
class MMPSGD(FedAvg):
    """Block b's predictor: the mean of the global models that ended block b, one per cycle so far."""

    spec: MMPSGDSpec

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> None:
        super().attach(model, optimizer, loss_fn)
        size = sum(p.numel() for p in model.parameters())
        self.block_sums = torch.zeros(self.spec.blocks, size)
        self.block_counts = [0] * self.spec.blocks
        self.block_last = torch.zeros(self.spec.blocks, size)  # the global model that ended each block last

    def after_round(self, round_: int, averaged: list[torch.Tensor]) -> None:
        if self.spec.ends_block(round_):
            block = self.spec.block_of_round(round_)
            self.block_sums[block] += averaged[0]
            self.block_counts[block] += 1
            self.block_last[block] = averaged[0]

    def block_averages(self) -> list[torch.Tensor]:
        """MM-PSGD's predictor per block (the global model for a block that never ended yet)."""
        assert self.model is not None
        now = flat_parameters(self.model)
        return [self.block_sums[b] / n if n else now for b, n in enumerate(self.block_counts)]

    def predictors(self) -> dict[str, list[torch.Tensor]]:
        return {**super().predictors(), "last-in-block": self.last_in_block(), "per-block": self.block_averages()}

    def last_in_block(self) -> list[torch.Tensor]:
        """The global model as it left each block last (what FedAvg served at the end of that block)."""
        assert self.model is not None
        now = flat_parameters(self.model)
        return [self.block_last[b] if n else now for b, n in enumerate(self.block_counts)]

    def checkpoint_state(self) -> dict[str, Any]:
        return {**super().checkpoint_state(), "block_sums": self.block_sums.clone(),
                "block_counts": list(self.block_counts), "block_last": self.block_last.clone()}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().restore_checkpoint_state(state)
        self.block_sums = state["block_sums"].clone()
        self.block_counts = [int(n) for n in state["block_counts"]]
        self.block_last = state["block_last"].clone()


@RUNTIMES.register(MCPSGDSpec)
class MCPSGD(MMPSGD):
    """Also a block-separate chain per block, trained only in its block's rounds (from the global model the
    first time); block b's predictor is the better of MM-PSGD's average and the chain on the clients' data."""

    spec: MCPSGDSpec

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> None:
        super().attach(model, optimizer, loss_fn)
        self.chains = torch.zeros_like(self.block_sums)
        self.chain_started = [False] * self.spec.blocks
        self.chosen: list[str] = []

    def round_starts(self) -> list[torch.Tensor]:
        (mixed,) = super().round_starts()
        block = self.spec.block_of_round(self.round)
        if not self.chain_started[block]:
            self.chains[block] = mixed
            self.chain_started[block] = True
        return [mixed, self.chains[block].clone()]

    def after_round(self, round_: int, averaged: list[torch.Tensor]) -> None:
        super().after_round(round_, averaged)
        self.chains[self.spec.block_of_round(round_)] = averaged[1]

    def finish(self, model: torch.nn.Module) -> None:
        """Pick each block's predictor by its loss on all clients' data of that block (one all-reduce)."""
        assert self.data is not None and self.task is not None
        candidates = self.candidates()
        losses = []
        for block in range(self.data.blocks):
            ids = torch.from_numpy(self.data.parts[block][self.client]).long()
            share = self.data.size(self.client, block) / sum(self.data.size(k, block) for k in range(self.data.clients))
            losses += [share * self.evaluate(models[block], ids, self.task.train)[1] for models in candidates.values()]
        totals = weighted_sum(torch.tensor(losses, dtype=torch.float64), 1.0, self.comm, self.group).view(
            self.data.blocks, len(candidates))
        names = list(candidates)
        self.chosen = [names[int(torch.argmin(row))] for row in totals]
        self.discard_comm_stats()  # after training: not a step's communication

    def candidates(self) -> dict[str, list[torch.Tensor]]:
        averages = self.block_averages()
        chains = [self.chains[b] if started else averages[b] for b, started in enumerate(self.chain_started)]
        return {"mm": averages, "chain": chains}

    def predictors(self) -> dict[str, list[torch.Tensor]]:
        candidates = self.candidates()
        chosen = [candidates[name][b] for b, name in enumerate(self.chosen)] if self.chosen else candidates["mm"]
        return {"global": FedAvg.predictors(self)["global"], "last-in-block": self.last_in_block(), **candidates,
                "per-block": chosen}

    def final_events(self) -> list[tuple[str, str]]:
        events = super().final_events()
        if events and self.chosen:
            events.append(("block_predictors", json.dumps({"chosen": self.chosen})))
        return events

    def checkpoint_state(self) -> dict[str, Any]:
        return {**super().checkpoint_state(), "chains": self.chains.clone(), "chain_started": list(self.chain_started)}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().restore_checkpoint_state(state)
        self.chains = state["chains"].clone()
        self.chain_started = [bool(s) for s in state["chain_started"]]
