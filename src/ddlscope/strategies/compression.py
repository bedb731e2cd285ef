"""Gradient compression for DDP's comm hooks, one module for every strategy that all-reduces gradients.

Which hook does what, and why ours where torch has one:

- fp16: torch's `fp16_compress_hook` (works on gloo).
- bf16: torch's `bf16_compress_hook` is refused on gloo at registration
  ("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+"),
  although gloo all-reduces bfloat16 tensors fine. So ours is the same
  cast-and-all-reduce: cast the bucket to bf16, divide by the world, all-reduce,
  cast back.
- powersgd: torch's `powerSGD_hook` (rank and warm-up knobs; `batched_powerSGD_hook`
  fails on this torch, see PLATFORM.md). Its later all-reduces (P, then Q) are
  launched from callbacks on the backend's threads, so with several buckets in
  flight two gloo ranks can issue them in different orders and gloo aborts
  ("Received data size doesn't match expected size"). On gloo each bucket
  therefore waits for the one before it (`one_bucket_at_a_time`): correct,
  with less overlap.
- topk (Aji & Heafield 2017; error feedback as in Stich et al. 2018): each
  rank sends the k largest-magnitude entries of gradient + residual, as fp32
  values and int32 indices; what it did not send is kept as the residual and
  added to the next step's gradient. Sparse sums do not add up in place, so
  the (value, index) pairs are all-gathered and scattered into a dense sum.
- qsgd (Alistarh et al. 2017): each entry becomes norm * sign * l / s with
  l in 0..s drawn by unbiased stochastic rounding; the codes (2s + 1 values)
  are packed 2, 4 or 8 bits each, plus an fp32 norm per 512 entries; all-gathered.
- minmax8 (Bagua's ByteGrad): 8-bit min-max quantisation of each bucket,
  round to nearest, plus its fp32 min and max; all-gathered.

Quantised codes from different ranks cannot be summed without decoding, so
our own lossy hooks all-gather (each rank's payload: `payload_bytes`) and each
rank decodes and averages. Every hook reports its payload to the CommRecorder
through `timed_hook`, so bytes per step and the emulated network see what is
really sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ddlscope.specs.strategies.ddp import QSGD_CHUNK, qsgd_code_bits as packed_bits
from ddlscope.strategies.comm import CommRecorder

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[Tensor]]
PayloadBytes = Callable[[Any, dist.GradBucket], int]

FP32_BYTES = 4


# --------------------------------------------------------------------------- codecs (pure tensor code)
class Codec:
    """Encode a flat fp32 gradient into a flat uint8 message of a size every rank agrees on, and back."""

    def message_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, grad: Tensor, key: int) -> Tensor:
        raise NotImplementedError

    def decode(self, message: Tensor, numel: int) -> Tensor:
        raise NotImplementedError


def _fp32_bytes(values: Tensor) -> Tensor:
    return values.to(torch.float32).contiguous().view(torch.uint8)


def _fp32_from(raw: Tensor) -> Tensor:
    return raw.clone().view(torch.float32)  # a copy: a rank's message in the gathered buffer may sit at any offset


@dataclass
class TopK(Codec):
    """k = ceil(ratio * numel) largest |gradient + residual| entries; the rest stays in the residual."""

    ratio: float
    residuals: dict[int, Tensor] = field(default_factory=dict)

    def k(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def message_bytes(self, numel: int) -> int:
        return self.k(numel) * 2 * FP32_BYTES  # fp32 value + int32 index

    def encode(self, grad: Tensor, key: int) -> Tensor:
        residual = self.residuals.get(key)
        if residual is None or residual.numel() != grad.numel():  # DDP rebuilds its buckets after step 1
            residual = torch.zeros_like(grad, dtype=torch.float32)
        corrected = residual + grad
        indices = corrected.abs().topk(self.k(grad.numel()), sorted=False).indices
        values = corrected[indices]
        corrected[indices] = 0.0  # error feedback: what was not sent is sent later
        self.residuals[key] = corrected
        return torch.cat([_fp32_bytes(values), indices.to(torch.int32).view(torch.uint8)])

    def decode(self, message: Tensor, numel: int) -> Tensor:
        k = self.k(numel)
        values = _fp32_from(message[: k * FP32_BYTES])
        indices = message[k * FP32_BYTES:].clone().view(torch.int32).long()
        return torch.zeros(numel, dtype=torch.float32).index_add_(0, indices, values)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Unsigned codes below 2**bits, `8 // bits` to a byte (zero-padded at the end)."""
    per_byte = 8 // bits
    padded = torch.zeros(math.ceil(codes.numel() / per_byte) * per_byte, dtype=torch.int32)
    padded[: codes.numel()] = codes
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    return (padded.view(-1, per_byte) << shifts).sum(dim=1).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int, numel: int) -> Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    return ((packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)).flatten()[:numel]




