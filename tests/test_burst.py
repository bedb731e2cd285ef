"""Burst parallelism (predict/burst.py): the per-unit costs, the dynamic programme against brute force,
and `ddlscope plan --burst`."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from ddlscope import cli
from ddlscope.predict import cnn
from ddlscope.predict.burst import BurstCosts, best_plan, burst, burst_costs, degree_runs, degrees_for
from ddlscope.predict.catalogue import make_cluster


def brute_force(costs: BurstCosts, weight: float) -> tuple[float, np.ndarray]:
    """The least step + weight x busy / N over every assignment of degrees to units."""
    best, arg = np.inf, None
    for choice in itertools.product(range(len(costs.degrees)), repeat=costs.unit_s.shape[0]):
        step, busy = costs.step_and_busy(np.array(choice))
        value = step + weight * busy / costs.gpus
        if value < best:
            best, arg = value, np.array(choice)
    return best, arg


def objective(costs: BurstCosts, choice: np.ndarray, weight: float) -> float:
    step, busy = costs.step_and_busy(choice)
    return step + weight * busy / costs.gpus


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("weight", [0.0, 0.3, 2.0])
def test_dynamic_programme_finds_the_brute_force_optimum_on_random_costs(seed: int, weight: float):
    rng = np.random.default_rng(seed)
    units, degrees = 5, np.array([1, 2, 4])
    switch = rng.random((units, 3, 3)) * 0.5
    switch[:, np.arange(3), np.arange(3)] = 0.0
    costs = BurstCosts(degrees, rng.random((units, 3)), switch, gpus=4)
    best, _ = brute_force(costs, weight)
    assert objective(costs, best_plan(costs, weight), weight) == pytest.approx(best, rel=1e-12)


def test_dynamic_programme_finds_the_brute_force_optimum_on_vgg16s_classifier_end():
    """The last five units of VGG16 (the last convolutions and the classifier), batch 32 on 16 GPUs."""
    full = burst_costs(cnn.CNNSpec("vgg16", 32), make_cluster("a100-80gb", 2, 8))
    costs = BurstCosts(full.degrees, full.unit_s[-5:], full.switch_s[-5:], full.gpus)
    for weight in (0.0, 1.0):
        best, arg = brute_force(costs, weight)
        choice = best_plan(costs, weight)
        assert objective(costs, choice, weight) == pytest.approx(best, rel=1e-12)
    assert costs.degrees[arg][-1] < 16  # the fully connected classifier does not take all 16 GPUs


def test_unit_costs_add_up_to_the_whole_network_and_degree_one_has_no_all_reduce():
    device = make_cluster("a100-80gb", 1, 8).device
    for name in cnn.CNN_MODELS:
        spec = cnn.CNNSpec(name, 64)
        forward, backward = cnn.unit_times_s(spec, [64, 8], device)
        total_f, total_b = cnn.layer_times_s(spec, np.array([64, 8]), device)
        np.testing.assert_allclose(forward.sum(0), total_f, rtol=1e-12)
        np.testing.assert_allclose(backward.sum(0), total_b, rtol=1e-12)
        assert cnn.unit_params(spec).sum() == cnn.counts(spec).params
    spec = cnn.CNNSpec("resnet50", 64)
    cluster = make_cluster("a100-80gb", 1, 8)
    costs = burst_costs(spec, cluster)
    assert costs.degrees.tolist() == [1, 2, 4, 8]
    forward, backward = cnn.unit_times_s(spec, [64], cluster.device)
    np.testing.assert_allclose(costs.unit_s[:, 0], (forward + backward)[:, 0], rtol=1e-12)
    assert np.all(costs.unit_s[:, 1:] > (lambda f, b: f + b)(*cnn.unit_times_s(spec, 64 / costs.degrees[1:],
                                                                                cluster.device)))
    diagonal = costs.switch_s[:, np.arange(4), np.arange(4)]
    assert not diagonal.any() and not costs.switch_s[0].any()
    np.testing.assert_allclose(costs.switch_s, costs.switch_s.transpose(0, 2, 1))  # a gather costs a scatter
    assert degrees_for(12, 8).tolist() == [1, 2, 4]
    # Into unit 3 from 8 GPUs to 4: each of the 4 receives the half of its 16 samples it does not hold, the
    # previous unit's output, forward and (its gradient) backward.
    from ddlscope.predict import collectives as coll

    out_bytes = cnn.unit_output_elements(spec)[2] * spec.activation_bytes
    expected = 2 * coll.p2p_s(64 / 4 * 0.5 * out_bytes, False, cluster.node)
    assert costs.switch_s[3, 3, 2] == pytest.approx(float(expected), rel=1e-12)
    sync = coll.all_reduce_s(cnn.unit_params(spec)[3] * 4.0, 8, 8, cluster.node)
    assert costs.unit_s[3, 3] == pytest.approx(float(sum(cnn.unit_times_s(spec, [8], cluster.device))[3, 0] + sync),
                                               rel=1e-12)


def test_burst_plans_against_uniform_data_parallelism():
    result = burst(cnn.CNNSpec("vgg16", 64), make_cluster("a100-80gb", 4, 8))
    uniform, fastest, best = result.uniform, result.fastest, result.best_cluster
    assert uniform.degrees == [32] * result.units and uniform.freed_fraction == pytest.approx(0.0, abs=1e-12)
    assert uniform.cluster_throughput == pytest.approx(1.0, abs=1e-12)
    # The fully connected layers at 2 samples per GPU: fewer GPUs win (DeepPool reports 1.2-2.3x).
    assert 1.2 < fastest.speedup_vs_uniform < 3.0 and fastest.degrees[-1] < 32
    assert best.step_s <= uniform.step_s and best.cluster_throughput >= fastest.cluster_throughput
    assert best.cluster_throughput == pytest.approx(best.speedup_vs_uniform + best.freed_fraction, rel=1e-12)
    half = burst(cnn.CNNSpec("vgg16", 64), make_cluster("a100-80gb", 4, 8), background_efficiency=0.5)
    assert half.best_cluster.cluster_throughput < best.cluster_throughput
    assert result.ddp_step_s is not None and result.ddp_step_s < uniform.step_s  # DDP overlaps its all-reduce
    assert degree_runs([8, 8, 8, 2, 1, 1]) == "units 0-2: 8, unit 3: 2, units 4-5: 1"


def test_plan_burst_on_the_command_line(capsys):
    args = ["plan", "--model", "vgg16", "--global-batch", "64", "--cluster", "a100-80gb:2x8", "--burst"]
    assert cli.main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["uniform"]["degrees"] == [16] * out["units"] and out["fastest"]["step_s"] < out["uniform"]["step_s"]
    assert cli.main(args) == 0
    assert "cluster throughput" in capsys.readouterr().out
    code = cli.main(["plan", "--cluster", "a100-80gb:1x8", "--burst", "--hidden", "512", "--heads", "8", "--layers",
                     "2", "--seq", "128", "--vocab", "100", "--global-batch", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "CNN" in err and len(err.strip().splitlines()) == 1
    assert cli.main(args + ["--background-efficiency", "1.5"]) == 2
