"""Kernel-level compute model, the prediction's range, and its sources (issue 23)."""

from __future__ import annotations

import numpy as np
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


def test_every_device_has_sms_and_ranges_holding_the_central_value():
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


# ---------------------------------------------------------------------------- mixture of experts
from ddlscope.predict import collectives as coll  # noqa: E402
from ddlscope.predict.model import ConfigArrays, evaluate  # noqa: E402

MOE = ModelSpec(hidden=1024, heads=8, layers=4, seq=2048, vocab=32000, global_batch=64, experts=8, top_k=2)


def test_moe_counts_active_flops_and_all_expert_parameters():
    h, f = 1024, 4096
    dense_mlp = 2 * h * f
    assert MOE.dense_flops_per_token == 2 * (h * 3 * h + h * h + 2 * dense_mlp + h * 8)  # top 2 of 8, + router
    mlp_params = 2 * h * f + f + h
    assert MOE.layer_params == (h * 3 * h + 3 * h + h * h + h) + 8 * mlp_params + h * 8 + 4 * h


def test_one_expert_top_one_is_the_dense_mlp_plus_a_router():
    a100 = load_catalogue().devices["a100-80gb"]
    dense = ModelSpec(hidden=1024, heads=8, layers=4, seq=2048, vocab=32000, global_batch=64)
    single = ModelSpec(hidden=1024, heads=8, layers=4, seq=2048, vocab=32000, global_batch=64, experts=1, top_k=1)
    d_f, _ = compute.layer_gemm_times_s(dense, 4, 1, a100, 312e12)
    s_f, _ = compute.layer_gemm_times_s(single, 4, 1, a100, 312e12)
    router = compute.linear_forward_s(4 * 2048, 1, 1024, a100, 312e12)
    assert float(s_f) == pytest.approx(float(d_f + router), rel=1e-12)


def test_expert_load_scales_the_busiest_ranks_expert_work():
    a100 = load_catalogue().devices["a100-80gb"]
    base = ModelSpec(hidden=4096, heads=32, layers=1, seq=4096, vocab=1, global_batch=1, experts=8, top_k=2)
    padded = ModelSpec(hidden=4096, heads=32, layers=1, seq=4096, vocab=1, global_batch=1, experts=8, top_k=2,
                       capacity_factor=2.0)
    f1, _ = compute.layer_gemm_times_s(base, 2, 1, a100, 312e12, ep=8)
    f2, _ = compute.layer_gemm_times_s(padded, 2, 1, a100, 312e12, ep=8)
    attention = sum(compute.linear_forward_s(2 * 4096, n, 4096, a100, 312e12) for n in (3 * 4096, 4096))
    router = compute.linear_forward_s(2 * 4096, 8, 4096, a100, 312e12)
    # one local expert, 8 ranks x 8192 tokens x 2 / 8 experts = 16384 tokens (x2 padded): GEMM-bound, wave-aligned
    experts1, experts2 = float(f1 - attention - router), float(f2 - attention - router)
    assert experts2 / experts1 == pytest.approx(2.0, rel=0.02)
    assert experts1 == pytest.approx(2 * 2 * 16384 * 4096 * 16384 / (312e12 * 0.86), rel=0.03)


def nccl_by_hand(hops: float, hop_s: float, transfer_s: float) -> float:
    """NCCL's tuner by hand: LL (6.6 us, hops at 0.6/3.4 of Simple's, half the bandwidth), LL128 (14 us,
    1.9/3.4, 0.92), Simple (8.4 us, 1, 1)."""
    return min(6.6e-6 + hops * hop_s * 0.6 / 3.4 + transfer_s / 0.5, 14e-6 + hops * hop_s * 1.9 / 3.4 + transfer_s / 0.92,
               8.4e-6 + hops * hop_s + transfer_s)


def _one(model, cluster, **parallel):
    spec = ParallelSpec(**parallel)
    return evaluate(model, cluster, ConfigArrays.from_specs([spec])), spec


