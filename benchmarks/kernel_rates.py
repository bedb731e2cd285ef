"""The GPU model's kernel prices against the GPU itself.

Each kind of kernel a transformer step is made of is timed on this device, at the shapes of the
published runs' layers, beside what `predict/compute.py` prices it at for the catalogue's entry of
the same GPU:

- gemm: the layer's weight GEMMs (QKV, projection, MLP up and down, forward; their input- and
  weight-gradient GEMMs), bf16, against `compute.gemm_s` (tile and wave quantisation on the SMs at
  `gemm_kernel_fraction`);
- softmax+dropout: unfused attention's score passes, forward and backward through autograd, fp16,
  against `UNFUSED_SCORE_BYTES_FORWARD + _BACKWARD` bytes per score at the streaming bandwidth;
- flash attention: `scaled_dot_product_attention`, causal, forward and backward, bf16, against
  `compute.attention_core_times_s` (`flash_attention_fraction`);
- element-wise: a layer's two layer norms, two dropout + residual adds and the GeLU, forward and
  backward, against `compute.layer_elementwise_times_s`;
- copy: a device-to-device copy, against the datasheet bandwidth x `memory_fraction`;
- adam: torch's fused AdamW step on fp32 parameters, against 28 bytes per parameter at that bandwidth;
- layer: one whole pre-LN GPT block as eager PyTorch runs it (layer norms, the four weight GEMMs,
  FlashAttention, GeLU, dropout + residual adds), forward and backward, against the sum the model
  makes of it (`layer_parts_s`: GEMMs + attention core + element-wise passes + launch gaps). The
  kinds above check each price; this checks that a layer costs the sum of its kernels on the GPU,
  with no communication: a ratio well above 1 here (and not above) is per-GPU framework time the
  model does not price, the first suspect for the MosaicML runs' gap (docs/predict.md). One call of
  each block runs under torch.profiler and is split into the model's parts (GEMMs, attention,
  element-wise, idle between kernels) by kernel name, each beside the model's price for it.

A kernel benchmark is a hardware-level fact, the kind of source issue 23 admits for the model's
constants (a training run's throughput is not): a ratio far from 1 says which constant or which
byte count the model has wrong on this GPU, with no training run involved. Timing: CUDA events
around `--repeats` calls after a warm-up, the median.

    python benchmarks/kernel_rates.py                  # on a GPU; the catalogue entry from its name
    python benchmarks/kernel_rates.py --against h100 --quick --json out.json
    .venv/bin/python benchmarks/kernel_rates.py --device cpu --against h100 --quick   # checks the script;
                                                       # a CPU's times mean nothing against a GPU's entry
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ddlscope.predict import ModelSpec, compute
from ddlscope.predict.catalogue import Device, load_catalogue

# The published runs' layer shapes (benchmarks/published_runs.py): hidden, heads, tensor-parallel size.
LAYERS = {"1.7B (h 2304)": (2304, 24, 1), "13B (h 5120)": (5120, 40, 1), "175B, TP 8 (h 12288)": (12288, 96, 8),
          "530B, TP 8 (h 20480)": (20480, 128, 8)}
SEQ = 2048
CATALOGUE_BY_NAME = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb"), ("V100", "v100"), ("A10G", "a10g"),
                     ("MI250", "mi250x"))


@dataclass
class Kernel:
    kind: str
    shape: str
    measured_s: float
    predicted_s: float

    @property
    def ratio(self) -> float:
        """Measured over predicted: above 1, the GPU is slower than the model says."""
        return self.measured_s / self.predicted_s


def timed_s(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of one call, after two calls of warm-up."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def gemm_kernels(dev: Device, device: torch.device, layers: dict, tokens: int, repeats: int) -> list[Kernel]:
    peak = dev.peak("bf16")
    out = []
    for name, (h, _heads, tp) in layers.items():
        for label, n, k in (("QKV", 3 * h // tp, h), ("projection", h, h // tp), ("MLP up", 4 * h // tp, h),
                            ("MLP down", h, 4 * h // tp)):
            # forward (tokens x k @ k x n), input gradient (tokens x n @ n x k), weight gradient (k x tokens @ tokens x n)
            for part, (m, nn, kk) in (("fwd", (tokens, n, k)), ("dgrad", (tokens, k, n)), ("wgrad", (k, n, tokens))):
                a = torch.randn(m, kk, device=device, dtype=torch.bfloat16)
                b = torch.randn(kk, nn, device=device, dtype=torch.bfloat16)
                measured = timed_s(lambda: a @ b, device, repeats)
                predicted = float(compute.gemm_s(m, nn, kk, dev, peak))
                out.append(Kernel("gemm", f"{name} {label} {part} {m}x{nn}x{kk}", measured, predicted))
                del a, b
    return out


def score_kernels(dev: Device, device: torch.device, layers: dict, micro_batch: int, repeats: int) -> list[Kernel]:
    """Unfused attention's softmax + dropout over the s x s scores, forward and backward (autograd)."""
    out = []
    for name, (h, heads, tp) in layers.items():
        n_mats = micro_batch * heads // tp
        scores = torch.randn(n_mats, SEQ, SEQ, device=device, dtype=torch.float16, requires_grad=True)
        grad = torch.randn(n_mats, SEQ, SEQ, device=device, dtype=torch.float16)

        def forward_backward():
            probs = F.dropout(torch.softmax(scores, dim=-1), p=0.1)
            probs.backward(grad)

        measured = timed_s(forward_backward, device, repeats)
        per_score = compute.UNFUSED_SCORE_BYTES_FORWARD + compute.UNFUSED_SCORE_BYTES_BACKWARD
        predicted = float(compute.memory_bound_s(per_score * n_mats * SEQ * SEQ, dev))
        out.append(Kernel("softmax+dropout", f"{name} {n_mats} x {SEQ}^2 fwd+bwd", measured, predicted))
        del scores, grad
    return out


