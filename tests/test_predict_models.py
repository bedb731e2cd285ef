"""Closed-form pieces of the predictor: FLOPs, memory, collectives, pipeline, catalogue."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddlscope.predict import ClusterStringError, ModelSpec, ParallelSpec, parse_cluster, predict
from ddlscope.predict import collectives as coll
from ddlscope.predict import compute, memory
from ddlscope.predict.catalogue import load_catalogue
from ddlscope.specs import ConfigError

SRC = Path(__file__).resolve().parents[1] / "src"
GB = 1e9


# ---------------------------------------------------------------------------- no torch
def test_importing_the_predictor_does_not_import_torch():
    code = ("import sys, ddlscope.predict, ddlscope.predict.planner, ddlscope.predict.strategies, "
            "ddlscope.cli.predict; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert not any(m.startswith('torch.') for m in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------- catalogue
def test_catalogue_has_the_named_clusters_and_datasheet_figures():
    cat = load_catalogue()
    for name in ("a100-80gb", "a100-40gb", "a10g", "h100", "h200", "v100", "mi250x"):
        assert name in cat.clusters
    a100 = cat.devices["a100-80gb"]
    # REFERENCE.md: 312 TFLOP/s bf16, 80 GB, 2.039 TB/s, 400 W
    assert a100.peak("bf16") == pytest.approx(312e12) and a100.power_w == 400
    assert a100.memory_bandwidth_bytes_per_s == pytest.approx(2.039e12)
    assert cat.devices["h200"].memory_bytes == 141 * 2**30
    assert cat.links["nvlink3"].bandwidth_bytes_per_s == 300e9  # 600 GB/s total = 300 per direction
    for dev in cat.devices.values():
        assert dev.price_usd_per_hour > dev.spot_price_usd_per_hour > 0
        assert 0 < dev.efficiency.gemm_kernel_fraction * dev.efficiency.sustained_fraction < 1


def test_cluster_strings():
    c = parse_cluster("a100-80gb:64x8")
    assert (c.nodes, c.gpus_per_node, c.n_gpus, c.device.key) == (64, 8, 512, "a100-80gb")
    assert parse_cluster("a10g:4x4").node.inter.key == "eth-40g"
    assert parse_cluster("a10g:2x8").node.inter.key == "eth-100g"
    for bad in ("a100-80gb", "a100-80gb:64", "a100-80gb:64x", "tpu:4x8", "a100-80gb:0x8", "h100:2x16", ""):
        with pytest.raises(ClusterStringError) as err:
            parse_cluster(bad)
        assert isinstance(err.value, ValueError) and isinstance(err.value, ConfigError)
        assert "\n" not in str(err.value) and "cluster" in str(err.value)
    with pytest.raises(ClusterStringError, match="a100-80gb.*h100"):
        parse_cluster("tpu:4x8")  # lists what is allowed


# ---------------------------------------------------------------------------- FLOPs
def test_megatron_flops_formula_exactly():
    B, s, l, h, V = 1920, 2048, 105, 20480, 51200
    full = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert compute.megatron_flops_per_iteration(B, s, l, h, V, "full") == pytest.approx(full, rel=1e-12)
    none = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert compute.megatron_flops_per_iteration(B, s, l, h, V, "none") == pytest.approx(none, rel=1e-12)
    sel = compute.megatron_flops_per_iteration(B, s, l, h, V, "selective")
    assert none < sel < full
    # with full recomputation the exact operation count equals Megatron's closed form
    gpt = ModelSpec(hidden=h, heads=128, layers=l, seq=s, vocab=V, global_batch=B)
    assert float(compute.hardware_flops_per_iteration(gpt, 2)) == pytest.approx(full, rel=1e-12)
    # model FLOPs (MFU) = 6 x params x tokens + attention, counting the logits GEMM exactly
    exact = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert float(compute.model_flops_per_iteration(gpt)) == pytest.approx(exact, rel=1e-12)


def test_efficiency_curve_grows_with_gemm_size_and_stays_below_its_ceiling():
    for key in ("a100-80gb", "h100"):
        dev = load_catalogue().devices[key]
        ceiling = dev.efficiency.gemm_kernel_fraction * dev.efficiency.sustained_fraction
        dims = np.array([64, 256, 1024, 4096, 16384])
        eff = compute.gemm_efficiency(dims, dims, dims, dev)
        assert np.all(np.diff(eff) >= 0) and np.all(eff <= ceiling + 1e-12) and eff[-1] > 0.97 * ceiling
        assert eff[0] < 0.01 * ceiling  # one 64x64 tile on a 100+ SM die


def test_wave_quantisation_by_hand():
    """NVIDIA's matmul guide: tiles run in waves of one block per SM; a partial last wave costs a full one."""
    # 256x128 tiles, 108 SMs (A100): M = N = 2048 -> 8 x 16 = 128 tiles = 2 waves of 108 -> 128/216 useful
    assert float(compute.wave_quantisation(2048, 2048, 1, 108, 256, 128)) == pytest.approx(128 / 216)
    # padding: M = 300 needs 3 row tiles of 128 (384 rows) -> 300/384; N = 128 one tile; 3 tiles, one wave
    assert float(compute.wave_quantisation(300, 128, 1, 108, 128, 128)) == pytest.approx(300 * 128 / (108 * 128 * 128))
    # a batched GEMM shares the waves: 108 matrices of one tile each fill exactly one wave
    assert float(compute.wave_quantisation(128, 128, 108, 108, 128, 128)) == pytest.approx(1.0)
    # split-K: a conv weight gradient (576 x 64 outputs, K = 200,704) has 5 tiles of 128x64 for 108 SMs;
    # K splits 21 ways (floor(108 / 5)) into 105 blocks, one wave; 576 rows pad to 640 -> 0.9 x 105/108
    assert float(compute.wave_quantisation(576, 64, 1, 108, 128, 64, k=200704)) == pytest.approx(0.9 * 105 / 108)
    # no split when K is short (each split keeps >= 256) or the tiles fill the SMs already
    assert float(compute.wave_quantisation(576, 64, 1, 108, 128, 64, k=300)) == pytest.approx(0.9 * 5 / 108)
    a100 = load_catalogue().devices["a100-80gb"]
    # the library takes the best tile: for 2048 x 2048, 128x64 tiles = 512 tiles = 5 waves -> 512/540, at
    # 128 x 64 / 192 = 42.7 FLOP/byte of the 43.2 the L2 must feed (128x128: 256/324; 256x128: 128/216)
    assert float(compute.gemm_quantisation(2048, 2048, a100)) == pytest.approx(512 / 540 * (128 * 64 / 192) / (312 / 7.22))
    # a 64x64 tile reads (64 + 64) k elements per 2 x 64 x 64 k FLOPs: 32 FLOP/byte against the
    # 312 / 7.22 = 43.2 the A100's L2 can feed; the 256x128 tile (85.3) is not capped
    assert compute.tile_rate_fraction(64, 64, a100) == pytest.approx(32 / (312 / 7.22))
    assert compute.tile_rate_fraction(128, 128, a100) == 1.0