@dataclass
class QSGD(Codec):
    """Unbiased stochastic quantisation to s levels of |g| / ||g||, with the sign, one fp32 norm per chunk of
    QSGD_CHUNK entries (the variance grows with the chunk's length: one norm per DDP bucket of 40 k entries
    trained cnn-digits to 45% where DDP reached 97%); codes bit-packed."""

    levels: int
    seed: int = 0
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    def message_bytes(self, numel: int) -> int:
        return FP32_BYTES * math.ceil(numel / QSGD_CHUNK) + math.ceil(numel * packed_bits(self.levels) / 8)

    def encode(self, grad: Tensor, key: int) -> Tensor:
        chunks = math.ceil(grad.numel() / QSGD_CHUNK)
        padded = torch.zeros(chunks * QSGD_CHUNK)
        padded[: grad.numel()] = grad.to(torch.float32)
        rows = padded.view(chunks, QSGD_CHUNK)
        norms = rows.norm(dim=1, keepdim=True)
        scaled = rows.abs() / norms.clamp_min(torch.finfo(torch.float32).tiny) * self.levels
        lower = scaled.floor()
        # round up with probability (scaled - lower): E[level] = scaled, so the decoded gradient is unbiased
        level = lower + (torch.rand(rows.shape, generator=self.generator) < scaled - lower).float()
        codes = (torch.sign(rows) * level).to(torch.int32).flatten()[: grad.numel()] + self.levels
        return torch.cat([_fp32_bytes(norms.flatten()), pack_codes(codes, packed_bits(self.levels))])

    def decode(self, message: Tensor, numel: int) -> Tensor:
        chunks = math.ceil(numel / QSGD_CHUNK)
        norms = _fp32_from(message[: FP32_BYTES * chunks])
        codes = unpack_codes(message[FP32_BYTES * chunks:], packed_bits(self.levels), numel)
        scale = norms.repeat_interleave(QSGD_CHUNK)[:numel] / self.levels
        return (codes - self.levels).to(torch.float32) * scale


@dataclass
class MinMax8(Codec):
    """ByteGrad: 256 levels between the bucket's min and max, round to nearest."""

    def message_bytes(self, numel: int) -> int:
        return 2 * FP32_BYTES + numel

    def encode(self, grad: Tensor, key: int) -> Tensor:
        grad = grad.to(torch.float32)
        low, high = grad.min(), grad.max()
        scale = (high - low) / 255 if high > low else torch.ones(())
        codes = ((grad - low) / scale).round().clamp_(0, 255).to(torch.uint8)
        return torch.cat([_fp32_bytes(torch.stack([low, scale])), codes])

    def decode(self, message: Tensor, numel: int) -> Tensor:
        low, scale = _fp32_from(message[: 2 * FP32_BYTES]).unbind()
        return message[2 * FP32_BYTES:].to(torch.float32) * scale + low


def gathered_average(codec: Codec, messages: Tensor, ranks: int, numel: int) -> Tensor:
    """Decode every rank's message (all-gathered end to end) and average them."""
    return sum(codec.decode(m, numel) for m in messages.view(ranks, -1)) / ranks  # type: ignore[return-value]


