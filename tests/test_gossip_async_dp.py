"""`gossip`'s asynchronous mode and differential privacy (PAPERS.md item 11, A(DP)^2SGD).

In-process: the privacy accountant (dp-accounting's), DP-SGD's clipping and noise, per-sample gradients,
the bad knobs, and the summary / `show` of a strategy's metrics. One 2-rank launch: async gossip under a
2x straggler finishes, the fast rank is not held to the straggler's pace (it mixes far fewer of the
straggler's models than it takes steps, and stale ones), the models stay close; noise 0 is the plain
run exactly; a private run reports its epsilon.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from ddlscope.specs.privacy import dp_sgd_epsilon


# ---------------------------------------------------------------------------------------------- accountant
def test_epsilon_is_dp_accountings_rdp_value_and_close_to_its_pld_one():
    from dp_accounting import dp_event, pld

    epsilon = dp_sgd_epsilon(0.01, 1.1, 1000, 1e-5)
    assert epsilon == pytest.approx(1.7117701662429012, rel=1e-9)  # dp-accounting 0.6.0's RDP accountant
    # The PLD accountant (another method, tighter) on the same mechanism: a little below, not far
    tighter = pld.PLDAccountant(value_discretization_interval=1e-3)  # coarser than its default: 5x faster
    tighter.compose(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1)), 1000)
    assert tighter.get_epsilon(1e-5) < epsilon < 1.25 * tighter.get_epsilon(1e-5)


def test_epsilon_falls_as_noise_grows_and_rises_with_steps_and_sampling():
    noises = [0.6, 0.8, 1.0, 1.5, 3.0]
    epsilons = [dp_sgd_epsilon(64 / 1437, s, 30, 1e-5) for s in noises]
    assert all(a > b for a, b in zip(epsilons, epsilons[1:])), epsilons
    assert 0.1 < epsilons[-1] < epsilons[0] < 100
    assert dp_sgd_epsilon(0.05, 1.0, 60, 1e-5) > dp_sgd_epsilon(0.05, 1.0, 30, 1e-5)
    assert dp_sgd_epsilon(0.10, 1.0, 30, 1e-5) > dp_sgd_epsilon(0.05, 1.0, 30, 1e-5)
    assert dp_sgd_epsilon(0.05, 1.0, 30, 1e-3) < dp_sgd_epsilon(0.05, 1.0, 30, 1e-5)
    assert dp_sgd_epsilon(0.05, 0.0, 30, 1e-5) == math.inf  # no noise: no privacy
    for bad in ((0.0, 1.0, 30, 1e-5), (0.05, 1.0, 30, 1.0), (0.05, 1.0, 30, 0.0)):
        with pytest.raises(ValueError):
            dp_sgd_epsilon(*bad)


# ---------------------------------------------------------------------------------------------- DP-SGD
def test_clipping_bounds_each_sample_and_so_the_shared_update():
    from ddlscope.strategies.gossip import clipped_noisy_mean

    per_sample = {"w": torch.randn(8, 5, 3) * 10, "b": torch.randn(8, 3) * 10}  # norms far above the clip
    mean = clipped_noisy_mean(per_sample, 0.5, 0.0, torch.Generator().manual_seed(0))
    norm = torch.cat([mean["w"].flatten(), mean["b"].flatten()]).norm().item()
    assert 0.05 < norm <= 0.5 + 1e-6
    # Every sample clipped to exactly the clip norm: the mean of 8 equal vectors has it too
    same = {"w": torch.ones(8, 2) * 3.0}
    assert clipped_noisy_mean(same, 0.5, 0.0, torch.Generator())["w"].norm().item() == pytest.approx(0.5)
    # Samples inside the clip norm are left alone: the plain mean
    small = {"w": torch.randn(6, 4) * 1e-3}
    torch.testing.assert_close(clipped_noisy_mean(small, 1.0, 0.0, torch.Generator())["w"], small["w"].mean(0))


def test_noise_has_std_multiplier_times_clip_over_batch():
    from ddlscope.strategies.gossip import clipped_noisy_mean

    zeros = {"w": torch.zeros(4, 200_000)}
    noisy = clipped_noisy_mean(zeros, 0.5, 2.0, torch.Generator().manual_seed(1))["w"]
    assert noisy.mean().abs().item() < 0.01
    assert noisy.std().item() == pytest.approx(2.0 * 0.5 / 4, rel=0.02)


def test_per_sample_gradients_are_each_samples_own_and_average_to_the_batch_gradient():
    from ddlscope.strategies.gossip import per_sample_gradients

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    loss_fn = torch.nn.functional.cross_entropy
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    grads = per_sample_gradients(model, loss_fn, x, y)
    model.zero_grad()
    loss_fn(model(x[2:3]), y[2:3]).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name][2], p.grad)
    model.zero_grad()
    loss_fn(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].mean(0), p.grad)


# ---------------------------------------------------------------------------------------------- bad knobs
@pytest.mark.parametrize("setting, names", [
    ("strategy.dp_noise_multiplier=-1", "strategy.dp_noise_multiplier = -1"),
    ("strategy.dp_delta=1", "strategy.dp_delta = 1"),
    ("strategy.dp_delta=0", "strategy.dp_delta = 0"),
    ("strategy.dp_clip_norm=0", "strategy.dp_clip_norm = 0"),
    ("strategy.mode=lazy", "strategy.mode = 'lazy'"),
])
def test_bad_knob_is_one_line_and_exit_2(setting: str, names: str, tmp_path: Path, monkeypatch,
                                          capsys: pytest.CaptureFixture[str]):
    from ddlscope.cli import main

    monkeypatch.chdir(tmp_path)
    rc = main(["run", "--strategy", "gossip", "--set", setting])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], err
    assert "Traceback" not in out + err and not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- summary
def test_strategy_metrics_reach_the_summary_and_show(tmp_path: Path, monkeypatch, capsys):
    from ddlscope.analysis.summary import summarize
    from ddlscope.cli import main
    from ddlscope.store import Store
    from ddlscope.strategies.gossip import strategy_metric

    with Store(tmp_path / "s.db") as store:
        run_id = store.create_run(uuid="a" * 32, name="dp", workload="mlp-digits", strategy="gossip", world_size=2,
                                  config={"workload": {"name": "mlp-digits"}}, code_version="test", seed=0,
                                  environment={"cores": 2})
        kind, message = strategy_metric("privacy_epsilon", 2.5097, "at delta 1e-05")
        store.add_event(run_id, kind, message, rank=0)
        store.add_event(run_id, *strategy_metric("gossip_copies_mixed", 15, "rank 1: ...", rank=1), rank=1)
        metrics = summarize(store, store.get_run(run_id)).strategy_metrics
    assert [(m["name"], m["value"]) for m in metrics] == [("privacy_epsilon", 2.5097), ("gossip_copies_mixed", 15)]
    assert main(["show", str(run_id), "--db", str(tmp_path / "s.db")]) in (0, None)
    shown = capsys.readouterr().out
    assert "privacy_epsilon" in shown and "2.51" in shown and "at delta 1e-05" in shown


# ---------------------------------------------------------------------------------------------- 2 ranks
STEPS, DP_STEPS, DP_BATCH = 30, 8, 64
# The straggler's extra time is a multiple of the step's compute: enough compute (256 x 512-wide MLP) that
# it dwarfs the milliseconds of a message and of thread switches on a loaded machine.
ASYNC = {"workload.steps": STEPS, "workload.batch_size": 256, "workload.hidden": 512, "strategy.name": "gossip"}
DP = {"workload.steps": DP_STEPS, "workload.batch_size": DP_BATCH, "strategy.name": "gossip"}
CONFIGS = {
    "plain": {**DP},
    "noise-0": {**DP, "strategy.dp_noise_multiplier": 0.0, "strategy.dp_clip_norm": 0.01},
    "private": {**DP, "strategy.dp_noise_multiplier": 1.0, "strategy.dp_clip_norm": 1.0},
    "async-straggler": {**ASYNC, "strategy.mode": "async", "cluster.slowdown": [1.0, 2.0]},
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, dict], Path]:
    from ddlscope.runtime.launcher import launch_processes
    from test_dataparallel_equivalence import train_all

    out = tmp_path_factory.mktemp("gossip-async-dp")
    return launch_processes(train_all, (str(out), CONFIGS, 2), 2, run_id=f"gossip-adp-{os.getpid()}"), out


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over all parameters."""
    diff = torch.cat([(a[k] - b[k]).flatten() for k in a])
    return (diff.norm() / torch.cat([a[k].flatten() for k in a]).norm()).item()