def test_expert_all_to_all_by_hand():
    """8 experts over ep 8 on one NVSwitch node: each rank sends b s h k x 2 bytes, 7/8 of it off-GPU."""
    cluster = parse_cluster("a100-80gb:1x8")
    out, spec = _one(MOE, cluster, dp=8, ep=8, micro_batch=2)
    node = cluster.node
    size = 2 * 2048 * 1024 * 2 * 2  # b s h k bytes
    one = nccl_by_hand(7, node.intra.alpha_s, size * 7 / 8 / node.intra.achieved_bytes_per_s)
    micro_batches, layers = 64 / (8 * 2), 4
    assert float(out["ep_comm_s"][0]) == pytest.approx(micro_batches * layers * 4 * one, rel=1e-12)
    no_ep, _ = _one(MOE, cluster, dp=8, ep=1, micro_batch=2)
    assert float(no_ep["ep_comm_s"][0]) == 0.0
    # expert weights: 1/8 of them per GPU with ep 8
    assert float(no_ep["parameters_bytes"][0]) - float(out["parameters_bytes"][0]) == pytest.approx(
        2 * 4 * 8 * MOE.mlp_params * 7 / 8, rel=1e-9)


# ---------------------------------------------------------------------------- context parallelism
LONG = ModelSpec(hidden=4096, heads=32, layers=8, seq=32768, vocab=32000, global_batch=16)


def test_context_parallel_rank_does_the_work_of_its_share_of_tokens():
    """cp 2 with micro-batch 2 gives each rank the tokens of one sequence: the same kernels as cp 1, micro-batch 1."""
    cluster = parse_cluster("h100:1x8")
    cp2, _ = _one(LONG, cluster, cp=2, dp=4, micro_batch=2)
    cp1, _ = _one(LONG, cluster, cp=1, dp=8, micro_batch=1)
    assert float(cp2["compute_s"][0]) == pytest.approx(float(cp1["compute_s"][0]), rel=1e-12)
    assert float(cp2["activations_bytes"][0]) == pytest.approx(float(cp1["activations_bytes"][0]), rel=1e-12)


def test_ring_attention_exposed_when_it_crosses_nodes():
    """tp 8 x cp 4 spans 4 nodes: each of 3 hops sends this rank's K and V chunk over its NIC share while the
    attention on the previous chunk runs; what does not hide shows."""
    cluster = parse_cluster("a100-80gb:4x8")
    out, _ = _one(LONG, cluster, tp=8, cp=4, dp=1, micro_batch=1)
    node, dev = cluster.node, cluster.device
    kv_bytes = 1 / 4 * 32768 * 2 * 32 * 128 / 8 * 2
    hop_f = nccl_by_hand(1, node.inter.alpha_s, kv_bytes / node.inter_bytes_per_s_per_gpu)
    hop_b = nccl_by_hand(1, node.inter.alpha_s, 2 * kv_bytes / node.inter_bytes_per_s_per_gpu)
    attn_f, attn_b = compute.attention_core_times_s(LONG, 1 / 4, 8, dev, dev.peak("bf16"))
    per_layer = max(3 * hop_f - float(attn_f), 0) + max(3 * hop_b - float(attn_b), 0)
    assert per_layer > 0
    assert float(out["cp_comm_s"][0]) == pytest.approx(16 * 8 * per_layer, rel=1e-12)
    inside, _ = _one(LONG, parse_cluster("a100-80gb:4x8"), tp=2, cp=4, dp=4, micro_batch=1)
    assert float(inside["cp_comm_s"][0]) < float(out["cp_comm_s"][0])  # NVLink hops hide behind attention


def test_plan_searches_experts_and_context_parallel():
    from ddlscope.predict.planner import candidate_configs, plan

    cluster = parse_cluster("h100:2x8")
    configs = candidate_configs(MOE, cluster)
    assert set(configs.ep.tolist()) == {1, 2, 4, 8} and 2 in set(configs.cp.tolist())
    result = plan(MOE, cluster, top=3)
    assert result.rows and all(r.prediction.fits for r in result.rows)
    best = result.rows[0].prediction
    again = predict(MOE, ParallelSpec(**best.parallel), cluster)
    assert again.step_time_s == pytest.approx(best.step_time_s, rel=1e-9)