def test_small_k_gemm_is_memory_bound():
    dev = load_catalogue().devices["a100-80gb"]
    t = float(compute.gemm_s(4096, 4096, 8, dev, 312e12))
    moved = 2 * (4096 * 8 * 2 + 4096 * 4096)
    assert t == pytest.approx(moved / (dev.memory_bandwidth_bytes_per_s * dev.efficiency.memory_fraction))


# ---------------------------------------------------------------------------- memory
def test_zero_paper_example_to_a_tenth_of_a_gb():
    # REFERENCE.md (Rajbhandari et al. 2020): 7.5B parameters on 64 GPUs
    got = memory.zero_paper_example_gb(7.5e9, 64)
    for stage, expected in {0: 120, 1: 31.4, 2: 16.6, 3: 1.88}.items():
        assert abs(got[stage] - expected) < 0.1, (stage, got[stage])
    assert got[3] == pytest.approx(1.875, abs=1e-9)


@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 20480, 128, 8), (2048, 4, 12288, 96, 8), (1024, 8, 4096, 32, 4),
                                       (4096, 2, 8192, 64, 2)])
def test_korthikanti_activation_formulas_exactly(s, b, h, a, t):
    act = memory.activation_bytes_per_layer
    assert act(s, b, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-12)
    assert act(s, b, h, a, t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert act(s, b, h, a, t, sequence_parallel=True) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t, rel=1e-12)
    assert act(s, b, h, a, t, True, "selective") == pytest.approx(34 * s * b * h / t, rel=1e-12)
    assert act(s, b, h, a, t, False, "selective") == pytest.approx(s * b * h * (10 + 24 / t), rel=1e-12)
    assert act(s, b, h, a, t, False, "full") == pytest.approx(2 * s * b * h, rel=1e-12)
    assert act(s, b, h, a, 1) == act(s, b, h, a)  # t = 1 is "no parallelism"


