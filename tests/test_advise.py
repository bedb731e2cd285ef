"""`ddlscope advise`: strategy ranking on a predicted cluster, memory fit, stragglers, staleness, errors, JSON."""

from __future__ import annotations

import json

import pytest

from ddlscope.cli import main

# A compute-heavy GPT: 150M parameters, 1024-token sequences, 8 sequences per GPU on 32 GPUs.
GPT_HEAVY = ["--workload", "gpt-synthetic", "--set", "workload.hidden=1024", "--set", "workload.layers=12",
             "--set", "workload.heads=16", "--set", "workload.seq_len=1024", "--batch-size", "256"]
# 2.5B parameters with AdamW: 40 GB of model states (bf16 weights and gradients, fp32 master weights and
# moments, as plan prices them), too many for a 24 GB A10G; an eighth of them fits.
GPT_BIG = ["--workload", "gpt-synthetic", "--set", "workload.hidden=2560", "--set", "workload.layers=32",
           "--set", "workload.heads=20", "--set", "workload.seq_len=256", "--batch-size", "64"]
# A small GPT, little compute per step: the slow network and the straggler matter.
GPT_SMALL = ["--workload", "gpt-synthetic", "--set", "workload.hidden=256", "--set", "workload.layers=4",
             "--set", "workload.heads=4", "--set", "workload.seq_len=128", "--batch-size", "64"]


