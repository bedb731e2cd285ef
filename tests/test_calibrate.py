"""ddlscope calibrate: the alpha-beta fit, the profile file, the command."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from ddlscope.calibrate import fit_alpha_beta, fit_matmul, load_profile, message_sizes, to_toml, write_profile
from ddlscope.specs import ConfigError


def test_fit_recovers_alpha_beta_from_clean_data():
    sizes = np.array(message_sizes(quick=False), dtype=float)
    alpha, beta = 150e-6, 800e6
    fit = fit_alpha_beta(sizes, alpha + sizes / beta)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta_bytes_per_s"] == pytest.approx(beta, rel=1e-6)
    assert fit["r2"] == pytest.approx(1.0) and fit["r2_all"] == pytest.approx(1.0)


def test_fit_is_robust_to_small_size_noise():
    """Noisy small messages must not drag beta; alpha comes from the small sizes' median."""
    rng = np.random.default_rng(0)
    sizes = np.array(message_sizes(quick=False), dtype=float)
    alpha, beta = 300e-6, 500e6
    times = (alpha + sizes / beta) * (1 + 0.03 * rng.standard_normal(len(sizes)))
    times[sizes <= 16 * 1024] += rng.uniform(0, 60e-6, int((sizes <= 16 * 1024).sum()))  # scheduler wake-ups
    fit = fit_alpha_beta(sizes, times)
    assert fit["beta_bytes_per_s"] == pytest.approx(beta, rel=0.1)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=0.25)
    assert fit["r2"] >= 0.95


def test_fit_falls_back_to_plain_least_squares_with_few_sizes():
    sizes = np.array([1e3, 2e3, 4e3])
    fit = fit_alpha_beta(sizes, 1e-4 + sizes / 1e9)
    assert fit["alpha_s"] == pytest.approx(1e-4, rel=1e-6)
    assert fit["beta_bytes_per_s"] == pytest.approx(1e9, rel=1e-6)


def test_matmul_fit_recovers_overhead_and_peak():
    sizes = [64, 128, 256, 512]
    fit = fit_matmul(sizes, [5e-6 + 2 * n**3 / 1e11 for n in sizes])
    assert fit["peak_flops"] == pytest.approx(1e11, rel=1e-6)
    assert fit["overhead_s"] == pytest.approx(5e-6, rel=1e-4)


def test_profile_round_trips_through_toml(tmp_path: Path):
    profile = {"meta": {"quick": True, "host": "h"}, "compute": {"peak_flops": 1.5e11, "matmul": {"sizes": [64]}},
               "collectives": {"ws2": {"all_reduce": {"alpha_s": 1e-4, "beta_bytes_per_s": 8e8, "r2": 0.99}}}}
    path = tmp_path / "p.toml"
    write_profile(profile, path)
    assert tomllib.loads(path.read_text()) == profile
    assert load_profile(path) == profile
    assert "[collectives.ws2.all_reduce]" in to_toml(profile)


def test_the_typed_profile_gives_back_the_dict_it_read(tmp_path: Path):
    """CalibrationProfile types every table calibrate writes, keeps what it does not declare, and
    leaves ints ints: a profile dumps back to exactly the dict the local predictor reads."""
    from test_regression_numbers import PROFILE

    from ddlscope.calibrate import CalibrationProfile

    profile = {**PROFILE, "meta": {"host": "h", "cores": 2, "quick": False, "from_the_future": "kept"}}
    path = tmp_path / "p.toml"
    write_profile(profile, path)
    loaded = CalibrationProfile.load(path)
    assert loaded.as_dict() == profile == load_profile(path)
    assert loaded.compute.peak_flops == 1e11 and loaded.meta is not None and loaded.meta.cores == 2
    assert isinstance(loaded.as_dict()["meta"]["cores"], int)
    assert loaded.ps is not None and loaded.ps["ws3"].busy_round_s == [[4e-3, 1.2e-2], [6e-3, 1.6e-2]]
    loaded.write(tmp_path / "again.toml")  # tables in the declared order, the same content
    assert load_profile(tmp_path / "again.toml") == profile