# ---------------------------------------------------------------------------- collectives (NCCL's cost model)
def test_all_reduce_follows_nccl_protocols_by_message_size():
    """8 A100 on NVSwitch: a latency floor of ~10 us for tiny messages (the tree with LL: NCCL base 6.8 us +
    6 hops x 0.6 us), and the ring's full bus bandwidth (300 GB/s x 0.78) for large ones."""
    node = parse_cluster("a100-80gb:1x8").node
    tiny = float(coll.all_reduce_s(8.0, 8, 8, node))
    assert tiny == pytest.approx(6.6e-6 + 6 * 3.4e-6 * 0.6 / 3.4 + 2 * 8 * 1.1 / 234e9 / 0.5, rel=1e-9)
    sizes = np.array([2.0**k for k in range(10, 34, 2)])
    times = coll.all_reduce_s(sizes, 8, 8, node)
    bus = 2 * 7 / 8 * sizes / times
    assert np.all(np.diff(bus) > 0)  # nccl-tests: bus bandwidth rises with the message size
    assert bus[-1] == pytest.approx(234e9, rel=0.01)
    assert bus[5] < 0.6 * 234e9  # 4 MiB: still well short of the peak
    # the Simple protocol for a 1 GiB ring: base 8.4 us + 14 hops x 3.4 us + bytes at the full bus bandwidth
    big = 2.0**30
    assert float(coll.ring_all_reduce_s(big, 8, 8, node)) == pytest.approx(
        8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * big / 234e9, rel=1e-9)


def test_gloo_loopback_is_plain_alpha_beta():
    from dataclasses import replace

    node = parse_cluster("a100-80gb:1x8").node
    plain = replace(node, intra=replace(node.intra, nccl=False))
    assert float(coll.ring_all_reduce_s(1e6, 4, 4, plain)) == pytest.approx(
        6 * node.intra.alpha_s + 2 * 3 / 4 * 1e6 / node.intra.achieved_bytes_per_s, rel=1e-12)


def test_a_tiny_gemm_is_launch_bound():
    """A 64 x 64 x 64 GEMM is 0.5 MFLOP: nanoseconds of tensor-core work, but no kernel ends before its launch."""
    a100 = load_catalogue().devices["a100-80gb"]
    assert float(compute.gemm_s(64, 64, 64, a100, 312e12)) == a100.efficiency.kernel_overhead_s == 4e-6
    big = float(compute.gemm_s(8192, 8192, 8192, a100, 312e12))
    assert big > 100 * a100.efficiency.kernel_overhead_s  # the floor never touches real GEMMs