def _metrics(out: Path, label: str, rank: int) -> dict[str, dict]:
    from ddlscope.runtime.rows import read_records

    return {m["name"]: m for r in read_records(out / f"{label}-{rank}.jsonl")
            if r.get("kind") == "event" and r.get("event") == "strategy_metric"
            for m in [json.loads(r["message"])]}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_async_gossip_under_a_straggler_finishes_without_waiting_for_it(launched):
    from test_dataparallel_equivalence import max_difference

    results, out = launched
    rows = {rank: results[rank]["rows"]["async-straggler"] for rank in (0, 1)}
    assert [len(rows[0]), len(rows[1])] == [STEPS, STEPS]  # every rank did its steps: no deadlock
    fast, slow = _metrics(out, "async-straggler", 0), _metrics(out, "async-straggler", 1)
    # Synchronous gossip mixes the neighbour's model every step (STEPS copies); the fast rank did not wait
    # for the straggler's: about half as many of them, and stale (the straggler behind it by steps).
    assert 1 <= fast["gossip_copies_mixed"]["by_peer"]["1"] <= 0.8 * STEPS, fast
    assert fast["gossip_mean_staleness_steps"]["value"] > 1, fast
    assert slow["gossip_mean_staleness_steps"]["value"] < 0, slow  # the fast rank's copies are ahead
    # Consensus: the two models stay close (mixing works), though not equal (asynchrony); both learned
    final = {rank: results[rank]["models"]["async-straggler"] for rank in (0, 1)}
    apart = relative_distance(final[0], final[1])
    assert 1e-6 < apart < 0.2, apart
    # Mixing keeps the copies a worker meets close to its own (0.5-0.8% apart here; 3.5% with the mix skipped)
    assert all(0 < m["gossip_consensus_distance"]["value"] < 0.02 for m in (fast, slow)), (fast, slow)
    assert all(r[-1]["loss"] < 0.9 * r[0]["loss"] for r in rows.values())
    assert "privacy_epsilon" not in fast


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_noise_zero_is_the_plain_run_and_a_private_run_reports_its_epsilon(launched):
    from test_dataparallel_equivalence import max_difference

    results, out = launched
    models = results[0]["models"]
    assert max_difference(models["noise-0"], models["plain"]) < 1e-6  # no clipping either: exactly plain
    assert _metrics(out, "noise-0", 0) == {}  # not private: no epsilon reported (rather than infinity)
    assert 1e-3 < max_difference(models["private"], models["plain"])
    assert all(torch.isfinite(t).all() for t in models["private"].values())
    epsilon = _metrics(out, "private", 0)["privacy_epsilon"]
    train_samples = 1437  # mlp-digits' training split (of 1797)
    assert epsilon["value"] == pytest.approx(dp_sgd_epsilon(DP_BATCH / train_samples, 1.0, DP_STEPS, 1e-5), rel=1e-9)
    assert "privacy_epsilon" not in _metrics(out, "private", 1)  # said once, by rank 0
    # sync gossip: one model to the one neighbour each step, whatever the privacy
    plain_bytes = [r["bytes_sent"] for r in results[1]["rows"]["plain"]]
    assert plain_bytes == [r["bytes_sent"] for r in results[1]["rows"]["private"]] and plain_bytes[0] > 0


