"""Kernel-level compute model, the prediction's range, and its sources (issue 23)."""

from __future__ import annotations

import pytest

from ddlscope.predict import ModelSpec, ParallelSpec, parse_cluster, predict
from ddlscope.predict import compute
from ddlscope.predict.catalogue import load_catalogue

GPT_13B = ModelSpec(hidden=5120, heads=40, layers=40, seq=2048, vocab=51200, global_batch=512)


def test_range_holds_the_prediction_and_spans_the_gemm_sources():
    cluster = parse_cluster("a100-80gb:8x8")
    p = predict(GPT_13B, ParallelSpec(tp=2, dp=32, micro_batch=4, recompute="selective"), cluster)
    low, high = p.range["step_time_s"]
    assert low < p.step_time_s < high
    eff = cluster.device.efficiency
    lo_frac, hi_frac = eff.gemm_kernel_fraction_range
    # GEMM-dominated: the step moves by about the GEMM sources' spread, never by more than all of it
    assert high / low < hi_frac / lo_frac * 1.05
    assert high / low > 1.02
    assert p.range["tflops_per_gpu"][0] < p.tflops_per_gpu < p.range["tflops_per_gpu"][1]
    assert p.range["mfu"][0] < p.mfu < p.range["mfu"][1]


def test_every_nvidia_device_has_sms_and_ranges_holding_the_central_value():
    for key, dev in load_catalogue().devices.items():
        e = dev.efficiency
        assert e.sms > 0, key
        assert e.sustained_fraction == 1.0, key  # nothing derated for a stack in the catalogue
        for name in ("gemm_kernel_fraction", "flash_attention_fraction", "memory_fraction"):
            low, high = getattr(e, f"{name}_range")
            assert low <= getattr(e, name) <= high and high < 1.0, (key, name)


def test_large_gemm_runs_at_the_published_matmul_rate():
    """A wave-aligned large GEMM on A100 gets the kernel fraction (MAMF ~268-271 of 312 TFLOP/s)."""
    a100 = load_catalogue().devices["a100-80gb"]
    m = n = k = 108 * 256  # 108 x 216 tiles of 256x128: 216 full waves
    t = float(compute.gemm_s(m, n, k, a100, 312e12))
    assert 2 * m * n * k / t / 1e12 == pytest.approx(312 * 0.86, rel=1e-9)


def test_flash_attention_at_its_own_rate():
    a100 = load_catalogue().devices["a100-80gb"]
    model = ModelSpec(hidden=4096, heads=32, layers=1, seq=4096, vocab=1, global_batch=1)
    forward, backward = compute.attention_core_times_s(model, 1, 1, a100, 312e12)
    flops = 4 * 1 * 32 * 4096 * 4096 * 128 * 0.5  # causal: half the blocks
    assert float(forward) == pytest.approx(flops / (312e12 * 0.58))
    assert float(backward) == pytest.approx(2.5 * float(forward))
