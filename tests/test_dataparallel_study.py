"""`study dataparallel`: its cells, and the analysis that turns measured cells into claims and regime winners."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddlscope.analysis.summary import Summary
from ddlscope.studies import STUDIES
from ddlscope.studies.base import CellResult
from ddlscope.studies.dataparallel import REFERENCES, SUBJECTS


def test_cells_cover_every_subject_in_every_regime_on_equal_samples():
    study = STUDIES.get("dataparallel")()
    quick, full = study.cells(quick=True), study.cells(quick=False)
    assert len(quick) == 12 + 2 + 2  # about 20 s each here: the quick study stays near 5 minutes (+2 compression, +2 dbs)
    # the quick variant has fewer regimes and seeds, never fewer strategies
    studied = {name.partition("+")[0] for name in (*SUBJECTS, *REFERENCES, "omnivore", "dbs", "ps-sync")}
    assert studied <= {c.labels["strategy"].partition("+")[0] for c in quick}
    strategies = {c.labels["strategy"] for c in full}
    knobs = {f"ddp+{v}" for v in ("fp16", "bf16", "powersgd", "topk", "qsgd", "minmax8", "per_layer", "mgwfbp")}
    assert {"ddp", "ps-async", "localsgd", "diloco", "cocod", "hpsgd", "hpsgd+mc", "osp", "gossip",
            "localsgd+bf16", "dbs", "ddp+speeds", "ps-async+hogbatch", "gossip+async", "omnivore+g2",
            "ps-sync", "gossip+dp"} | knobs == strategies
    assert {c.labels["strategy"] for c in quick} >= {"ddp+topk", "ddp+mgwfbp", "dbs"}
    regimes = {(c.labels["network"], c.labels["workers"]) for c in full}
    assert regimes == {("fast", "homogeneous"), ("fast", "straggler"), ("slow", "homogeneous"), ("slow", "straggler")}
    # + DDP's 6 hooks, 2 plans x 2 networks, localsgd bf16; dbs x 4 regimes, 2 static splits x 2 stragglers;
    # async gossip with the straggler on both networks; private gossip; omnivore, ps-sync and ps-async at 4 workers
    assert len({c.key for c in full}) == len(full) == 36 + 11 + 8 + 2 + 1 + 3
    assert by_key_async(full) == {"gossip+async/fast/straggler/w2": "async", "gossip+async/slow/straggler/w2": "async"}
    assert all(c.experiment.cluster.slowdown for c in full if c.labels["strategy"] == "gossip+async")
    by_key = {c.key: c.experiment.strategy for c in full}
    assert by_key["omnivore+g2/slow/straggler/w4"].groups == 2
    assert by_key["gossip+dp/fast/homogeneous/w2"].private and not by_key["gossip/fast/homogeneous/w2"].private
    assert by_key["ddp+topk/slow/homogeneous/w2"].comm_hook == "topk"
    assert by_key["ddp+mgwfbp/fast/homogeneous/w2"].buckets == "mgwfbp"
    assert by_key["localsgd+bf16/slow/homogeneous/w2"].compression == "bf16"
    assert by_key["ddp/slow/homogeneous/w2"].comm_hook == "none" and by_key["ddp/slow/homogeneous/w2"].buckets == "size"
    assert by_key["ddp+speeds/slow/straggler/w2"].batch_split == "cluster"
    assert by_key["ps-async+hogbatch/fast/straggler/w2"].lock_free
    with_seeds = {c.key for c in study.cells(quick=False, repeats=2)}
    assert "ps-async+hogbatch/fast/straggler/w2/seed1" in with_seeds
    assert len({c.experiment.workload.steps * c.experiment.workload.batch_size for c in full}) == 1
    compensated = next(c for c in quick if c.labels["strategy"] == "hpsgd+mc")
    plain = next(c for c in full if c.labels["strategy"] == "hpsgd")
    assert compensated.experiment.workload.momentum == pytest.approx(0.3)
    assert plain.experiment.workload.momentum == pytest.approx(0.8)
    # seeds for what varies from run to run (the asynchronous server), not for the deterministic cells
    seeded = study.cells(quick=False, repeats=3)
    assert len(seeded) - len(full) == 8 + 4 + 4
    assert all(c.labels["strategy"] in ("ps-async", "ps-sync", "ps-async+hogbatch") for c in seeded[len(full):])


def by_key_async(cells) -> dict:
    return {c.key: c.experiment.strategy.mode for c in cells if c.labels["strategy"] == "gossip+async"}


def _result(strategy: str, network: str, workers: str, step_s: float, accuracy: float,
            bytes_per_step: float, exposed_s: float, seed: int = 0, world: int = 2) -> CellResult:
    wall_s = 100 * step_s
    summary = Summary(
        run={}, steps_recorded=100, ranks_recorded=2, warmup_steps_excluded=1, mean_step_s=step_s,
        throughput_samples_per_s=256 / step_s, baseline_run_id=None, speedup_vs_single=None, scaling_efficiency=None,
        breakdown_mean_s={}, breakdown_fraction={}, comm={"exposed_s": exposed_s, "bytes_sent_per_step": bytes_per_step},
        memory_bytes_by_rank={}, final_eval={"metric_name": "accuracy", "metric": accuracy}, final_loss=None,
        train_wall_s=wall_s, oversubscribed=False, cpu_derived_step_s=step_s, cpu_derived_wall_s=wall_s,
        # half way, 98% of the final accuracy; then the final one
        eval_curve=[{"step": 49, "wall_s": wall_s / 2, "samples_seen": 50, "metric_name": "accuracy",
                     "metric": 0.98 * accuracy},
                    {"step": 99, "wall_s": wall_s, "samples_seen": 100, "metric_name": "accuracy", "metric": accuracy}])
    labels = {"part": "accuracy", "strategy": strategy, "network": network, "workers": workers, "world_size": world,
              "seed": seed}
    cell = SimpleNamespace(key=f"{strategy}/{network}/{workers}/w{world}", labels=labels)
    return CellResult(cell, SimpleNamespace(config={"strategy": {"name": strategy.partition("+")[0]}}), summary, False)


def test_analysis_reads_claims_and_names_the_winner_of_each_regime_with_its_numbers():
    kb = 150_000.0
    results = [
        _result("ddp", "slow", "homogeneous", 0.045, 0.97, kb, 0.025),
        _result("localsgd", "slow", "homogeneous", 0.028, 0.96, kb / 8, 0.004),
        _result("cocod", "slow", "homogeneous", 0.026, 0.955, kb / 8, 0.001),
        _result("hpsgd", "slow", "homogeneous", 0.034, 0.19, kb, 0.018),
        _result("hpsgd+mc", "slow", "homogeneous", 0.034, 0.65, kb, 0.018),
        _result("diloco", "slow", "homogeneous", 0.021, 0.961, kb / 20, 0.002),
        _result("osp", "slow", "homogeneous", 0.036, 0.965, kb, 0.012),
        _result("ddp", "fast", "straggler", 0.030, 0.97, kb, 0.002),
        _result("ps-async", "fast", "straggler", 0.020, 0.50, kb, 0.001),
        _result("ps-async", "fast", "straggler", 0.022, 0.90, kb, 0.001, seed=1),
        _result("ps-async", "fast", "straggler", 0.021, 0.93, kb, 0.001, seed=2),
    ]
    findings = STUDIES.get("dataparallel")().analyse(results, quick=True)
    by_name = {h["headline"]: h for h in findings.headlines}
    local = by_name["Local SGD vs DDP"]
    assert "0.62x" in local["measured"] and "-1.0 points" in local["measured"] and local["verdict"].startswith("agrees")
    assert "1.73x DDP's throughput" in by_name["CoCoD-SGD vs synchronous SGD"]["measured"]
    assert "hid communication" in by_name["CoCoD-SGD vs synchronous SGD"]["verdict"]
    assert "staleness cost accuracy" in by_name["HPSGD vs DDP"]["verdict"]
    assert "20x fewer bytes" in by_name["DiLoCo"]["measured"]
    assert "+25% throughput over DDP" in by_name["OSP vs DDP"]["measured"]
    assert by_name["OSP vs DDP"]["verdict"].startswith("agrees")
    regimes = dict((r["regime"], r["verdict"]) for r in findings.extra["regimes"])
    # slow/homogeneous: time to 95% is half the wall time where 98% of the final accuracy reaches it (DDP:
    # 2.25 s), else the whole (diloco: 2.1 s, first although its 98% falls short)
    assert regimes["slow/homogeneous"].startswith("slow network, homogeneous workers: diloco wins (first to 95% "
                                                  "accuracy in 2.1 s")
    assert "then ddp 2.2 s (97.0%), cocod 2.6 s" in regimes["slow/homogeneous"]
    assert "hpsgd never" in regimes["slow/homogeneous"]
    # fast/straggler: ps-async's median seed (90%) never reached 95%, DDP did, at 1.5 s
    assert "ddp wins (first to 95% accuracy in 1.5 s" in regimes["fast/straggler"]
    assert "ps-async never (90.0%)" in regimes["fast/straggler"]
    assert findings.decisions == [v for _, v in sorted(regimes.items(), key=lambda kv: kv[0].startswith("slow"))]
    table = "\n".join(findings.extra["table"])
    assert "diloco/slow/homogeneous" in table and "7.5" in table  # 150 KB / 20 per step


def test_analysis_reads_compression_and_bucket_plans():
    kb = 150_000.0
    results = [
        _result("ddp", "slow", "homogeneous", 0.040, 0.97, kb, 0.032),
        _result("ddp+fp16", "slow", "homogeneous", 0.022, 0.97, kb / 2, 0.016),
        _result("ddp+topk", "slow", "homogeneous", 0.014, 0.94, kb / 50, 0.005),
        _result("ddp", "fast", "homogeneous", 0.010, 0.97, kb, 0.0047),
        _result("ddp+per_layer", "fast", "homogeneous", 0.011, 0.97, kb, 0.0043),
        _result("ddp+mgwfbp", "fast", "homogeneous", 0.0096, 0.97, kb, 0.0032),
        _result("ddp+per_layer", "slow", "homogeneous", 0.037, 0.97, kb, 0.0280),
        _result("ddp+mgwfbp", "slow", "homogeneous", 0.037, 0.97, kb, 0.0289),
    ]
    by_name = {h["headline"]: h for h in STUDIES.get("dataparallel")().analyse(results, quick=False).headlines}
    compression = by_name["Gradient compression vs DDP"]
    assert "fp16: 0.500x the bytes, step 0.55x" in compression["measured"]
    assert "topk: 0.020x the bytes" in compression["measured"]
    assert compression["verdict"] == "faster at DDP's accuracy (within 2 points): fp16"  # top-k lost 3 points
    fast, slow = by_name["MG-WFBP buckets (fast network)"], by_name["MG-WFBP buckets (slow network)"]
    assert "MG-WFBP 3.2 ms, 25 MB buckets 4.7 ms, one per layer 4.3 ms" in fast["measured"]
    assert fast["verdict"].startswith("agrees")
    assert slow["verdict"].startswith("a tie: ddp+per_layer")  # 28.9 against 28.0 ms: within 5%


def test_cells_at_another_worker_count_do_not_pool_with_the_two_worker_ones():
    from ddlscope.studies.dataparallel import _Analysis

    two = _result("ps-async", "slow", "straggler", 0.040, 0.90, 1e5, 0.02)
    four = [_result("ps-async", "slow", "straggler", 0.200, 0.80, 1e5, 0.15, seed=s, world=4) for s in (0, 1)]
    analysis = _Analysis([two, *four])
    assert analysis.get("ps-async", "slow", "straggler").step_s == pytest.approx(0.040)
    assert analysis.get("ps-async x4", "slow", "straggler").step_s == pytest.approx(0.200)
    assert analysis.get("ps-async x4", "slow", "straggler").seeds == 2


def test_private_gossip_headline_reads_its_cost_and_epsilon():
    kb = 150_000.0
    plain = _result("gossip", "fast", "homogeneous", 0.010, 0.97, kb, 0.002)
    private = _result("gossip+dp", "fast", "homogeneous", 0.050, 0.92, kb, 0.002)
    private.summary.strategy_metrics = [{"name": "privacy_epsilon", "value": 3.25, "detail": ""}]
    by_name = {h["headline"]: h for h in STUDIES.get("dataparallel")().analyse([plain, private], quick=False).headlines}
    headline = by_name["Private gossip (DP-SGD)"]
    assert "step 50.0 ms vs 10.0 ms without privacy (5.0x" in headline["measured"]
    assert "accuracy 92.0% vs 97.0% (-5.0 points), epsilon 3.25" in headline["measured"]
    assert headline["verdict"] == "agrees: privacy at a bounded epsilon, paid in step time and accuracy"