# ---------------------------------------------------------------------------------------------- estimator
def test_async_estimate_lets_a_straggler_slow_only_itself_and_dp_costs_compute_and_memory():
    from test_dataparallel_units import _cluster_estimate

    from ddlscope.specs.strategies.gossip import GossipSpec

    sync, mem = _cluster_estimate(GossipSpec(topology="ring"))
    asyn, _ = _cluster_estimate(GossipSpec(topology="ring", mode="async"))
    sync_slow, _ = _cluster_estimate(GossipSpec(topology="ring"), slowdowns=[2.0])
    async_slow, _ = _cluster_estimate(GossipSpec(topology="ring", mode="async"), slowdowns=[2.0])
    # Evenly paced: async hides the messages behind the next step's compute, sync waits for them
    assert asyn.compute_s == pytest.approx(sync.compute_s)
    assert asyn.step_s == pytest.approx(asyn.compute_s + max(0.0, asyn.comm_s - asyn.compute_s), rel=1e-9)
    assert sync.step_s == pytest.approx(sync.compute_s + sync.comm_s, rel=1e-9)
    assert asyn.mean_staleness_steps == 0.0
    # A 2x straggler among 32: sync runs everybody at its pace (one more compute time), async loses only
    # the straggler's half of its own steps
    assert sync_slow.step_s - sync.step_s == pytest.approx(sync.compute_s, rel=1e-9)
    c, comm = asyn.compute_s, asyn.comm_s
    assert comm < c  # resnet50 on A100s: the ring's messages hide behind a step
    rate = 31 / c + 1 / (2 * c)  # steps per second of the 32 workers
    assert async_slow.samples_per_s == pytest.approx(rate * 32, rel=1e-9)  # 32 samples per worker step
    assert async_slow.samples_per_s > 0.95 * asyn.samples_per_s > sync_slow.samples_per_s
    assert 0 < async_slow.mean_staleness_steps < 1
    private, mem_private = _cluster_estimate(GossipSpec(topology="ring", dp_noise_multiplier=1.0))
    assert private.compute_s == pytest.approx(sync.compute_s * 4 / 3, rel=1e-9)
    assert mem_private - mem == pytest.approx(32 * 4.0 * image_params(), rel=1e-6)  # batch 32 per-sample copies


def image_params() -> float:
    from test_dataparallel_units import image_params as params

    return params()


def test_local_estimate_of_async_adds_no_sync_wait_and_dp_one_more_forward():
    from test_regression_numbers import FACTS, PROFILE

    from ddlscope.predict.local import predict_local

    def predicted(**strategy):
        config = {"workload": {"name": "mlp-digits"}, "strategy": {"name": "gossip", **strategy},
                  "cluster": {"world_size": 2}}
        return predict_local(config, {}, FACTS, PROFILE)

    sync, asyn, private = predicted(), predicted(mode="async"), predicted(dp_noise_multiplier=1.0)
    assert asyn["breakdown_s"]["comm_wait_s"] < sync["breakdown_s"]["comm_wait_s"]
    assert asyn["breakdown_s"]["forward_s"] == pytest.approx(sync["breakdown_s"]["forward_s"], rel=1e-9)
    compute = {name: p["breakdown_s"]["forward_s"] + p["breakdown_s"]["backward_s"] for name, p in
               (("sync", sync), ("private", private))}
    assert compute["private"] == pytest.approx(compute["sync"] * 4 / 3, rel=1e-9)
