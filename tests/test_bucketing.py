"""MG-WFBP's bucket planner (specs/bucketing.py): optimal against a brute force over every split,
the timeline's exact values, and the baselines it is compared with. Then the estimators: DDP's bucket plans
and compression hooks at cluster scale and on this machine, the slow-network knob advice, localsgd's
compressed average."""

import itertools
import random

import pytest

from test_predict_local import FACTS, PROFILE, _config

from ddlscope.predict.catalogue import make_cluster
from ddlscope.predict.estimators import ClusterCase, estimator_for
from ddlscope.predict.estimators.base import KNOB_NOTE_PREFIX
from ddlscope.predict.estimators.ddp import cluster_plan
from ddlscope.predict.local import predict_local
from ddlscope.predict.strategies import ServerSpec, image_workload
from ddlscope.specs.bucketing import AlphaBeta, Layer, optimal_plan, per_layer_plan, simulate, size_plan
from ddlscope.specs.strategies.ddp import DDPSpec
from ddlscope.specs.strategies.localsgd import LocalSGDSpec


def _all_splits(n: int):
    """Every contiguous split of n layers: 2^(n-1) of them."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        buckets, start = [], 0
        for i, cut in enumerate(cuts):
            if cut:
                buckets.append((start, i))
                start = i + 1
        buckets.append((start, n - 1))
        yield buckets


def _random_case(seed: int):
    rng = random.Random(seed)
    layers = [Layer(f"l{i}", rng.uniform(0, 0.02), rng.randrange(0, 4_000_000)) for i in range(rng.randint(1, 9))]
    link = AlphaBeta(rng.choice([0.0, 1e-4, 5e-3, 3e-2]), rng.choice([1e-10, 1e-9, 1e-8]))
    return layers, link


@pytest.mark.parametrize("seed", range(60))
def test_optimal_plan_matches_brute_force(seed):
    layers, link = _random_case(seed)
    best = min(simulate(layers, split, link).finish_s for split in _all_splits(len(layers)))
    plan = optimal_plan(layers, link)
    assert plan.finish_s == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert [b for s, e in plan.buckets for b in range(s, e + 1)] == list(range(len(layers)))  # a split of all
    assert plan.exposed_s <= per_layer_plan(layers, link).exposed_s + 1e-15
    assert plan.exposed_s <= size_plan(layers, link, 25 * 2**20).exposed_s + 1e-15


def test_timeline_exact_values():
    """Three layers of 10 ms backward, 1 MB each, alpha 5 ms, 1 ns/byte (1 ms a MB)."""
    layers = [Layer(n, 0.010, 1_000_000) for n in "abc"]
    link = AlphaBeta(0.005, 1e-9)
    per_layer = per_layer_plan(layers, link)  # 10+6=16, max(20,16)+6=26, max(30,26)+6=36
    assert per_layer.finish_s == pytest.approx(0.036) and per_layer.exposed_s == pytest.approx(0.006)
    one = simulate(layers, [(0, 2)], link)  # 30 + 5 + 3
    assert one.exposed_s == pytest.approx(0.008)
    # merging only pays when alpha is large against the backward gaps: here one per layer is already best
    assert optimal_plan(layers, link).buckets == ((0, 0), (1, 1), (2, 2))


def test_high_latency_merges_and_zero_latency_does_not():
    layers = [Layer(f"l{i}", 0.001, 100_000) for i in range(8)]
    merged = optimal_plan(layers, AlphaBeta(0.05, 1e-9))
    assert len(merged.buckets) < 8
    # with no latency, a bucket per layer starts every byte as early as possible: never worse
    free = optimal_plan(layers, AlphaBeta(0.0, 1e-8))
    assert free.exposed_s == pytest.approx(per_layer_plan(layers, AlphaBeta(0.0, 1e-8)).exposed_s)


def test_size_plan_closes_a_bucket_once_it_is_full():
    layers = [Layer("a", 0.01, 3), Layer("b", 0.01, 3), Layer("c", 0.01, 3), Layer("d", 0.01, 1)]
    assert size_plan(layers, AlphaBeta(0, 0), 5).buckets == ((0, 1), (2, 3))
    assert size_plan(layers, AlphaBeta(0, 0), 5).bucket_bytes() == [6, 4]


def test_negative_inputs_are_refused():
    with pytest.raises(ValueError, match="alpha_s"):
        optimal_plan([Layer("a", 0.1, 1)], AlphaBeta(-1.0, 0.0))
    with pytest.raises(ValueError, match="'a'"):
        optimal_plan([Layer("a", -0.1, 1)], AlphaBeta(0.0, 0.0))


# ---------------------------------------------------------------------------- the DDP estimator
def _vgg16_case(cluster):
    """VGG-16, 32 images a GPU, on `cluster`: a model whose gradients cost (138 M parameters)."""
    return ClusterCase(workload=image_workload("vgg16", batch_per_worker=32), cluster=cluster, stragglers=1.0,
                       slowdowns=None, server=ServerSpec(), activation_bytes=1e9, weight_bytes_per_param=4.0,
                       optimizer_bytes_per_param=8.0)


def _ddp_estimate(cluster_name: str = "a100-80gb", nodes: int = 4, **knobs):
    spec = DDPSpec(**knobs)
    case = _vgg16_case(make_cluster(cluster_name, nodes, 8))
    plan = cluster_plan(spec, case) if spec.buckets != "size" else None
    return estimator_for(spec).cluster(spec, case), plan


def test_the_estimator_prices_the_plan_it_chooses():
    size, _ = _ddp_estimate()
    optimal, plan = _ddp_estimate(buckets="mgwfbp")
    per_layer, per_layer_plan_ = _ddp_estimate(buckets="per_layer")
    assert optimal.exposed_comm_s == pytest.approx(plan.exposed_s)  # the same model chooses and predicts
    assert optimal.exposed_comm_s <= per_layer.exposed_comm_s
    assert optimal.compute_s == size.compute_s == per_layer.compute_s
    assert optimal.step_s == pytest.approx(size.step_s - size.exposed_comm_s + plan.exposed_s)
    assert len(per_layer_plan_.buckets) == len(plan.layers)


def test_the_estimator_prices_compression_bytes_and_codec_compute():
    plain, _ = _ddp_estimate()
    half = {hook: _ddp_estimate(comm_hook=hook)[0] for hook in ("fp16", "bf16")}
    assert half["fp16"].comm_s == pytest.approx(plain.comm_s / 2, rel=0.05)
    assert half["bf16"].step_s == pytest.approx(half["fp16"].step_s)
    assert half["fp16"].compute_s > plain.compute_s  # the casts cost a pass over the gradients
    qsgd2, qsgd8 = _ddp_estimate(comm_hook="qsgd", qsgd_levels=1)[0], _ddp_estimate(comm_hook="qsgd", qsgd_levels=100)[0]
    minmax = _ddp_estimate(comm_hook="minmax8")[0]
    assert qsgd8.comm_s == pytest.approx(minmax.comm_s, rel=0.02)  # both 8 bits an entry (+ QSGD's norms)
    assert qsgd2.comm_s == pytest.approx(qsgd8.comm_s / 4, rel=0.05)  # 2 bits instead of 8
    # decoding every rank's message grows with the ranks: at 512 GPUs the gathered codes cost more compute
    big = _ddp_estimate(nodes=64, comm_hook="minmax8")[0]
    assert big.compute_s - plain.compute_s > minmax.compute_s - plain.compute_s


def test_on_a_slow_network_the_ddp_estimate_notes_what_compression_and_buckets_would_give():
    def notes(cluster):
        case = _vgg16_case(cluster)
        est = estimator_for(DDPSpec()).cluster(DDPSpec(), case)
        return est, [n for n in estimator_for(DDPSpec()).cluster_notes(DDPSpec(), case) if n.startswith(KNOB_NOTE_PREFIX)]

    slow_est, slow = notes(make_cluster("a10g", 4, 4))
    assert slow_est.exposed_comm_s > 0.1 * slow_est.compute_s and len(slow) == 1
    listed = [float(part.rsplit(" ", 2)[-2]) for part in slow[0].split(": ", 2)[2].split("; ")[:8]]
    assert listed == sorted(listed) and len(listed) == 8  # every hook and plan, the fastest first
    assert "comm_hook=fp16" in slow[0] and "buckets=mgwfbp" in slow[0]
    fast_est, fast = notes(make_cluster("h100", 1, 2))
    assert (fast_est.exposed_comm_s <= 0.1 * fast_est.compute_s) == (fast == [])


def test_localsgd_compressed_average_is_priced_at_half_the_bytes():
    case = _vgg16_case(make_cluster("a10g", 4, 4))
    plain = estimator_for(LocalSGDSpec(period=2)).cluster(LocalSGDSpec(period=2), case)
    half = estimator_for(LocalSGDSpec(period=2)).cluster(LocalSGDSpec(period=2, compression="bf16"), case)
    assert 0.45 < half.comm_s / plain.comm_s < 0.55  # bandwidth-bound: half the bytes, about half the time
    assert half.step_s == pytest.approx(plain.step_s - (plain.exposed_comm_s - half.exposed_comm_s))
    with pytest.raises(ValueError, match="compression"):
        LocalSGDSpec(period=4, group_period=2, compression="fp16")


def test_the_local_predictor_sends_the_hooks_bytes_over_the_emulated_link():
    emulated = {"network": {"emulated": True, "alpha_s": 5e-3, "bandwidth_bytes_per_s": 1e6}}

    def comm_s(world: int = 2, **knobs) -> float:
        return predict_local(_config("ddp", world, **knobs), emulated, FACTS, PROFILE)["breakdown_s"]["comm_wait_s"]

    plain, half = comm_s(), comm_s(comm_hook="bf16")
    # 2 ranks: the all-reduce's wire bytes are its payload, so bf16 saves half the gradient's bytes at 1 MB/s
    saved_s = FACTS["param_bytes"] / 2 / 1e6
    assert plain - half == pytest.approx(saved_s, rel=0.05)
    # top-k 10% at 4 ranks: 20% of the bytes, all-gathered (3 messages received: 0.6 of the gradient's bytes
    # on the wire) against the all-reduce's 1.5, plus its codec passes
    topk = comm_s(4, comm_hook="topk", topk_ratio=0.1)
    assert comm_s(4) - topk == pytest.approx(FACTS["param_bytes"] * (1.5 - 0.6) / 1e6, rel=0.05)