def test_an_ill_typed_profile_is_one_line_naming_the_field(tmp_path: Path):
    path = tmp_path / "p.toml"
    path.write_text('[compute]\npeak_flops = "fast"\n[collectives.ws2.all_reduce]\nalpha_s = 1e-4\n')
    with pytest.raises(ConfigError, match=r"compute\.peak_flops: .*expected a number"):
        load_profile(path)
    path.write_text("[compute]\n[collectives.two.all_reduce]\nalpha_s = 1e-4\n")
    with pytest.raises(ConfigError, match="collectives.two"):
        load_profile(path)


def test_load_profile_errors_are_one_line(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("x = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_profile(bad)


def _cli(tmp_path: Path, *args: str):
    """The CLI in this process (conftest.run_cli_here): calibrate's ranks come from the reused fork server."""
    from conftest import run_cli_here

    return run_cli_here(*args, cwd=tmp_path)


def test_bad_world_sizes_are_a_one_line_error(tmp_path: Path):
    proc = _cli(tmp_path, "calibrate", "--world-sizes", "1,x")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --world-sizes")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_calibrate_quick_writes_a_profile(tmp_path: Path):
    proc = _cli(tmp_path, "calibrate", "--world-sizes", "2", "--quick", "-o", "prof.toml", "--db", "s.db")
    assert proc.returncode == 0, proc.stderr
    assert "all_reduce" in proc.stdout and "R^2" in proc.stdout
    profile = tomllib.loads((tmp_path / "prof.toml").read_text())
    assert load_profile(tmp_path / "prof.toml") == profile  # what calibrate writes, the typed profile reads
    from ddlscope.store import Store

    with Store(tmp_path / "s.db") as store:  # the store keeps the same profile
        calibration_id, stored = store.latest_calibration(profile["meta"]["host"])
    assert calibration_id == 1 and stored == profile
    assert profile["compute"]["peak_flops"] > 1e8
    assert profile["compute"]["memory_bandwidth_bytes_per_s"] > 1e8
    curve = profile["compute"]["memory_curve"]  # copy rates by size, the largest the bandwidth above
    assert curve["bytes_moved"] == sorted(curve["bytes_moved"]) and min(curve["bytes_per_s"]) > 1e8
    assert curve["bytes_per_s"][-1] == profile["compute"]["memory_bandwidth_bytes_per_s"]
    conv = profile["compute"]["conv"]  # convolutions by channel count; few channels vectorise worst
    assert conv["channels"] == sorted(conv["channels"]) and len(conv["flops"]) == len(conv["channels"])
    assert 1e8 < conv["flops"][0] < max(conv["flops"])
    entry = profile["collectives"]["ws2"]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p"):
        assert {"alpha_s", "beta_bytes_per_s", "r2", "r2_all", "sizes", "seconds"} <= set(entry[op])
        assert entry[op]["beta_bytes_per_s"] > 0 and entry[op]["alpha_s"] >= 0
        assert entry[op]["r2"] > 0.5  # the >= 0.95 figure is for the full calibration; quick has 3 repeats
    for op in ("all_reduce", "p2p"):  # the typical (median) repeat is never faster than the fastest
        typical, fastest = entry[op]["seconds"], entry[op]["fastest"]["seconds"]
        assert len(typical) == len(fastest) and all(t >= f for t, f in zip(typical, fastest))
    sync = profile["sync"]["ws2"]
    assert len(sync["compute_stretch"]) == len(sync["sync_overhead_s"]) == 2
    assert all(0.5 < s < 3 for s in sync["compute_stretch"]) and all(o >= 0 for o in sync["sync_overhead_s"])
    assert sync["block_alone_s"][1] > sync["block_alone_s"][0]  # two different block lengths
    fsdp = profile["fsdp"]["ws2"]
    assert len(fsdp["unit_bytes"]) == len(fsdp["unit_overhead_s"]) == 2  # quick: two unit sizes
    assert all(t > 0 for t in fsdp["unit_overhead_s"])  # fully_shard costs something per unit
    assert fsdp["unit_tensor_s"] >= 0  # per parameter tensor beyond a Linear's 2 in a unit
    # SGD on DTensor shards: every op through DTensor's dispatch, dearer per tensor than on plain tensors
    plain_tensor_s = profile["compute"]["optimizer_tensor_s"]
    assert 1.5 * plain_tensor_s < fsdp["optimizer_tensor_s"] < 1000 * plain_tensor_s
    ddp = profile["ddp"]["ws2"]
    assert ddp["model_bytes"][1] > ddp["model_bytes"][0] and all(t > 0 for t in ddp["overhead_s"])
    ps = profile["ps"]["ws2"]  # one worker and its server
    assert ps["workers"] == 1 and len(ps["round_s"]) == len(ps["bytes"]) == 2 and all(t > 0 for t in ps["round_s"])
    assert ps["block_alone_s"][1] > ps["block_alone_s"][0] > 0
    assert len(ps["busy_round_s"]) == 2 and all(len(r) == 2 and min(r) > 0 for r in ps["busy_round_s"])
    assert all(0.5 < busy / alone < 3 for busy, alone in zip(ps["busy_block_s"], ps["block_alone_s"]))
    tp = profile["tp"]["ws2"]  # the trace of one tp-split GPT block: Megatron's 4 activation all-reduces
    assert tp["block_all_reduces"] == 4 and tp["all_reduce_activation_ratio"] == 1.0
    assert 10 < tp["block_dispatch_ops"] < 1000 and 0 < tp["dispatch_op_s"] < 1e-2


def test_predict_run_finds_the_newest_calibration_in_the_store(tmp_path: Path, monkeypatch):
    from ddlscope.calibrate.profile import resolve_calibration
    from ddlscope.store import Store

    monkeypatch.chdir(tmp_path)  # no ./ddlscope-calibration.toml here
    with Store(tmp_path / "s.db") as store:
        with pytest.raises(ConfigError, match="run `ddlscope calibrate` first"):
            resolve_calibration(store, None, "h")
        for value in (1.0, 2.0):
            store.add_calibration({"meta": {"host": "h", "quick": True}, "compute": {"peak_flops": value},
                                   "collectives": {"ws2": {}, "ws4": {}}})
        store.add_calibration({"meta": {"host": "other"}, "compute": {"peak_flops": 3.0}, "collectives": {}})
        profile, source = resolve_calibration(store, None, "h")
        assert profile.compute.peak_flops == 2.0 and source.startswith("calibration 2 in")
        assert store.conn.execute("SELECT world_sizes FROM calibrations WHERE id=2").fetchone()[0] == "2,4"
        explicit = tmp_path / "p.toml"
        write_profile({"meta": {"host": "h"}, "compute": {"peak_flops": 9.0},
                       "collectives": {"ws2": {"p2p": {"alpha_s": 1e-4}}}}, explicit)
        assert resolve_calibration(store, explicit, "h")[0].compute.peak_flops == 9.0


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_launched_processes_get_threads_per_rank(monkeypatch):
    """Runs and calibrate's probes start through one launch_processes, with one OMP_NUM_THREADS policy:
    threads_per_rank (default 1) in every rank, this process's own setting put back."""
    import os

    from ddlscope.runtime.launcher import launch_processes

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert launch_processes(os.getenv, ("OMP_NUM_THREADS",), 2, run_id="test-threads") == {0: "1", 1: "1"}
    assert launch_processes(os.getenv, ("OMP_NUM_THREADS",), 1, run_id="test-threads", threads_per_rank=2) == {0: "2"}
    assert os.environ["OMP_NUM_THREADS"] == "7"
    # torch's own thread count too: OpenMP read the variable when the fork server imported torch
    assert launch_processes(_torch_threads, (), 1, run_id="test-threads", threads_per_rank=2) == {0: 2}
    assert launch_processes(_torch_threads, (), 1, run_id="test-threads") == {0: 1}


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_ranks_see_the_launchers_environment_as_of_each_launch(monkeypatch):
    """Ranks are forks of a server started at the first launch: a variable set or removed after it
    still reaches (or leaves) the next launch's ranks, and the agent's own (RANK) are kept."""
    import os

    from ddlscope.runtime.launcher import launch_processes

    monkeypatch.setenv("DDLSCOPE_TEST_VALUE", "first")
    assert launch_processes(os.getenv, ("DDLSCOPE_TEST_VALUE",), 1, run_id="test-env") == {0: "first"}
    monkeypatch.setenv("DDLSCOPE_TEST_VALUE", "second")
    assert launch_processes(os.getenv, ("DDLSCOPE_TEST_VALUE",), 2, run_id="test-env") == {0: "second", 1: "second"}
    monkeypatch.delenv("DDLSCOPE_TEST_VALUE")
    assert launch_processes(os.getenv, ("DDLSCOPE_TEST_VALUE",), 1, run_id="test-env") == {0: None}
    assert launch_processes(os.getenv, ("RANK",), 2, run_id="test-env") == {0: "0", 1: "1"}


def test_convolutions_are_priced_at_the_calibrated_convolution_rate_of_their_channel_count():
    """A step's matmuls at the matmul curve, its convolution GEMMs at the convolution curve by output
    channels per group (log-linear between probes); an older calibration without the probe prices them
    as matmuls of their effective size."""
    from ddlscope.calibrate.model import gemm_time_s
    from ddlscope.calibrate.profile import CalibrationProfile

    compute = {"peak_flops": 1e11, "matmul": {"sizes": [64, 512], "flops": [5e10, 1e11], "peak_flops": 1e11}}
    facts = {"flops": 8e9 + 3e9, "gemm_flops": [8e9], "gemm_size": [512.0],
             "conv_flops": [1e9, 2e9], "conv_channels": [16, 64], "conv_size": [512.0, 512.0]}
    with_conv = CalibrationProfile.coerce({"collectives": {}, "compute": {**compute, "conv": {"channels": [8, 16, 32, 64],
                                                                            "flops": [1e10, 2e10, 4e10, 5e10]}}})
    assert gemm_time_s(facts, with_conv.compute) == pytest.approx(8e9 / 1e11 + 1e9 / 2e10 + 2e9 / 5e10)
    between = {**facts, "conv_channels": [16, 45.254834]}  # sqrt(32 x 64): halfway on the log scale
    assert gemm_time_s(between, with_conv.compute) == pytest.approx(0.08 + 0.05 + 2e9 / 4.5e10)
    older = CalibrationProfile.coerce({"collectives": {}, "compute": compute})
    assert gemm_time_s(facts, older.compute) == pytest.approx(11e9 / 1e11)


def test_probe_blocks_are_timed_in_turn_so_a_drift_lands_on_both(monkeypatch):
    """Two blocks whose true costs are 2:1, on a machine slowing down call by call: timed in turn, the
    medians keep the 2:1 (and the difference, the [tp] probe's per-op cost, its true size); timed one block
    after the other, the drift would add to the second block's time."""
    from ddlscope.calibrate import probes

    clock = {"now_s": 0.0, "calls": 0}

    def costing(cost_s: float):
        def run() -> None:
            clock["calls"] += 1
            clock["now_s"] += cost_s * (1 + 0.01 * clock["calls"])  # 1% slower each call
        return run

    monkeypatch.setattr(probes.time, "perf_counter", lambda: clock["now_s"])
    big_s, small_s = probes._alternating_median_times([costing(2.0), costing(1.0)], 21)
    assert big_s / small_s == pytest.approx(2.0, rel=0.02)
    # the median of each is the 11th pair's: calls 23 and 24, after the two warm-ups (1.23x and 1.24x)
    assert big_s == pytest.approx(2.0 * 1.23) and small_s == pytest.approx(1.0 * 1.24)
    # what runs before each (a barrier: a rank waiting for another) is not timed
    clock["calls"] = 0
    waited = probes._alternating_median_times([costing(2.0), costing(1.0)], 21,
                                              before=lambda: clock.update(now_s=clock["now_s"] + 100.0))
    assert waited == pytest.approx([2.0 * 1.23, 1.0 * 1.24])