def _cli_json(*args: str):
    import json

    from typer.testing import CliRunner

    from ddlscope.cli import app

    result = CliRunner().invoke(app, [*args, "--json", "--db", "no-such-store.db"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


MOE_FLAGS = ("--hidden", "2048", "--heads", "16", "--layers", "8", "--seq", "8192", "--vocab", "32000",
             "--global-batch", "64", "--experts", "8", "--top-k", "2", "--expert-imbalance", "1.3")


def test_predict_and_plan_take_experts_and_context_parallel_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = _cli_json("predict", "--cluster", "h100:2x8", *MOE_FLAGS, "--ep", "4", "--cp", "2")
    assert p["parallel"]["ep"] == 4 and p["parallel"]["cp"] == 2 and p["parallel"]["dp"] == 8
    assert p["model"]["experts"] == 8 and p["model"]["expert_imbalance"] == 1.3
    assert p["breakdown_s"]["ep_all_to_all"] > 0
    low, high = p["range"]["step_time_s"]
    assert low < p["step_time_s"] < high
    parts = sum(v for k, v in p["breakdown_s"].items() if k != "recompute_included")
    assert parts == pytest.approx(p["step_time_s"], rel=1e-12)
    plan = _cli_json("plan", "--cluster", "h100:2x8", *MOE_FLAGS, "--top", "3")
    assert len(plan["top"]) == 3 and plan["evaluated"] > 1000
    for row in plan["top"]:
        q = row["parallel"]
        assert q["tp"] * q["cp"] * q["pp"] * q["dp"] == 16


def test_context_parallel_of_three_prices_a_third_of_the_tokens_exactly():
    model = ModelSpec(hidden=1024, heads=8, layers=4, seq=6144, vocab=32000, global_batch=6)
    cluster = parse_cluster("a100-80gb:1x6")
    cp3, _ = _one(model, cluster, cp=3, dp=2, micro_batch=3)
    cp1, _ = _one(model, cluster, cp=1, dp=6, micro_batch=1)
    assert float(cp3["compute_s"][0]) == pytest.approx(float(cp1["compute_s"][0]), rel=1e-12)


# ---------------------------------------------------------------------------- gradient accumulation
def test_every_micro_batch_adds_its_gradients_into_the_buffer():
    """6 bytes per parameter per micro-batch (read the fresh 16-bit gradient, read and write the buffer),
    on the whole replica at ZeRO 0 and on the rank's 1/dp shard at ZeRO 3."""
    model = ModelSpec(hidden=2048, heads=16, layers=8, seq=2048, vocab=51200, global_batch=64)
    cluster = parse_cluster("a100-80gb:1x8")
    bw = cluster.device.memory_bandwidth_bytes_per_s * cluster.device.efficiency.memory_fraction
    ddp = predict(model, ParallelSpec(dp=8, micro_batch=2, zero=0), cluster)
    assert ddp.micro_batches == 4
    assert ddp.breakdown_s["grad_accumulation"] == pytest.approx(4 * 6 * model.params / bw, rel=1e-9)
    fsdp = predict(model, ParallelSpec(dp=8, micro_batch=2, zero=3), cluster)
    assert fsdp.breakdown_s["grad_accumulation"] == pytest.approx(4 * 6 * model.params / 8 / bw, rel=1e-9)
    fused = predict(model, ParallelSpec(dp=8, micro_batch=2, zero=0, fused_grad_accumulation=True), cluster)
    assert fused.breakdown_s["grad_accumulation"] == 0.0  # the weight-gradient GEMM accumulates itself
    assert fused.step_time_s == pytest.approx(ddp.step_time_s - ddp.breakdown_s["grad_accumulation"], rel=1e-9)


# ---------------------------------------------------------------------------- NCCL's SMs during overlap
def test_an_overlapped_collective_takes_its_channels_sms_from_the_compute_beside_it(monkeypatch):
    # 16 of 132 SMs for the overlapped stretch: the shorter of the two
    assert float(coll.sm_contention_s(0.010, 0.050, 132)) == pytest.approx(0.010 * 16 / 132, rel=1e-12)
    assert float(coll.sm_contention_s(0.080, 0.050, 132)) == pytest.approx(0.050 * 16 / 132, rel=1e-12)
    assert float(coll.sm_contention_s(0.080, 0.050, 0)) == 0.0  # no SMs in the catalogue: not charged
    # FSDP on H100: the gathers and scatters hidden behind compute still cost the compute their SMs
    model = ModelSpec(hidden=5120, heads=40, layers=40, seq=2048, vocab=50368, global_batch=64)
    spec, cluster = ParallelSpec(dp=8, micro_batch=2, zero=3), parse_cluster("h100:1x8")
    with_channels = predict(model, spec, cluster).breakdown_s["zero_comm"]
    monkeypatch.setattr(coll, "NCCL_CHANNELS", 0)
    without = predict(model, spec, cluster).breakdown_s["zero_comm"]
    # per micro-batch: forward overlaps the gather, backward the gather + scatter (26 GB of bf16 weights, 7/8 of
    # it over NVLink each way): a few percent of a ~0.5 s micro-batch
    assert 0.020 < (with_channels - without) / 4 < 0.026


def test_unfused_attention_pays_megatrons_layout_copies(monkeypatch):
    """Forward: the context permute-copy (4 bytes per element of b s h/tp); backward: its gradient and the
    cat of the q, k, v gradients (16)."""
    a100 = load_catalogue().devices["a100-80gb"]
    model = ModelSpec(hidden=4096, heads=32, layers=1, seq=2048, vocab=1, global_batch=1, attention="unfused")
    forward, backward = compute.attention_core_times_s(model, 2, 4, a100, 312e12)
    monkeypatch.setattr(compute, "UNFUSED_LAYOUT_BYTES_FORWARD", 0)
    monkeypatch.setattr(compute, "UNFUSED_LAYOUT_BYTES_BACKWARD", 0)
    bare_f, bare_b = compute.attention_core_times_s(model, 2, 4, a100, 312e12)
    elements = 2 * 2048 * 4096 / 4
    bw = a100.memory_bandwidth_bytes_per_s * a100.efficiency.memory_fraction
    assert float(forward - bare_f) == pytest.approx(4 * elements / bw, rel=1e-9)
    assert float(backward - bare_b) == pytest.approx(16 * elements / bw, rel=1e-9)


def test_the_optimizer_step_moves_54_bytes_per_owned_parameter():
    """Megatron-LM's Float16Optimizer passes: 6 + 8 + 4 + 28 (Adam) + 6 + 2 bytes, on the whole replica at
    ZeRO 0 and on the rank's 1/dp share at ZeRO 1."""
    model = ModelSpec(hidden=2048, heads=16, layers=8, seq=2048, vocab=51200, global_batch=64)
    cluster = parse_cluster("a100-80gb:1x8")
    bw = cluster.device.memory_bandwidth_bytes_per_s * cluster.device.efficiency.memory_fraction
    zero0 = predict(model, ParallelSpec(dp=8, micro_batch=2, zero=0), cluster)
    assert zero0.breakdown_s["optimizer"] == pytest.approx(54 * model.params / bw, rel=1e-9)
    zero1 = predict(model, ParallelSpec(dp=8, micro_batch=2, zero=1), cluster)
    assert zero1.breakdown_s["optimizer"] == pytest.approx(54 * model.params / 8 / bw, rel=1e-9)


def test_pipeline_sends_scatter_over_tp_and_regather_unless_sequence_parallel():
    """Each tp rank sends 1/tp of the activation; the receivers all-gather it back (not with SP)."""
    model = ModelSpec(hidden=4096, heads=32, layers=8, seq=2048, vocab=51200, global_batch=16)
    cluster = parse_cluster("a100-80gb:2x8")
    act = 2048 * 4096 * 2  # micro-batch 1
    send = float(coll.p2p_s(act / 8, True, cluster.node))  # stage 2 is on the other node
    gather = float(coll.all_gather_s(act, 8, 8, cluster.node))
    plain = predict(model, ParallelSpec(tp=8, pp=2, micro_batch=1, recompute="full"), cluster)
    assert plain.breakdown_s["pp_p2p"] == pytest.approx(16 * 2 * (send + gather), rel=1e-9)
    sp = predict(model, ParallelSpec(tp=8, pp=2, micro_batch=1, recompute="full", sequence_parallel=True), cluster)
    assert sp.breakdown_s["pp_p2p"] == pytest.approx(16 * 2 * send, rel=1e-9)


def test_the_stack_range_reaches_from_the_fast_kernels_down_to_the_slowest_published_share():
    cluster = parse_cluster("a100-80gb:8x8")
    p = predict(GPT_13B, ParallelSpec(tp=2, dp=32, micro_batch=4, recompute="selective"), cluster)
    share = load_catalogue().published_share_low
    assert 0.5 < share < 0.7  # MPT-13B's 39.6% MFU against 67.5% predicted (benchmarks/published_runs.py)
    assert p.stack_range["step_time_s"] == pytest.approx([p.range["step_time_s"][0], p.step_time_s / share])
    assert p.stack_range["tflops_per_gpu"] == pytest.approx([p.tflops_per_gpu * share, p.range["tflops_per_gpu"][1]])
    assert p.stack_range["mfu"] == pytest.approx([p.mfu * share, p.range["mfu"][1]])
    assert p.to_dict()["stack_range"] == p.stack_range  # what `predict --json` prints


def test_a_catalogue_without_validation_gives_no_stack_range():
    import dataclasses

    bare = dataclasses.replace(load_catalogue(), published_share_low=None)
    from ddlscope.predict.catalogue import make_cluster

    p = predict(GPT_13B, ParallelSpec(tp=2, dp=32, micro_batch=4), make_cluster("a100-80gb", 8, 8, bare))
    assert p.range and p.stack_range == {}
