"""`gossip`: local step, then an exchange of parameters with each neighbour (torch point-to-point).

Synchronous (`mode = "sync"`): all sends and receives of a step go out
together through `dist.batch_isend_irecv` and are waited for; each message is
accounted (and, on an emulated network, delayed) as a point-to-point message
of the model's bytes.

Asynchronous (`mode = "async"`): each neighbour's messages are received by a
thread of this rank's own (`NeighbourInbox`, a blocking `dist.recv` loop that
keeps the newest copy), so a neighbour's send completes as soon as it is on
the wire and nobody waits for a slower neighbour's step. A worker sends its
model after each local step (`dist.isend`, waited for only before the next
message to that neighbour) and mixes in the copies that arrived since its last
mix. On an emulated network the message carries its emulated transfer time
and the inbox holds it back that long. At the end each worker sends its final
model flagged as the last message; an inbox stops after its neighbour's last,
so finishing needs no count of messages and cannot deadlock on a straggler.
Messages travel on gloo (any thread may drive its point-to-point); under nccl
they go through a gloo group of the same ranks, staged in host memory (not
run here: one GPU cannot hold two nccl ranks).

Differential privacy (`dp_noise_multiplier` > 0): per-sample gradients
(torch.func: `vmap` over `grad` of a one-sample `functional_call`), each
clipped to `dp_clip_norm`, summed, plus Gaussian noise of std noise multiplier
x clip norm, over the batch: DP-SGD's update, so the model a worker shares is
private. The per-sample pass recomputes the forward (the loss the loop records
comes from a plain forward first): DP costs about one more forward and
backward per step, and batch x parameters of memory for the per-sample
gradients.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad, vmap

from ddlscope.specs.privacy import dp_sgd_epsilon
from ddlscope.specs.strategies.gossip import GossipSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import ReplicatedModel, flat_parameters, load_flat_parameters
from ddlscope.strategies.base import Batch, LossFn, StepTimer
from ddlscope.strategies.comm import CommRecorder

# An asynchronous message: this header, then the flat model.
HEADER = 3
_STEP, _DELAY_S, _LAST = range(HEADER)
MESSAGE_TAG = 11  # PAPERS.md item 11; no other point-to-point message of a gossip run uses it


@RUNTIMES.register(GossipSpec)
class Gossip(ReplicatedModel):
    spec: GossipSpec

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.step = 0
        self.inboxes: list[NeighbourInbox] = []
        self.sending: dict[int, Any] = {}  # peer -> the Work of the last message sent to it (async)
        self.mixed: dict[int, int] = {}  # peer -> copies of its model mixed in (async)
        self.staleness_sum = 0  # over the mixed copies: this rank's step minus the sender's
        self.disagreement_sum = 0.0  # over the mixed copies: ||mine - copy|| / ||mine|| before the mix
        self.noise = torch.Generator(device=self.ctx.device).manual_seed(self.ctx.experiment.seed * 1000 + self.ctx.rank)
        self.train_samples = 0

    def wrap(self, model: nn.Module) -> nn.Module:
        self.peers = self.spec.neighbours(self.ctx.rank, self.ctx.workers)
        model = super().wrap(model)
        if self.spec.mode == "async":
            # Messages from a receiving thread: on gloo, whose point-to-point any thread may drive; on a GPU
            # (nccl) through a gloo group of the same ranks, staged in host memory.
            self.message_group = self.group if self.ctx.backend == "gloo" else dist.new_group(backend="gloo")
            numel = sum(p.numel() for p in model.parameters())
            dtype = next(model.parameters()).dtype
            if dtype not in (torch.float32, torch.float64):  # the header's step count must stay exact
                raise RuntimeError(f"gossip mode async sends float32 or float64 models, not {dtype}")
            self.inboxes = [NeighbourInbox(peer, numel, dtype, torch.device("cpu"), self.message_group)
                            for peer in self.peers]
            self.mixed = {peer: 0 for peer in self.peers}
        return model

    def use_task(self, task: Any) -> None:
        self.train_samples = len(task.train)

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        if self.spec.private:
            loss = self._private_forward_backward(batch, timer)
        else:
            loss = self.forward_backward(batch, timer)
        assert self.model is not None and self.optimizer is not None
        with timer.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        with timer.phase("synchronize"):
            if self.spec.mode == "async":
                self._send(last=False)
                self._mix_arrived()
            else:
                self._mix()
        self.step += 1
        return loss.item()

    # ------------------------------------------------------------------ differential privacy
    def _private_forward_backward(self, batch: Batch, timer: StepTimer) -> torch.Tensor:
        """The batch loss (recorded), then DP-SGD's gradient: per-sample, clipped, summed, noised, averaged."""
        assert self.model is not None and self.loss_fn is not None
        x, y = batch
        with timer.phase("forward"):  # a plain forward: the loss, and the activations the meter counts
            loss = self.loss_fn(self.model(x), y).detach()
        with timer.phase("backward"):
            private_gradients(self.model, self.loss_fn, x, y, self.spec, self.noise)
        return loss

    @staticmethod
    def kernel_backward(spec: GossipSpec) -> Callable[[nn.Module, LossFn, torch.Tensor, torch.Tensor], None] | None:
        if not spec.private:
            return None
        noise = torch.Generator().manual_seed(0)
        return lambda model, loss_fn, x, y: private_gradients(model, loss_fn, x, y, spec, noise)

    def privacy_epsilon(self) -> float:
        """Epsilon at dp_delta for the whole run: every worker takes part in every step, a sample in one
        worker's batch at most, with probability global batch / training samples."""
        exp = self.ctx.experiment
        rate = min(1.0, exp.workload.batch_size / max(self.train_samples, 1))
        return dp_sgd_epsilon(rate, self.spec.dp_noise_multiplier, exp.workload.steps, self.spec.dp_delta)

    # ------------------------------------------------------------------ synchronous
    def _mix(self) -> None:
        """This rank's model becomes the mean of its own and its neighbours'."""
        assert self.model is not None
        mine = flat_parameters(self.model)
        received = [torch.empty_like(mine) for _ in self.peers]
        ops = [dist.P2POp(dist.isend, mine, peer, self.group) for peer in self.peers]
        ops += [dist.P2POp(dist.irecv, buf, peer, self.group) for buf, peer in zip(received, self.peers)]
        pending = [self.comm.launched(mine.numel() * mine.element_size(), "p2p") for _ in self.peers]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for message in pending:
            self.comm.completed(message)
        load_flat_parameters(self.model, torch.stack([mine, *received]).mean(dim=0))

    # ------------------------------------------------------------------ asynchronous
    def _send(self, last: bool) -> None:
        """This rank's model to every neighbour, without waiting for it to arrive: only the previous
        message to the same neighbour must have left (one in flight per neighbour)."""
        assert self.model is not None
        mine = flat_parameters(self.model).cpu()
        for peer in self.peers:
            previous = self.sending.pop(peer, None)
            if previous is not None:
                previous.wait()
            self.sending[peer] = send_message(mine, self.step, last, peer, self.comm, self.message_group)

    def _mix_arrived(self) -> None:
        """The mean of this rank's model and each neighbour's newest copy that arrived since the last mix."""
        assert self.model is not None
        arrived = [(inbox.peer, inbox.take()) for inbox in self.inboxes]
        mine = flat_parameters(self.model)
        copies = []
        for peer, newest in arrived:
            if newest is not None:
                sender_step, flat = newest
                flat = flat.to(mine.device)
                copies.append(flat)
                self.mixed[peer] += 1
                self.staleness_sum += self.step - sender_step
                self.disagreement_sum += ((mine - flat).norm() / mine.norm().clamp(min=1e-12)).item()
        if copies:
            load_flat_parameters(self.model, torch.stack([mine, *copies]).mean(dim=0))

    def finish(self, model: nn.Module) -> None:
        """Async: the final model as each neighbour's last message, then wait for theirs (the inboxes end)."""
        if self.spec.mode != "async":
            return
        self._send(last=True)
        for work in self.sending.values():
            work.wait()
        self.sending = {}
        for inbox in self.inboxes:
            inbox.join()
        self.comm.pop(0.0)  # the last messages belong to no step

    def final_events(self) -> list[tuple[str, str]]:
        """Run-level facts for the summary (`strategy_metric` events): the privacy spent (rank 0; every
        worker spends the same), and per rank in async mode the copies mixed and their staleness."""
        events = []
        if self.spec.private and self.ctx.rank == 0:
            epsilon = self.privacy_epsilon()
            exp = self.ctx.experiment
            events.append(strategy_metric(
                "privacy_epsilon", epsilon,
                f"at delta {self.spec.dp_delta:g}: noise multiplier {self.spec.dp_noise_multiplier:g}, clip norm "
                f"{self.spec.dp_clip_norm:g}, sampling rate {exp.workload.batch_size}/{self.train_samples}, "
                f"{exp.workload.steps} steps (RDP accountant, dp-accounting)"))
        if self.spec.mode == "async":
            mixed = sum(self.mixed.values())
            events.append(strategy_metric(
                "gossip_copies_mixed", mixed, f"rank {self.ctx.rank}: neighbour models mixed in over "
                f"{self.step} steps ({', '.join(f'{n} from rank {p}' for p, n in self.mixed.items())})",
                rank=self.ctx.rank, by_peer={str(p): n for p, n in self.mixed.items()}, steps=self.step))
            if mixed:
                events.append(strategy_metric(
                    "gossip_mean_staleness_steps", self.staleness_sum / mixed,
                    f"rank {self.ctx.rank}: own step minus the sender's, over the copies mixed in "
                    "(negative: neighbours ahead)", rank=self.ctx.rank))
                events.append(strategy_metric(
                    "gossip_consensus_distance", self.disagreement_sum / mixed,
                    f"rank {self.ctx.rank}: mean ||own - neighbour's copy|| / ||own|| when mixing it in",
                    rank=self.ctx.rank))
        return events

    def checkpoint_state(self) -> dict[str, Any]:
        return {"step": self.step, "noise": self.noise.get_state()}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.noise.set_state(state["noise"])