def flash_kernels(dev: Device, device: torch.device, layers: dict, micro_batch: int, repeats: int) -> list[Kernel]:
    out = []
    for name, (h, heads, tp) in layers.items():
        local_heads, head_dim = heads // tp, h // heads
        q, k, v = (torch.randn(micro_batch, local_heads, SEQ, head_dim, device=device, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn(micro_batch, local_heads, SEQ, head_dim, device=device, dtype=torch.bfloat16)

        def forward_backward():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        model = ModelSpec(hidden=h, heads=heads, layers=1, seq=SEQ, vocab=1, global_batch=micro_batch,
                          attention="flash")
        forward_s, backward_s = compute.attention_core_times_s(model, micro_batch, tp, dev, dev.peak("bf16"))
        out.append(Kernel("flash attention", f"{name} b{micro_batch} x {local_heads} heads fwd+bwd",
                          timed_s(forward_backward, device, repeats), float(forward_s + backward_s)))
    return out


def elementwise_kernels(dev: Device, device: torch.device, layers: dict, micro_batch: int,
                        repeats: int) -> list[Kernel]:
    """A layer's memory-bound passes as an unfused PyTorch layer runs them, forward and backward."""
    out = []
    for name, (h, heads, tp) in layers.items():
        if tp != 1:  # the replicated passes are the same as at tp 1; the GeLU's width shrinks (covered)
            continue
        tokens = micro_batch * SEQ
        make = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
        x, attn, up, mlp = make(tokens, h), make(tokens, h), make(tokens, 4 * h), make(tokens, h)
        norm1, norm2 = (torch.nn.LayerNorm(h, device=device, dtype=torch.bfloat16) for _ in range(2))
        grads = [torch.ones(tokens, width, device=device, dtype=torch.bfloat16) for width in (h, h, 4 * h, h)]

        def forward_backward():
            n1 = norm1(x)
            y1 = F.dropout(attn, p=0.1) + x
            n2 = norm2(y1)
            g = F.gelu(up)
            y2 = F.dropout(mlp, p=0.1) + y1
            torch.autograd.backward([n1, n2, g, y2], grads)

        model = ModelSpec(hidden=h, heads=heads, layers=1, seq=SEQ, vocab=1, global_batch=micro_batch, dtype="bf16")
        forward_s, backward_s = compute.layer_elementwise_times_s(model, micro_batch, 1, False, dev)
        out.append(Kernel("element-wise", f"{name} {tokens} tokens: 2 LN, 2 dropout+add, GeLU fwd+bwd",
                          timed_s(forward_backward, device, repeats), float(forward_s + backward_s)))
    return out


def copy_and_adam_kernels(dev: Device, device: torch.device, elements: int, repeats: int) -> list[Kernel]:
    src = torch.empty(elements, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy = Kernel("copy", f"{elements * 4 / 2**20:.0f} MiB fp32", timed_s(lambda: dst.copy_(src), device, repeats),
                  float(compute.memory_bound_s(8.0 * elements, dev)))
    del src, dst
    params = [torch.nn.Parameter(torch.randn(elements // 16, device=device)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    adam = Kernel("adam", f"{elements:,} fp32 parameters, fused AdamW",
                  timed_s(optimizer.step, device, repeats), float(compute.memory_bound_s(28.0 * elements, dev)))
    return [copy, adam]


LAYER_PARTS = ("GEMMs", "attention", "element-wise", "idle")


def layer_parts_s(model: ModelSpec, micro_batch: int, dev: Device) -> dict[str, float]:
    """Forward + backward seconds the model prices one layer's parts at on one GPU: tensor parallel 1, no
    sequence parallelism, no communication (what `predict/model.py` sums for a micro-batch); "idle" is the
    launch gaps between kernels. The layer's price is their sum."""
    peak = dev.peak(model.dtype)
    parts = (compute.layer_gemm_times_s(model, micro_batch, 1, dev, peak),
             compute.attention_core_times_s(model, micro_batch, 1, dev, peak),
             compute.layer_elementwise_times_s(model, micro_batch, 1, False, dev),
             compute.kernel_gaps_s(dev))
    return {name: float(f + b) for name, (f, b) in zip(LAYER_PARTS, parts)}


# Kernel (CUDA) or operator (CPU) names by part of the layer, tried in this order; the rest is element-wise
# (layer norms, GeLU, dropout, adds, copies). cuBLAS names its GEMM kernels *gemm*, *xmma* or nvjet*
# (CUDA 12), CUTLASS cutlass*; PyTorch's FlashAttention kernels flash_*, its memory-efficient ones fmha_*.
PROFILE_NAMES = (("attention", ("flash", "fmha", "attention", "scaled_dot_product")),
                 ("GEMMs", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "aten::mm", "aten::addmm", "aten::bmm")))


def part_of(name: str) -> str:
    low = name.lower()
    return next((part for part, needles in PROFILE_NAMES if any(n in low for n in needles)), "element-wise")


def profiled_parts_s(run: Callable[[], object], device: torch.device, wall_s: float) -> dict[str, float]:
    """Seconds per part of one call under torch.profiler: on a GPU each kernel's device time by its name;
    on a CPU each operator's own time. "idle" is `wall_s` (the call's median time) less all of them: on a
    GPU the time it waits between kernels, on a CPU the framework's time outside the operators."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    own = DeviceType.CUDA if cuda else DeviceType.CPU  # a GPU's kernels, not the CPU ops that launched them
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    parts = dict.fromkeys(LAYER_PARTS, 0.0)
    for event in prof.key_averages():
        own_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if event.device_type == own and own_us > 0:
            parts[part_of(event.key)] += own_us / 1e6
    parts["idle"] = max(wall_s - sum(parts.values()), 0.0)
    return parts


class Block(torch.nn.Module):
    """One pre-LN GPT block, written out as the eager PyTorch of llm-foundry or nanoGPT runs it."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(context), self.dropout, self.training)
        return x + F.dropout(self.down(F.gelu(self.up(self.norm2(x)))), self.dropout, self.training)


@dataclass
class LayerProfile:
    shape: str
    measured_s: dict[str, float]  # by part, one profiled call
    predicted_s: dict[str, float]


def layer_kernels(dev: Device, device: torch.device, layers: dict, micro_batch: int, seq: int,
                  repeats: int) -> tuple[list[Kernel], list[LayerProfile]]:
    """Whole blocks, forward and backward, bf16, against the model's sum of the block's kernels; and
    each block's time split into the model's parts, measured under the profiler."""
    out, profiles = [], []
    for name, (h, heads, tp) in layers.items():
        if tp != 1:  # a tensor-parallel layer's collectives are the network's, not this GPU's
            continue
        block = Block(h, heads).to(device=device, dtype=torch.bfloat16)
        x = torch.randn(micro_batch, seq, h, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)

        def forward_backward():
            for p in block.parameters():
                p.grad = None  # a micro-batch's fresh gradients, no accumulation pass (priced apart)
            block(x).backward(grad)

        model = ModelSpec(hidden=h, heads=heads, layers=1, seq=seq, vocab=1, global_batch=micro_batch,
                          attention="flash", dtype="bf16")
        predicted = layer_parts_s(model, micro_batch, dev)
        shape = f"{name} block, b{micro_batch} x seq {seq} fwd+bwd"
        measured_s = timed_s(forward_backward, device, repeats)
        out.append(Kernel("layer", shape, measured_s, sum(predicted.values())))
        profiles.append(LayerProfile(shape, profiled_parts_s(forward_backward, device, measured_s), predicted))
        del block, x, grad
    return out, profiles


def device_key(device: torch.device, against: str | None) -> str:
    if against:
        return against
    if device.type != "cuda":
        raise SystemExit("--against DEVICE is needed off a GPU (a catalogue key, e.g. h100)")
    name = torch.cuda.get_device_name(0)
    for part, key in CATALOGUE_BY_NAME:
        if part in name:
            return key
    raise SystemExit(f"no catalogue entry for {name!r}: name one with --against")


def summary(kernels: list[Kernel]) -> dict[str, dict[str, float]]:
    """Per kind: the geometric mean of measured / predicted, and its range."""
    kinds: dict[str, list[float]] = {}
    for k in kernels:
        kinds.setdefault(k.kind, []).append(k.ratio)
    return {kind: {"geomean": math.exp(statistics.fmean(math.log(r) for r in ratios)), "low": min(ratios),
                   "high": max(ratios), "kernels": len(ratios)} for kind, ratios in kinds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--against", help="catalogue device key (default: from the GPU's name)")
    parser.add_argument("--quick", action="store_true", help="the smallest layer only, fewer repeats, small shapes")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", help="write every kernel and the summary here")
    args = parser.parse_args()
    device = torch.device(args.device)
    key = device_key(device, args.against)
    dev = load_catalogue().devices[key]
    layers = dict(list(LAYERS.items())[:1]) if args.quick else LAYERS
    repeats = args.repeats or (3 if args.quick else 10)
    tokens = 512 if args.quick and device.type == "cpu" else 4096
    micro_batch = 1 if args.quick else 2
    print(f"{device} ({torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}) against the catalogue's "
          f"{key}: {dev.description}", flush=True)
    kernels = gemm_kernels(dev, device, layers, tokens, repeats)
    if not (args.quick and device.type == "cpu"):  # s x s scores: seconds each on a CPU
        kernels += score_kernels(dev, device, layers, micro_batch, repeats)
        kernels += flash_kernels(dev, device, layers, micro_batch, repeats)
    kernels += elementwise_kernels(dev, device, layers, micro_batch if device.type == "cuda" else 1, repeats)
    kernels += copy_and_adam_kernels(dev, device, 2**20 if device.type == "cpu" else 2**28, repeats)
    layer_kinds, profiles = layer_kernels(dev, device, layers, micro_batch, 256 if device.type == "cpu" else SEQ,
                                          repeats)
    kernels += layer_kinds
    width = max(len(k.shape) for k in kernels)
    print(f"{'kind':16} {'shape':{width}} {'measured ms':>12} {'predicted ms':>13} {'measured/predicted':>19}")
    for k in kernels:
        print(f"{k.kind:16} {k.shape:{width}} {k.measured_s * 1e3:12.3f} {k.predicted_s * 1e3:13.3f} {k.ratio:19.3f}")
    totals = summary(kernels)
    for kind, s in totals.items():
        print(f"{kind}: measured/predicted geometric mean {s['geomean']:.3f} "
              f"({s['low']:.3f}-{s['high']:.3f}, {s['kernels']} kernels)")
    for profile in profiles:
        print(f"{profile.shape}, by part (one profiled call): measured ms / predicted ms")
        for part in LAYER_PARTS:
            measured, predicted = profile.measured_s[part], profile.predicted_s[part]
            print(f"  {part:13} {measured * 1e3:10.3f} {predicted * 1e3:10.3f}  x{measured / predicted:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "against": key, "kernels": [asdict(k) | {"ratio": k.ratio} for k in kernels],
                       "summary": totals, "layer_profiles": [asdict(p) for p in profiles]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