def test_pipeline_in_flight_micro_batches():
    # 1F1B keeps at most p micro-batches on the first stage, GPipe keeps m (REFERENCE.md)
    assert memory.in_flight_layer_microbatches(3, 35, 240, 1, 0) == 3 * 35
    assert memory.in_flight_layer_microbatches(3, 35, 240, 1, 1) == 3 * 240
    assert memory.in_flight_layer_microbatches(3, 35, 10, 1, 0) == 3 * 10
    # interleaved: L (1 + (p-1)/(p v)) layer-micro-batches (Korthikanti et al. 2022)
    p, v, lps = 8, 4, 8
    expected = lps * p * (1 + (p - 1) / (p * v))
    assert memory.in_flight_layer_microbatches(lps, p, 64, v, 0) == pytest.approx(expected)


def test_mixed_precision_adam_is_sixteen_bytes_per_parameter():
    gpt = ModelSpec(hidden=2048, heads=16, layers=24, seq=2048, vocab=51200, global_batch=8)
    pred = predict(gpt, ParallelSpec(dp=1, micro_batch=8), parse_cluster("a100-80gb:1x1"))
    states = sum(pred.memory_breakdown_gb[k] for k in ("parameters", "gradients", "optimizer"))
    assert states == pytest.approx(16 * gpt.params / GB, rel=1e-9)


# ---------------------------------------------------------------------------- collectives
NODE = parse_cluster("a100-80gb:4x8").node


SIMPLE_BASE_S = 8.4e-6  # NCCL's Simple protocol, the one a 1 GB message uses (tuning.cc base latency)


def test_ring_reduce_scatter_all_gather_and_all_reduce_are_alpha_beta():
    S, n = 1e9, 8
    bw, alpha = NODE.intra.achieved_bytes_per_s, NODE.intra.alpha_s
    assert coll.reduce_scatter_s(S, n, 8, NODE) == pytest.approx(SIMPLE_BASE_S + (n - 1) / n * S / bw + (n - 1) * alpha)
    assert coll.all_gather_s(S, n, 8, NODE) == pytest.approx(coll.reduce_scatter_s(S, n, 8, NODE))
    assert coll.ring_all_reduce_s(S, n, 8, NODE) == pytest.approx(
        SIMPLE_BASE_S + 2 * (n - 1) / n * S / bw + 2 * (n - 1) * alpha)
    assert coll.all_reduce_s(S, 1, 1, NODE) == 0
    # across nodes with one member per node, each GPU's NIC share sets the pace, every hop a NIC's latency
    inter = NODE.inter_bytes_per_s_per_gpu
    assert coll.ring_all_reduce_s(S, 4, 1, NODE) == pytest.approx(
        SIMPLE_BASE_S + 2 * 3 / 4 * S / inter + 6 * NODE.inter.alpha_s)
    # 4 nodes of 8: of each trip's 31 hops, 3 cross a node boundary
    assert coll.ring_all_reduce_s(S, 32, 8, NODE) == pytest.approx(
        SIMPLE_BASE_S + 2 * 31 / 32 * S / min(inter * 8, bw) + 2 * (28 * alpha + 3 * NODE.inter.alpha_s))