# --------------------------------------------------------------------------- hooks
def codec_hook(codec: Codec, group: Any = None) -> Hook:
    """A DDP comm hook: encode the bucket, all-gather the messages, decode and average into the bucket."""

    def hook(_state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotated hooks (see ddp.py)
        buffer = bucket.buffer()
        ranks = dist.get_world_size(group)
        message = codec.encode(buffer, bucket.index())
        gathered = torch.empty(ranks * message.numel(), dtype=torch.uint8)
        future = dist.all_gather_into_tensor(gathered, message, group=group, async_op=True).get_future()

        def decode(_fut):  # type: ignore[no-untyped-def]
            buffer.copy_(gathered_average(codec, gathered, ranks, buffer.numel()))
            return buffer

        return future.then(decode)

    return hook


def one_bucket_at_a_time(hook: Hook) -> Hook:
    """`hook`, but a bucket starts only once the previous bucket's communication has finished."""
    previous: list[torch.futures.Future[Tensor]] = []

    def serialised(state, bucket):  # type: ignore[no-untyped-def]
        if previous:
            previous.pop().wait()
        future = hook(state, bucket)
        if not bucket.is_last():
            previous.append(future)
        return future

    return serialised


def cast_hook(dtype: torch.dtype, group: Any = None) -> Hook:
    """Cast to `dtype`, divide by the world, all-reduce, cast back: torch's fp16 hook for any dtype gloo sums."""

    def hook(_state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(_fut):  # type: ignore[no-untyped-def]
            buffer.copy_(compressed)
            return buffer

        return future.then(decompress)

    return hook


def bucket_bytes(_state: Any, bucket: dist.GradBucket) -> int:
    """What a plain all-reduce of the bucket sends."""
    return bucket.buffer().numel() * bucket.buffer().element_size()


@dataclass(frozen=True)
class CompressionHook:
    """A comm hook with its state, what each call sends, and the collective that sends it."""

    state: Any
    hook: Hook
    payload_bytes: PayloadBytes
    kind: str = "all_reduce"


def compression_hook(name: str, *, powersgd_rank: int = 1, powersgd_start_iter: int = 2, topk_ratio: float = 0.01,
                     qsgd_levels: int = 4, seed: int = 0, group: Any = None,
                     serialise_buckets: bool = True) -> CompressionHook:
    """The hook a spec's `comm_hook` names (ddp's knobs); `seed` differs per rank (QSGD's rounding);
    `serialise_buckets` (gloo) keeps PowerSGD's chained all-reduces in one order on every rank."""
    if name == "fp16":
        return CompressionHook(group, default_hooks.fp16_compress_hook, lambda _s, b: b.buffer().numel() * 2)
    if name == "bf16":
        return CompressionHook(None, cast_hook(torch.bfloat16, group), lambda _s, b: b.buffer().numel() * 2)
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=powersgd_start_iter)
        hook = one_bucket_at_a_time(powerSGD_hook.powerSGD_hook) if serialise_buckets else powerSGD_hook.powerSGD_hook
        return CompressionHook(state, hook, powersgd_payload_bytes)
    codecs: dict[str, Callable[[], Codec]] = {
        "topk": lambda: TopK(topk_ratio), "qsgd": lambda: QSGD(qsgd_levels, seed), "minmax8": MinMax8}
    if name in codecs:
        codec = codecs[name]()
        return CompressionHook(None, codec_hook(codec, group), lambda _s, b: codec.message_bytes(b.buffer().numel()),
                               "all_gather")
    return CompressionHook(group, default_hooks.allreduce_hook, bucket_bytes)


def timed_hook(hook: Hook, payload_bytes: PayloadBytes, recorder: CommRecorder, kind: str = "all_reduce") -> Hook:
    """`hook`, reporting each bucket's payload and completion to the recorder (bytes, overlap, emulation)."""

    # No annotations on the hook's parameters: DDP rejects a `bucket` annotation
    # that is not the GradBucket class itself, and postponed annotations are strings.
    def hook_with_timing(state, bucket):  # type: ignore[no-untyped-def]
        pending = recorder.launched(payload_bytes(state, bucket), kind)
        return recorder.complete_future(hook(state, bucket), pending)

    return hook_with_timing


def powersgd_payload_bytes(state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket) -> int:
    """Bytes PowerSGD all-reduces for this bucket, mirroring torch's own choice.

    Before start_powerSGD_iter the hook runs a plain all-reduce. After it,
    matrices worth compressing send their P and Q factors ((rows + cols) x
    rank), everything else (biases, small matrices) goes uncompressed.
    """
    element_bytes = bucket.buffer().element_size()
    if state.iter < state.start_powerSGD_iter:
        return bucket.buffer().numel() * element_bytes
    total = 0
    for grad in bucket.gradients():
        if grad.ndim > 1:
            rows, cols = grad.shape[0], grad.numel() // grad.shape[0]
            worth, full, compressed = powerSGD_hook._should_compress(
                rows, cols, state.matrix_approximation_rank, state.min_compression_rate)
            total += compressed if worth else full
        else:
            total += grad.numel()
    return total * element_bytes
