"""Federated training: the partitions (torch-free), the round's weights and sampling, the per-block
predictors' bookkeeping, and fedavg / mm-psgd / mc-psgd trained by the real loop against a FedAvg
written out by hand.

The multi-process part starts two ranks once (launch_processes) and trains every configuration in
CONFIGS in turn with runtime/loop.py; the test process recomputes fedavg by hand (each client's
minibatches from workloads/partition.py, plain SGD, weights n_k / n) and the one-client runs in a
one-rank gloo group.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ddlscope.specs.strategies.federated import FedAvgSpec, MMPSGDSpec
from ddlscope.workloads.partition import ClientData, assign_blocks, cut, label_groups
from phase_checks import assert_step_phases

LABELS = np.repeat(np.arange(10), 30)  # 300 samples, 30 per class
COMMON = {"workload.name": "mlp-digits", "workload.batch_size": 64, "workload.lr": 0.2, "workload.eval_batches": 1,
          "seed": 5}


def covers_once(parts: list[np.ndarray], n: int) -> bool:
    return sorted(np.concatenate(parts).tolist()) == list(range(n))


# ---------------------------------------------------------------------------- partitions (no torch)
def test_iid_and_skewed_sizes_cover_every_sample_once():
    balanced = ClientData(FedAvgSpec(), LABELS, 4, seed=1).parts[0]
    assert covers_once(balanced, 300) and [len(p) for p in balanced] == [75] * 4
    skewed = ClientData(FedAvgSpec(size_skew=1.5), LABELS, 4, seed=1).parts[0]
    sizes = sorted(len(p) for p in skewed)
    assert covers_once(skewed, 300) and sizes[0] >= 1 and sizes[-1] > 2 * sizes[0]


def test_cut_keeps_order_and_gives_every_part_a_sample():
    parts = cut(np.arange(10), np.array([0.0, 0.05, 0.95]))
    assert [p.tolist() for p in parts] == [[0], [1], list(range(2, 10))]


def labels_held(parts: list[np.ndarray]) -> float:
    """Mean number of labels making up 90% of a client's samples."""
    counts = []
    for p in parts:
        share = np.sort(np.bincount(LABELS[p], minlength=10))[::-1] / len(p)
        counts.append(int(np.searchsorted(np.cumsum(share), 0.9) + 1))
    return float(np.mean(counts))


def test_dirichlet_skews_labels_more_as_alpha_shrinks():
    skewed = ClientData(FedAvgSpec(partition="dirichlet", alpha=0.1), LABELS, 4, seed=2).parts[0]
    mild = ClientData(FedAvgSpec(partition="dirichlet", alpha=100.0), LABELS, 4, seed=2).parts[0]
    assert covers_once(skewed, 300) and covers_once(mild, 300)
    assert labels_held(skewed) < 6 <= labels_held(mild)  # 10 labels at 90%: 9 or 10 for iid-like clients


