"""Gradient compression codecs (strategies/compression.py), in process: message sizes, round trips,
error feedback, and the spec's bad knobs. The hooks on real DDP are in test_comm_hooks.py."""

import math

import pytest
import torch

from ddlscope.specs.strategies.ddp import DDPSpec
from ddlscope.strategies.compression import MinMax8, QSGD, TopK, pack_codes, packed_bits, unpack_codes

NUMEL = 10_000
PLAIN_BYTES = 4 * NUMEL


def _grad(seed: int = 0, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("codec, expected_fraction", [
    (TopK(0.01), 2 * 0.01),  # fp32 value + int32 index per kept entry
    (TopK(0.1), 2 * 0.1),
    (QSGD(1), 2 / 32 + 1 / 512),  # 3 codes -> 2 bits, and an fp32 norm per 512 entries
    (QSGD(4), 4 / 32 + 1 / 512),  # 9 codes -> 4 bits
    (QSGD(100), 8 / 32 + 1 / 512),  # 201 codes -> 8 bits
    (MinMax8(), 8 / 32),
])
def test_message_is_the_expected_fraction_of_fp32(codec, expected_fraction):
    message = codec.encode(_grad(), key=0)
    assert message.dtype == torch.uint8 and message.numel() == codec.message_bytes(NUMEL)
    assert message.numel() / PLAIN_BYTES == pytest.approx(expected_fraction, rel=0.002)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bit_packing_round_trips(bits):
    codes = torch.randint(0, 2**bits, (1001,), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
    packed = pack_codes(codes, bits)
    assert packed.numel() == math.ceil(1001 * bits / 8)
    assert torch.equal(unpack_codes(packed, bits, 1001), codes)
    assert packed_bits(1) == 2 and packed_bits(7) == 4 and packed_bits(8) == 8


def test_minmax8_error_is_at_most_half_a_step():
    grad = _grad(1)
    codec = MinMax8()
    decoded = codec.decode(codec.encode(grad, 0), NUMEL)
    step = (grad.max() - grad.min()) / 255
    assert (decoded - grad).abs().max() <= step / 2 * 1.001
    assert (decoded - grad).abs().max() > step / 10  # it does quantise


def test_qsgd_norms_are_per_chunk_of_512():
    """A chunk of large entries beside one of small ones: each is quantised against its own norm."""
    grad = torch.cat([_grad(7, 512) * 1000, _grad(8, 512)])
    codec = QSGD(100, seed=1)
    decoded = codec.decode(codec.encode(grad, 0), 1024)
    small = decoded[512:] - grad[512:]
    assert small.norm() < 0.2 * grad[512:].norm()  # with one norm for both, the small half would be all noise


def test_qsgd_is_unbiased_and_on_its_levels():
    grad = _grad(2, 500)
    codec = QSGD(2, seed=3)
    decodes = torch.stack([codec.decode(codec.encode(grad, 0), 500) for _ in range(4000)])
    levels = decodes[0] / grad.norm() * 2
    assert torch.allclose(levels, levels.round(), atol=1e-4) and levels.abs().max() <= 2  # s = 2 levels a sign
    bias = (decodes.mean(0) - grad).abs().max()
    spread = decodes.std(0).max() / math.sqrt(len(decodes))
    assert bias < 5 * spread  # the mean of many decodes is the gradient: unbiased rounding


def test_topk_keeps_the_largest_and_all_of_it_at_ratio_one():
    grad = _grad(4)
    codec = TopK(0.01)
    decoded = codec.decode(codec.encode(grad, 0), NUMEL)
    kept = decoded.nonzero().flatten()
    assert len(kept) == 100 and torch.equal(decoded[kept], grad[kept])
    assert grad[kept].abs().min() >= grad.abs().kthvalue(NUMEL - 100).values
    full = TopK(1.0)
    assert torch.equal(full.decode(full.encode(grad, 0), NUMEL), grad)


def test_error_feedback_sends_every_gradient_eventually():
    """The same gradient for T steps: with error feedback the sum sent is T g minus a bounded residual,
    so its relative error falls like 1/T; without it, 99% of every gradient is lost forever."""
    grad = _grad(5, 1000)
    codec = TopK(0.01)
    sent = torch.zeros(1000)
    errors = {}
    for step in range(1, 401):
        sent += codec.decode(codec.encode(grad, 0), 1000)
        if step in (100, 400):
            errors[step] = ((sent - step * grad).norm() / (step * grad).norm()).item()
    assert errors[400] < 0.4 * errors[100] and errors[400] < 0.15
    assert torch.allclose(sent + codec.residuals[0], 400 * grad, rtol=1e-4, atol=1e-3)  # nothing is lost


def test_error_feedback_topk_converges_to_the_uncompressed_update_on_a_quadratic():
    """Gradient descent on 1/2 x'Hx - c'x: the accumulated update of top-k (1%) with error feedback ends
    where the uncompressed one does (the minimiser), within 1% (without the residual it is still 30% away)."""
    gen = torch.Generator().manual_seed(6)
    h = torch.rand(200, generator=gen) + 0.5  # a diagonal Hessian, condition number 3
    c = torch.randn(200, generator=gen)
    x_plain, x_topk = torch.zeros(200), torch.zeros(200)
    codec = TopK(0.01)
    for _ in range(4000):
        x_plain -= 0.02 * (h * x_plain - c)
        x_topk -= 0.02 * codec.decode(codec.encode(h * x_topk - c, 0), 200)
    assert torch.allclose(x_plain, c / h, atol=1e-5)
    assert (x_topk - x_plain).norm() / x_plain.norm() < 0.01


@pytest.mark.parametrize("knobs, field", [
    ({"comm_hook": "int4"}, "comm_hook"), ({"topk_ratio": 0}, "topk_ratio"), ({"topk_ratio": 1.5}, "topk_ratio"),
    ({"qsgd_levels": 0}, "qsgd_levels"), ({"qsgd_levels": 128}, "qsgd_levels"), ({"buckets": "optimal"}, "buckets"),
])
def test_bad_compression_knobs_are_refused_naming_the_field(knobs, field):
    with pytest.raises(ValueError, match=field):
        DDPSpec(**knobs)