def advise_json(capsys, *args: str) -> dict:
    rc = main(["advise", *args, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def by_name(result: dict) -> dict[str, dict]:
    return {s["strategy"]: s for s in result["strategies"]}


def test_compute_heavy_gpt_on_fast_cluster_recommends_a_collective(capsys, tmp_path):
    result = advise_json(capsys, *GPT_HEAVY, "--cluster", "a100-80gb:4x8", "--db", str(tmp_path / "none.db"))
    s = by_name(result)
    # ddp and fsdp are the planner's DP32 ZeRO-0 / ZeRO-3 layouts, priced as plan prices them: ZeRO-3's
    # sharded optimizer step beats the replicated one by more than the 3% tie, so fsdp ranks first
    assert result["recommendation"] == "fsdp" and s["ddp"]["rank"] == 2 and s["ddp"]["fits"]
    assert s["fsdp"]["step_s"] < s["ddp"]["step_s"] < 1.2 * s["fsdp"]["step_s"]
    assert s["ddp"]["comm_compute_ratio"] < 0.5  # compute-heavy: the all-reduce hides behind backward
    assert s["ddp"]["step_s"] < s["ps-sync"]["step_s"]
    assert result["workers"] == 32
    assert result["workload"]["flops_per_step"] > 1e12
    assert s["ps-async"]["staleness_penalty"].startswith("not measured")


def test_model_too_big_for_replicas_recommends_fsdp(capsys, tmp_path):
    result = advise_json(capsys, *GPT_BIG, "--cluster", "a10g:2x4", "--db", str(tmp_path / "none.db"))
    s = by_name(result)
    # Of the main study's strategies FSDP wins; a pipeline (a stage per GPU, only activations cross the
    # slow link) may rank above it.
    assert result["recommendation"] in ("fsdp", "pipeline")
    assert s["fsdp"]["rank"] < min(s[name]["rank"] for name in ("ddp", "ps-sync", "ps-async"))
    assert not s["ddp"]["fits"] and s["fsdp"]["fits"]
    assert s["fsdp"]["memory_bytes_per_gpu"] < s["ddp"]["memory_bytes_per_gpu"] / 2
    assert any("do not fit" in r for r in result["reasons"])


def test_straggler_on_slow_network_puts_async_above_sync(capsys, tmp_path):
    db = str(tmp_path / "none.db")
    result = advise_json(capsys, *GPT_SMALL, "--cluster", "a10g:2x4", "--stragglers", "3", "--db", db)
    s = by_name(result)
    assert s["ps-async"]["rank"] < s["ps-sync"]["rank"]
    assert s["ps-async"]["samples_per_s"] > s["ps-sync"]["samples_per_s"]
    base = by_name(advise_json(capsys, *GPT_SMALL, "--cluster", "a10g:2x4", "--db", db))
    # the straggler slows every synchronous strategy by its own factor on compute
    assert s["ddp"]["compute_s"] == pytest.approx(3 * base["ddp"]["compute_s"])
    assert s["ps-sync"]["step_s"] > base["ps-sync"]["step_s"]


def test_bad_cluster_is_one_line_exit_2(capsys):
    rc = main(["advise", "configs/default.toml", "--cluster", "a100-80gb:4by8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error:") and "\n" not in err and "NAME:NODESxGPUS_PER_NODE" in err
    rc = main(["advise", "configs/default.toml", "--cluster", "a100-80gb:1x8", "--stragglers", "0.5"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "--stragglers" in err


def test_json_has_the_keys(capsys, tmp_path):
    result = advise_json(capsys, "configs/default.toml", "--cluster", "a100-80gb:1x8", "--db", str(tmp_path / "x.db"))
    assert {"strategies", "recommendation", "reasons", "cluster", "workers", "workload"} <= set(result)
    assert [s["strategy"] for s in result["strategies"]].count("ddp") == 1
    from ddlscope.specs import strategy_specs

    # every registered multi-process strategy that can train this workload is ranked, the main study's among
    # them; the pipeline and tensor-parallel ones need a model with blocks to cut (the default MLP has none),
    # nodepar a graph; the federated ones are not offered for another's place (their data stays on the clients)
    ranked = {s["strategy"] for s in result["strategies"]}
    assert ranked == {c.registered_name for c in strategy_specs()
                      if not c.traits.single_process and c.traits.family != "federated"} - {"pipeline", "tp", "nodepar"}
    assert {"ddp", "fsdp", "ps-sync", "ps-async", "ssp", "ps-stale-aware", "localsgd", "hpsgd"} <= ranked
    for s in result["strategies"]:
        assert {"rank", "step_s", "compute_s", "comm_s", "memory_bytes_per_gpu", "fits", "cost_usd_per_step",
                "experiment_time_s", "staleness_penalty"} <= set(s)
    assert result["recommendation"] == result["strategies"][0]["strategy"]
    assert all(isinstance(r, str) and r for r in result["reasons"])


def _fake_run(store, strategy: str, curve: list[tuple[int, float]], seed: int = 0, world_size: int = 2,
              config: dict | None = None) -> int:
    run_id = store.create_run(uuid=f"u-{strategy}-{seed}-{world_size}", name=strategy, workload="mlp-digits",
                              strategy=strategy, world_size=world_size, config=config or {}, code_version="test",
                              seed=seed, environment={})
    store.mark_running(run_id)
    rows = [{"kind": "step", "rank": 0, "step": i, "t_s": 0.01 * i, "data_s": 0.0, "forward_s": 0.001,
             "backward_s": 0.002, "comm_wait_s": 0.0, "optimizer_s": 0.0, "step_s": 0.01, "comm_s": 0.0,
             "compute_cpu_s": 0.003, "samples": 32, "loss": 1.0, "bytes_sent": 0} for i in range(3)]
    rows += [{"kind": "eval", "rank": 0, "step": i, "wall_s": 0.1 * i, "samples_seen": samples,
              "metric_name": "accuracy", "metric": acc, "loss": 1.0 - acc} for i, (samples, acc) in enumerate(curve)]
    store.ingest(run_id, rows)
    store.mark_done(run_id, "finished")
    return run_id


def test_staleness_penalty_measured_from_local_runs(capsys, tmp_path):
    from ddlscope.store import Store

    db = tmp_path / "runs.db"
    with Store(db) as store:
        _fake_run(store, "ps-sync", [(1000, 0.5), (2000, 0.8), (3000, 0.9)])
        _fake_run(store, "ps-async", [(1000, 0.4), (2000, 0.6), (3000, 0.8), (6000, 0.9)])
    result = advise_json(capsys, "configs/default.toml", "--cluster", "a100-80gb:1x8", "--db", str(db))
    s = by_name(result)
    assert s["ps-async"]["staleness_factor"] == pytest.approx(2.0)  # 6000 samples vs 3000 to reach 0.9
    assert "2.00x the samples" in s["ps-async"]["staleness_penalty"]
    assert s["ps-async"]["effective_step_s"] == pytest.approx(2 * s["ps-async"]["step_s"])
    assert s["ssp"]["staleness_penalty"].startswith("not measured")
    assert any("measured locally" in r for r in result["reasons"])


def test_text_output_explains(capsys, tmp_path):
    rc = main(["advise", *GPT_HEAVY, "--cluster", "a100-80gb:4x8", "--db", str(tmp_path / "none.db")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "recommendation: fsdp" in out and "Bandwidth:" in out and "Memory:" in out and "Pricing:" in out


def test_advise_on_this_machine_from_its_calibration(capsys, tmp_path, monkeypatch):
    from ddlscope.calibrate import write_profile

    from test_predict_cli import LOCAL_PROFILE

    monkeypatch.chdir(tmp_path)
    write_profile(LOCAL_PROFILE, tmp_path / "ddlscope-calibration.toml")
    result = advise_json(capsys, *GPT_SMALL, "--cluster", "local:1x2", "--db", str(tmp_path / "x.db"))
    assert result["cluster"] == "local:1x2" and result["workers"] == 2
    assert all(s["cost_usd_per_step"] == 0.0 for s in result["strategies"])  # no price for this machine


def test_staleness_penalty_is_the_median_over_comparable_runs(capsys, tmp_path):
    from ddlscope.store import Store

    db = tmp_path / "runs.db"
    config = {"workload": {"name": "mlp-digits", "lr": 0.1}, "cluster": {"slowdown": [1.0, 2.0]}}
    with Store(db) as store:
        # sync finals 0.8, 0.9, 0.95: the reference is the 0.9 run, which reached it at 3000 samples
        _fake_run(store, "ps-sync", [(1000, 0.5), (3000, 0.8)], seed=0, config=config)
        _fake_run(store, "ps-sync", [(1000, 0.5), (2000, 0.8), (3000, 0.9)], seed=1, config=config)
        _fake_run(store, "ps-sync", [(1000, 0.6), (3000, 0.95)], seed=2, config=config)
        # async: 1.0x, 2.0x, never (final 0.45: 0.9/0.45 = 2.0x worse, counted as 2.0) -> median 2.0
        _fake_run(store, "ps-async", [(1000, 0.5), (3000, 0.9)], seed=0, config=config)
        _fake_run(store, "ps-async", [(3000, 0.8), (6000, 0.9)], seed=1, config=config)
        _fake_run(store, "ps-async", [(3000, 0.3), (6000, 0.45)], seed=2, config=config)
        # other settings (4 workers): not pooled with the above, whatever they say
        _fake_run(store, "ps-async", [(3000, 0.1), (6000, 0.1)], seed=3, world_size=4, config=config)
        _fake_run(store, "ps-sync", [(3000, 0.1), (6000, 0.1)], seed=0, world_size=4, config=config)
        newest_ssp = _fake_run(store, "ssp", [(3000, 0.9)], seed=0, world_size=8, config=config)
    s = by_name(advise_json(capsys, "configs/default.toml", "--cluster", "a100-80gb:1x8", "--db", str(db)))
    penalty = s["ps-async"]["staleness_penalty"]
    assert s["ps-async"]["staleness_factor"] == pytest.approx(1.0)  # the 4-worker run is the newest: alone
    assert "median" not in penalty
    with Store(db) as store:
        _fake_run(store, "ps-async", [(1000, 0.5), (3000, 0.9)], seed=9, config=config)  # newest: 2 workers again
    s = by_name(advise_json(capsys, "configs/default.toml", "--cluster", "a100-80gb:1x8", "--db", str(db)))
    penalty = s["ps-async"]["staleness_penalty"]
    # four 2-worker async runs: factors 1.0, 1.0, 2.0, 2.0 -> median 1.5
    assert s["ps-async"]["staleness_factor"] == pytest.approx(1.5)
    assert "median of 4 runs against the median of 3 ps-sync runs" in penalty
    assert "from 1.00x to 2.00x" in penalty
    assert s["ssp"]["staleness_penalty"].startswith("not measured") and str(newest_ssp) in s["ssp"]["staleness_penalty"]


def test_sustained_fraction_sets_the_stacks_compute_rate(capsys):
    default = by_name(advise_json(capsys, "configs/default.toml", *GPT_HEAVY, "--cluster", "a100-80gb:4x8"))
    slower = by_name(advise_json(capsys, "configs/default.toml", *GPT_HEAVY, "--cluster", "a100-80gb:4x8",
                                 "--sustained-fraction", "0.7"))
    assert slower["ddp"]["compute_s"] > default["ddp"]["compute_s"]  # the catalogue's is 1: no stack derating
    assert main(["advise", "configs/default.toml", "--cluster", "a100-80gb:4x8", "--sustained-fraction", "5"]) == 2
    assert "sustained_fraction" in capsys.readouterr().err


def test_gpt_char_is_profiled_from_its_real_corpus(capsys, tmp_path):
    """gpt-char's model builds on the meta device but its corpus is real CPU data (this crashed with
    "Tensor on device cpu is not on the expected device meta!"); the step is the real model's."""
    import torch

    from ddlscope.runtime.flops import count_step_flops
    from ddlscope.workloads import WORKLOADS

    result = advise_json(capsys, "--cluster", "h100:2x8", "--workload", "gpt-char", "--db", str(tmp_path / "none.db"))
    workload = result["workload"]
    assert workload["name"] == "gpt-char" and workload["batch_per_gpu"] == 2  # 32 sequences over 16 GPUs
    task = WORKLOADS.get("gpt-char").build(WORKLOADS.get("gpt-char").spec_class(), 0)
    x, y = task.train.get(torch.arange(2))
    assert workload["flops_per_step"] == count_step_flops(task.model, task.loss_fn, x, y).model_flops
    assert workload["units"] == len(task.model.blocks)


# The 13B GPT of the "any model" issue: advise once listed cocod at 900 GiB per GPU and recommended it
# on H100 InfiniBand while plan ranked layouts fitting in 36-66 GB.
GPT_13B = ["--workload", "gpt-synthetic", "--set", "workload.hidden=5120", "--set", "workload.heads=40",
           "--set", "workload.layers=40", "--set", "workload.seq_len=2048", "--set", "workload.vocab_size=50257",
           "--batch-size", "512"]


def test_advise_prices_a_gpt_layout_as_plan_does_and_recommends_what_fits(capsys, tmp_path):
    from ddlscope.predict import ModelSpec, ParallelSpec, parse_cluster, predict
    from ddlscope.predict.planner import plan

    result = advise_json(capsys, *GPT_13B, "--cluster", "h100:8x8", "--db", str(tmp_path / "none.db"))
    s = by_name(result)
    winner = s[result["recommendation"]]
    assert winner["fits"] and winner["rank"] == 1
    model = ModelSpec(hidden=5120, heads=40, layers=40, seq=2048, vocab=50257, global_batch=512,
                      tied_embeddings=False, learned_positions=True)
    cluster = parse_cluster("h100:8x8")
    for name in ("ddp", "fsdp"):
        layout = s[name]["layout"]
        assert layout["dp"] == 64 and layout["zero"] == (3 if name == "fsdp" else 0)
        same = predict(model, ParallelSpec(**layout), cluster)
        assert s[name]["step_s"] == pytest.approx(same.step_time_s, rel=1e-9)
        assert s[name]["fits"] == same.fits
    # plan, searching every layout of the same model, finds one at least as fast as advise's winner
    best = plan(model, cluster, top=1).rows[0].prediction
    assert best.fits and best.step_time_s <= winner["step_s"] * (1 + 1e-9)
    assert s["fsdp"]["fits"] and not s["ddp"]["fits"]  # 13B replicated: 210 GB of states


def test_advise_recommends_nothing_when_nothing_fits(capsys, tmp_path):
    result = advise_json(capsys, *GPT_13B, "--cluster", "a10g:1x4", "--db", str(tmp_path / "none.db"))
    assert not any(s["fits"] for s in result["strategies"])
    assert result["recommendation"] == "none"
    assert result["reasons"][-1].startswith("Recommendation: none: no strategy fits")