def test_block_cyclic_blocks_follow_their_label_groups():
    spec = FedAvgSpec(partition="block-cyclic", blocks=2, rounds_per_block=3)
    data = ClientData(spec, LABELS, 2, seed=3)
    assert [g.tolist() for g in label_groups(10, 2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    for block, group in enumerate(label_groups(10, 2)):
        held = np.concatenate(data.parts[block])
        assert set(LABELS[held]) == set(group.tolist()) and len(held) == 150
    assert [spec.block_of_round(r) for r in range(8)] == [0, 0, 0, 1, 1, 1, 0, 0]
    assert [r for r in range(8) if spec.ends_block(r)] == [2, 5]
    # With purity 0.8, about a fifth of each block's samples come from the other group.
    mixed = assign_blocks(np.repeat(np.arange(10), 1000), 10, 2, 0.8, np.random.default_rng(0))
    foreign = np.mean(mixed[:5000] == 1)
    assert 0.18 < foreign < 0.22
    # The test samples are split by the same rule: block b's test set holds block b's labels.
    test = data.test_blocks(LABELS)
    assert set(LABELS[test[1]]) == {5, 6, 7, 8, 9} and covers_once(test, 300)


def test_a_round_reads_local_epochs_or_local_steps():
    data = ClientData(FedAvgSpec(local_epochs=2), LABELS, 3, seed=4)  # 100 samples per client
    reading = data.round(1, 0, batch=32)
    assert reading.minibatches == [32, 32, 32, 4] * 2
    assert sorted(reading.ids[:100].tolist()) == sorted(data.parts[0][1].tolist()) == sorted(reading.ids[100:].tolist())
    assert data.round(1, 0, 32).ids.tolist() == reading.ids.tolist()  # the same every time it is asked
    assert data.round(1, 1, 32).ids.tolist() != reading.ids.tolist()  # a new order each round
    steps = ClientData(FedAvgSpec(local_steps=7), LABELS, 3, seed=4).round(0, 0, batch=32)
    assert steps.minibatches == [32] * 7 and len(steps.ids) == 224
    replicated = ClientData(FedAvgSpec(partition="replicated"), LABELS, 3, seed=4)
    assert replicated.round(0, 2, 32).ids.tolist() == replicated.round(2, 2, 32).ids.tolist()


def test_sampling_and_weights():
    spec = FedAvgSpec(client_fraction=0.5, size_skew=1.0)
    picks = [spec.sampled_clients(r, 4, seed=9) for r in range(20)]
    assert all(len(p) == 2 and len(set(p)) == 2 and set(p) <= {0, 1, 2, 3} for p in picks)
    assert picks == [spec.sampled_clients(r, 4, seed=9) for r in range(20)]  # every rank draws the same
    assert len({tuple(p) for p in picks}) > 1
    assert FedAvgSpec(client_fraction=0.01).sampled_clients(0, 4, 0) != []  # at least one client
    data = ClientData(spec, LABELS, 4, seed=9)
    for r in range(5):
        weights = data.weights(r)
        assert sorted(weights) == picks[r] and sum(weights.values()) == pytest.approx(1.0)
        for k, w in weights.items():
            assert w == pytest.approx(data.size(k) / sum(data.size(j) for j in weights))


def test_per_block_variants_need_block_cyclic_data():
    from ddlscope.runtime.config import load_experiment
    from ddlscope.specs import ConfigError

    with pytest.raises(ValueError, match="block-cyclic"):
        MMPSGDSpec(partition="iid")
    with pytest.raises(ConfigError, match="rounds_per_block"):
        load_experiment(None, {**COMMON, "strategy.name": "mm-psgd", "strategy.rounds_per_block": 4,
                               "workload.steps": 2})


# ---------------------------------------------------------------------------- per-block bookkeeping
@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def one_rank(strategy: str, **knobs: Any):
    from ddlscope.runtime.config import load_experiment
    from ddlscope.strategies import RunContext, runtime_class

    exp = load_experiment(None, {**COMMON, "strategy.name": strategy, "cluster.world_size": 1, "workload.steps": 8,
                                 **{f"strategy.{k}": v for k, v in knobs.items()}})
    return exp, runtime_class(exp.strategy)(exp.strategy, RunContext(0, 1, 0, 0, torch.device("cpu"), "gloo", exp))


@pytest.mark.timeout(60)
def test_mm_psgd_averages_the_models_that_ended_each_block(one_rank_group):
    _, strategy = one_rank("mm-psgd", blocks=2, rounds_per_block=2)
    model = torch.nn.Linear(2, 1)
    strategy.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    size = sum(p.numel() for p in model.parameters())
    for r in range(8):  # blocks 0 0 1 1 0 0 1 1: block 0 ends after rounds 1 and 5, block 1 after 3 and 7
        strategy.after_round(r, [torch.full((size,), float(r))])
    averages = strategy.block_averages()
    assert averages[0].tolist() == [3.0] * size and averages[1].tolist() == [5.0] * size
    assert [m.tolist() for m in strategy.last_in_block()] == [[5.0] * size, [7.0] * size]


# ---------------------------------------------------------------------------- trained by the real loop
ROUNDS = 2
CONFIGS: dict[str, dict[str, Any]] = {
    "unbalanced": {"strategy.name": "fedavg", "strategy.size_skew": 1.0, "strategy.local_steps": 5},
    "sampled": {"strategy.name": "fedavg", "strategy.client_fraction": 0.5, "strategy.partition": "dirichlet",
                "strategy.local_epochs": 2},
    "replicated": {"strategy.name": "fedavg", "strategy.partition": "replicated", "strategy.local_steps": 4},
    "mc": {"strategy.name": "mc-psgd", "strategy.rounds_per_block": 1, "strategy.local_steps": 3},
    # trained for its step rows' phase check alone (tests/phase_checks.py): no other test trains mm-psgd
    "mm": {"strategy.name": "mm-psgd", "strategy.rounds_per_block": 1, "strategy.local_steps": 3},
}


def train_all(out_dir: str, configs: dict[str, dict[str, Any]], world: int) -> dict[str, Any]:
    """One rank: every configuration in turn, through the real loop; its final models and its rows."""
    import torch.distributed as dist

    from rank_runs import train_rank

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    models, records = {}, {}
    try:
        for label, overrides in configs.items():
            models[label], records[label] = train_rank(
                {**COMMON, "workload.steps": ROUNDS, "cluster.world_size": world, **overrides}, rank, world,
                Path(out_dir) / f"{label}-{rank}.jsonl", whole_model=False)
    finally:
        if world > 1:
            dist.destroy_process_group()
    return {"models": models, "records": records}


def fedavg_by_hand(overrides: dict[str, Any], clients: int) -> dict[str, torch.Tensor]:
    """McMahan et al.'s FedAvg written out: each sampled client from the global model, plain SGD over its
    minibatches, then the sum of n_k / n x its model."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from ddlscope.runtime.config import load_experiment
    from ddlscope.workloads import WORKLOADS

    exp = load_experiment(None, {**COMMON, "workload.steps": ROUNDS, "cluster.world_size": clients, **overrides})
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
    model, lr = task.model, exp.workload.lr
    labels = task.train.get(torch.arange(len(task.train)))[1].numpy()
    data = ClientData(exp.strategy, labels, clients, exp.seed)
    for r in range(ROUNDS):
        start = parameters_to_vector(model.parameters()).detach().clone()
        total = torch.zeros_like(start)
        for k, weight in data.weights(r).items():
            vector_to_parameters(start.clone(), model.parameters())  # the parameters become views of it
            reading = data.round(k, r, exp.workload.batch_size)
            x, y = task.train.get(torch.from_numpy(reading.ids).long())
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            offset = 0
            for size in reading.minibatches:
                optimizer.zero_grad()
                task.loss_fn(model(x[offset:offset + size]), y[offset:offset + size]).backward()
                optimizer.step()
                offset += size
            total += weight * parameters_to_vector(model.parameters()).detach()
        vector_to_parameters(total, model.parameters())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    from ddlscope.runtime.launcher import launch_processes

    out = tmp_path_factory.mktemp("federated")
    return launch_processes(train_all, (str(out), CONFIGS, 2), 2, run_id=f"fed-{os.getpid()}")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("label", ["unbalanced", "sampled"])
def test_two_clients_train_fedavg_as_written_by_hand(trained, label: str):
    same(trained[0]["models"][label], fedavg_by_hand(CONFIGS[label], 2))
    same(trained[1]["models"][label], trained[0]["models"][label])  # every client ends with the global model


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_one_client_is_local_training_and_identical_clients_are_one(trained, tmp_path, one_rank_group):
    """One client with iid data: plain SGD over its minibatches (the hand-written rounds with one client,
    whose weight is 1). Two clients holding the same data in the same order: one client's local SGD."""
    alone = train_all(str(tmp_path), {"iid": {"strategy.name": "fedavg"},
                                      "replicated": CONFIGS["replicated"]}, 1)["models"]
    same(alone["iid"], fedavg_by_hand({"strategy.name": "fedavg"}, 1))
    for rank in (0, 1):
        same(trained[rank]["models"]["replicated"], alone["replicated"])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_rounds_record_their_samples_bytes_and_per_block_evaluations(trained):
    records = trained[0]["records"]
    steps = [r for r in records["replicated"] if r["kind"] == "step"]
    model_bytes = sum(v.numel() * 4 for v in trained[0]["models"]["replicated"].values())
    assert [r["samples"] for r in steps] == [4 * 64] * ROUNDS and all(r["bytes_sent"] == model_bytes for r in steps)
    for label, overrides in CONFIGS.items():
        for rank in (0, 1):
            assert_step_phases(trained[rank]["records"][label], overrides["strategy.name"])
    mc_steps = [r for r in records["mc"] if r["kind"] == "step"]
    assert all(r["bytes_sent"] == 2 * model_bytes for r in mc_steps)  # the global model and the block's chain
    # A client not sampled in a round reads nothing and trains nothing, and still gets the average.
    sampled = [r["samples"] for rank in (0, 1) for r in trained[rank]["records"]["sampled"] if r["kind"] == "step"]
    assert sampled.count(0) == ROUNDS
    events = [r for r in records["mc"] if r["kind"] == "event"]
    evals = [json.loads(e["message"]) for e in events if e["event"] == "block_eval"]
    assert {(e["predictor"], e["block"]) for e in evals} == {
        (p, b) for p in ("global", "last-in-block", "mm", "chain", "per-block") for b in (0, 1)}
    assert sum(e["samples"] for e in evals if e["predictor"] == "global") == 360
    chosen = json.loads(next(e["message"] for e in events if e["event"] == "block_predictors"))["chosen"]
    for block, name in enumerate(chosen):
        pick = next(e for e in evals if e["predictor"] == name and e["block"] == block)
        mine = next(e for e in evals if e["predictor"] == "per-block" and e["block"] == block)
        assert pick["accuracy"] == mine["accuracy"]
    assert not [r for r in trained[1]["records"]["mc"] if r["kind"] == "event" and r["event"] == "block_eval"]