def strategy_metric(name: str, value: float, detail: str, **extra: Any) -> tuple[str, str]:
    """A `strategy_metric` event: a run-level number the summary and `ddlscope show` list as they are."""
    return "strategy_metric", json.dumps({"name": name, "value": value, "detail": detail, **extra})


@contextmanager
def without_saved_tensor_hooks() -> Iterator[None]:
    """Suspend the runtime's saved-tensor hooks (its activation meter), which torch.func's grad refuses;
    torch has no public call for it, so the hooks are popped and pushed back through torch._C."""
    hooks = []
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        hooks.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(hooks):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def private_gradients(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, spec: GossipSpec,
                      noise: torch.Generator) -> None:
    """DP-SGD's gradient of the batch into each parameter's `.grad`: per-sample, clipped, noised, averaged."""
    with without_saved_tensor_hooks():
        per_sample = per_sample_gradients(model, loss_fn, x, y)
        noisy = clipped_noisy_mean(per_sample, spec.dp_clip_norm, spec.dp_noise_multiplier, noise)
        for name, p in model.named_parameters():
            p.grad = noisy[name]


def per_sample_gradients(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each sample's gradient of its own loss, by parameter name (leading dimension: the sample)."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss_of_one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], xi: torch.Tensor,
                    yi: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(model, (p, b), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(loss_of_one), in_dims=(None, None, 0, 0), randomness="different")(params, buffers, x, y)


def clipped_noisy_mean(per_sample: dict[str, torch.Tensor], clip_norm: float, noise_multiplier: float,
                       generator: torch.Generator) -> dict[str, torch.Tensor]:
    """DP-SGD: every sample's whole gradient scaled to at most `clip_norm` (L2 over all parameters), summed,
    Gaussian noise of std noise_multiplier x clip_norm added to the sum, divided by the batch size."""
    batch = next(iter(per_sample.values())).shape[0]
    squared = sum(g.reshape(batch, -1).pow(2).sum(dim=1) for g in per_sample.values())
    scale = (clip_norm / (squared.sqrt() + 1e-12)).clamp(max=1.0)
    out = {}
    for name, g in per_sample.items():
        total = torch.tensordot(scale, g, dims=1)
        noise = torch.randn(total.shape, generator=generator, device=total.device, dtype=total.dtype)
        out[name] = (total + noise_multiplier * clip_norm * noise) / batch
    return out


def send_message(flat: torch.Tensor, step: int, last: bool, peer: int, comm: CommRecorder, group: Any) -> Any:
    """One asynchronous message (header + model) to `peer`, accounted; returns its Work. The header
    carries the emulated transfer time, which the receiving inbox waits out before the copy counts."""
    pending = comm.launched((flat.numel() + HEADER) * flat.element_size(), "p2p")
    header = torch.tensor([step, max(0.0, pending.ready_s - pending.launch_s), float(last)], dtype=flat.dtype,
                          device=flat.device)
    message = torch.cat([header, flat])
    return comm.complete_work(dist.isend(message, peer, group=group, tag=MESSAGE_TAG), pending)


class NeighbourInbox:
    """Every message one neighbour sends, received on a thread of its own; keeps only the newest copy.

    The thread blocks in `dist.recv` (which releases the GIL), so the neighbour's sends never wait for
    this rank's step; it ends after the neighbour's last message.
    """

    def __init__(self, peer: int, numel: int, dtype: torch.dtype, device: torch.device, group: Any):
        self.peer, self.group = peer, group
        self.buffer = torch.empty(numel + HEADER, dtype=dtype, device=device)
        self.lock = threading.Lock()
        self.newest: tuple[int, torch.Tensor] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._receive_all, name=f"gossip-inbox-{peer}", daemon=True)
        self.thread.start()

    def _receive_all(self) -> None:
        try:
            while True:
                dist.recv(self.buffer, self.peer, group=self.group, tag=MESSAGE_TAG)
                step, delay_s, last = (float(v) for v in self.buffer[:HEADER].tolist())
                if delay_s > 0:
                    time.sleep(delay_s)  # the emulated network's transfer time: the copy is not here yet
                with self.lock:
                    self.newest = (int(step), self.buffer[HEADER:].clone())
                if last:
                    return
        except BaseException as exc:  # a neighbour that died: surfaced where the step takes a copy
            self.error = exc

    def take(self) -> tuple[int, torch.Tensor] | None:
        """(sender's step, its flat model) that arrived since the last take, or None."""
        if self.error is not None:
            raise RuntimeError(f"gossip: receiving from rank {self.peer} failed: {self.error}") from self.error
        with self.lock:
            newest, self.newest = self.newest, None
        return newest

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"gossip: receiving from rank {self.peer} failed: {self.error}") from self.error