def test_tree_wins_for_small_messages_ring_for_large():
    n, per_node = 512, 8
    small, large = 1e3, 1e10
    assert coll.tree_all_reduce_s(small, n, per_node, NODE) < coll.ring_all_reduce_s(small, n, per_node, NODE)
    assert coll.ring_all_reduce_s(large, n, per_node, NODE) < coll.tree_all_reduce_s(large, n, per_node, NODE)
    assert coll.all_reduce_s(small, n, per_node, NODE) == coll.tree_all_reduce_s(small, n, per_node, NODE)


def test_hierarchical_all_reduce_moves_1_over_g_of_the_data_across_nodes():
    S, per_node, nodes = 8e9, 8, 4
    t = float(coll.hierarchical_all_reduce_s(S, per_node * nodes, per_node, NODE))
    intra = SIMPLE_BASE_S + 2 * 7 / 8 * S / NODE.intra.achieved_bytes_per_s + 14 * NODE.intra.alpha_s
    inter = SIMPLE_BASE_S + 2 * 3 / 4 * (S / 8) / NODE.inter_bytes_per_s_per_gpu + 6 * NODE.inter.alpha_s
    assert t == pytest.approx(intra + inter)


def test_all_to_all_and_p2p():
    S = 1e9
    t = float(coll.all_to_all_s(S, 32, 8, NODE))
    off = S * 24 / 32 / NODE.inter_bytes_per_s_per_gpu
    assert t == pytest.approx(SIMPLE_BASE_S + off + 7 * NODE.intra.alpha_s + 24 * NODE.inter.alpha_s)
    assert coll.p2p_s(S, True, NODE) == pytest.approx(
        SIMPLE_BASE_S + NODE.inter.alpha_s + S / NODE.inter_bytes_per_s_per_gpu)
    assert coll.p2p_s(S, False, NODE) < coll.p2p_s(S, True, NODE)


def test_parameter_server_bottlenecks():
    S = 100e6
    # the server CPU summing gradients is the bottleneck: 16 workers x 100 MB at 5 GB/s
    push = float(coll.ps_push_s(S, 16, 1, 12.5e9, 5e9, 25e9, 0.0))
    assert push == pytest.approx(16 * S / 5e9)
    # sharding over 4 servers divides it
    assert float(coll.ps_push_s(S, 16, 4, 12.5e9, 5e9, 25e9, 0.0)) == pytest.approx(push / 4)
    # one worker alone is limited by its own link
    assert float(coll.ps_pull_s(S, 1, 1, 12.5e9, 1e9, 0.0)) == pytest.approx(S / 1e9)


def test_bucketed_overlap():
    # comm far shorter than backward: only the last bucket sticks out
    assert float(coll.bucketed_overlap_exposed_s(0.1, 0.0, 10, 1.0)) == pytest.approx(0.01)
    # comm longer than backward: almost all of what exceeds it shows
    assert float(coll.bucketed_overlap_exposed_s(3.0, 0.0, 10, 1.0)) == pytest.approx(0.1 + 3.0 - 1.0)
    assert float(coll.bucketed_overlap_exposed_s(0.0, 0.0, 10, 1.0)) == 0


# ---------------------------------------------------------------------------- the step model
MTNLG = ModelSpec(hidden=20480, heads=128, layers=105, seq=2048, vocab=51200, global_batch=1920, attention="unfused")


@pytest.mark.parametrize("v", [1, 3])
def test_bubble_fraction_is_p_minus_1_over_m_v(v):
    cluster = parse_cluster("a100-80gb:280x8")
    gb = 1960 if v == 3 else 1920  # interleaving needs m divisible by p: 245 micro-batches
    model = ModelSpec(**{**MTNLG.__dict__, "global_batch": gb})
    pred = predict(model, ParallelSpec(tp=8, pp=35, dp=8, recompute="full", interleave=v), cluster)
    m = gb // 8
    assert pred.bubble_fraction == pytest.approx(34 / (m * v), rel=1e-12)


def test_breakdown_adds_up_to_the_step():
    pred = predict(MTNLG, ParallelSpec(tp=8, pp=35, dp=8, recompute="full", zero=1), parse_cluster("a100-80gb:280x8"))
    parts = sum(v for k, v in pred.breakdown_s.items() if k != "recompute_included")
    assert parts == pytest.approx(pred.step_time_s, rel=1e-12)
    mem = sum(pred.memory_breakdown_gb.values())
    assert mem == pytest.approx(pred.memory_gb_per_gpu, rel=1e-12)
    assert pred.energy_kwh_per_step == pytest.approx(2240 * 400 * pred.step_time_s / 3.6e6)
    assert pred.cost_usd_per_step == pytest.approx(2240 * 5.12 * pred.step_time_s / 3600)


def test_mechanisms_point_the_right_way():
    cluster = parse_cluster("a100-80gb:8x8")
    gpt = ModelSpec(hidden=4096, heads=32, layers=32, seq=2048, vocab=51200, global_batch=256)
    base = ParallelSpec(tp=2, pp=2, dp=16, micro_batch=1)
    p = lambda **kw: predict(gpt, ParallelSpec(**{**base.__dict__, **kw}), cluster)  # noqa: E731
    none, sel, full = p(recompute="none"), p(recompute="selective"), p(recompute="full")
    assert full.step_time_s > sel.step_time_s >= none.step_time_s
    assert full.memory_breakdown_gb["activations"] < none.memory_breakdown_gb["activations"]
    by_stage = [p(zero=z).memory_gb_per_gpu for z in (0, 1, 2, 3)]
    assert by_stage == sorted(by_stage, reverse=True) and len(set(by_stage)) == 4
    assert p(sequence_parallel=True).memory_breakdown_gb["activations"] < none.memory_breakdown_gb["activations"]
    assert p(interleave=2).bubble_fraction == pytest.approx(none.bubble_fraction / 2)
    assert p(schedule="gpipe").memory_breakdown_gb["activations"] > none.memory_breakdown_gb["activations"]
    # same job on a slower network: data-parallel sync costs more
    slow = predict(gpt, ParallelSpec(dp=64, micro_batch=4, zero=0), parse_cluster("a100-40gb:8x8"))
    fast = predict(gpt, ParallelSpec(dp=64, micro_batch=4, zero=0), parse_cluster("a100-80gb:8x8"))
    assert slow.breakdown_s["dp_grad_sync"] > fast.breakdown_s["dp_grad_sync"]


@pytest.mark.parametrize("kwargs,field", [
    (dict(tp=8, pp=35, dp=9), "tp x pp x dp"),
    (dict(tp=5, pp=7, dp=64), "tp = 5"),
    (dict(tp=8, pp=4, dp=70), "pp = 4"),
    (dict(tp=8, pp=35, dp=8, micro_batch=7), "global_batch"),
    (dict(tp=8, pp=35, dp=8, interleave=2), "interleave"),
    (dict(tp=1, pp=35, dp=64, sequence_parallel=True), "sequence_parallel"),
])
def test_invalid_configurations_are_refused_with_one_line(kwargs, field):
    with pytest.raises(ConfigError) as err:
        predict(MTNLG, ParallelSpec(**kwargs), parse_cluster("a100-80gb:280x8"))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_every_device_predicts_something_sane():
    gpt = ModelSpec(hidden=2048, heads=16, layers=24, seq=2048, vocab=51200, global_batch=64)
    for name, shape in (("v100", "1x8"), ("a100-40gb", "1x8"), ("a100-80gb", "1x8"), ("a10g", "2x4"), ("h100", "1x8"),
                        ("h200", "1x8"), ("mi250x", "2x4")):
        cluster = parse_cluster(f"{name}:{shape}")
        pred = predict(gpt, ParallelSpec(dp=cluster.n_gpus, micro_batch=1, zero=1), cluster)
        assert 0.05 < pred.mfu < 0.75 and math.isfinite(pred.step_time_s), (name, pred.mfu)
