"""Any model as a workload: torchvision:NAME, timm:NAME, hf:ARCH and module:PKG.MOD:FACTORY.

Fast checks in this process (the data has structure to learn, the FSDP units are
each model's blocks, the file loaders read torchvision's on-disk formats), then
every source trained for real at 2 ranks under ddp and fsdp (one process group for
all of them) and under ps-async through `ddlscope run`, read back with `show` and
`report`."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from ddlscope.runtime.config import load_experiment
from ddlscope.specs import ConfigError
from ddlscope.strategies.units import repeated_block_classes, wrap_units
from ddlscope.workloads import WORKLOADS
from ddlscope.workloads.sources import (MARKOV_BRANCHES, markov_sequences, model_of, read_image_folder,
                                        token_splits)

REPO = Path(__file__).resolve().parents[1]
# One small model of every source: what the multi-process tests train.
SMALL = {
    "torchvision": ("torchvision:shufflenet_v2_x0_5", {}),
    "timm": ("timm:test_vit", {}),
    "hf": ("hf:llama", {"kv_heads": 2}),
    "module": ("module:examples.my_model:build", {}),
}
FEW_SAMPLES = {"samples": 256, "test_samples": 64}


def experiment(name: str, **knobs: object):
    return load_experiment(None, {"workload.name": name, **{f"workload.{k}": v for k, v in knobs.items()}})


def build(name: str, **knobs: object):
    exp = experiment(name, **knobs)
    return WORKLOADS.get(name).build(exp.workload, exp.seed), exp


# --- data with structure ------------------------------------------------------------------------------


def test_markov_tokens_follow_their_chains_and_the_chains_differ() -> None:
    tokens, chain = markov_sequences(vocab=50, samples=400, length=30, seed=3, chains=2)
    again, _ = markov_sequences(vocab=50, samples=400, length=30, seed=3, chains=2)
    assert torch.equal(tokens, again) and not torch.equal(tokens, markov_sequences(50, 400, 30, 4, 2)[0])
    for c in range(2):
        pairs = tokens[chain == c]
        successors: dict[int, set[int]] = {}
        for a, b in zip(pairs[:, :-1].reshape(-1).tolist(), pairs[:, 1:].reshape(-1).tolist()):
            successors.setdefault(a, set()).add(b)
        # every token moves to at most MARKOV_BRANCHES others: a model can learn perplexity ~4, not 50
        assert max(len(s) for s in successors.values()) <= MARKOV_BRANCHES
        assert np.mean([len(s) for s in successors.values()]) > MARKOV_BRANCHES - 1.5
    first = {(a, b) for row in tokens[chain == 0] for a, b in zip(row[:-1].tolist(), row[1:].tolist())}
    second = {(a, b) for row in tokens[chain == 1] for a, b in zip(row[:-1].tolist(), row[1:].tolist())}
    assert len(first & second) < 0.2 * len(first)


def test_causal_windows_are_shifted_by_one_and_classifier_labels_are_chains() -> None:
    train, test = token_splits(vocab=64, seq_len=16, samples=40, test_samples=8, seed=0, classify=False)
    x, y = train.get(torch.arange(3))
    assert x.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1]) and len(test) == 8
    train, _ = token_splits(vocab=64, seq_len=16, samples=40, test_samples=8, seed=0, classify=True)
    x, y = train.get(torch.arange(20))
    assert x.shape == (20, 16) and sorted(set(y.tolist())) == list(range(10))


def test_images_are_resized_and_recoloured_for_the_model() -> None:
    task, _ = build("torchvision:resnet18", image_size=48, **FEW_SAMPLES)
    x, y = task.train.get(torch.arange(4))
    assert x.shape == (4, 3, 48, 48) and y.dtype == torch.int64 and task.model(x).shape == (4, 10)
    task, _ = build("torchvision:resnet18", channels=1, classes=12, **FEW_SAMPLES)
    x, _ = task.train.get(torch.arange(2))
    assert x.shape == (2, 1, 32, 32) and task.model(x).shape == (2, 12)


@pytest.mark.parametrize("source", list(SMALL))
def test_every_source_learns_a_fixed_batch(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # module:examples... is imported from where the user runs
    name, knobs = SMALL[source]
    torch.manual_seed(0)
    task, _ = build(name, **knobs, **FEW_SAMPLES)
    x, y = task.train.get(torch.arange(16))
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=5e-3)
    losses = []
    for _ in range(20):
        loss = task.loss_fn(task.model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_hf_knobs_reach_the_config_and_an_encoder_classifies() -> None:
    task, exp = build("hf:llama", hidden=96, layers=3, heads=6, kv_heads=2, intermediate=200, vocab=300, seq_len=40,
                      **FEW_SAMPLES)
    config = task.model.hf.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (96, 3, 6, 2, 200, 300)
    x, y = task.train.get(torch.arange(2))
    assert task.model(x).shape == (2, 40, 300) and task.metric_name == "perplexity"
    encoder, _ = build("hf:bert", **FEW_SAMPLES)
    assert encoder.metric_name == "accuracy" and encoder.model(encoder.train.get(torch.arange(2))[0]).shape == (2, 10)


def test_a_70b_llama_config_builds_on_the_meta_device() -> None:
    exp = experiment("hf:llama", hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=128256,
                     seq_len=2048)
    with torch.device("meta"):
        model = model_of(exp.workload)
    params = sum(p.numel() for p in model.parameters())
    assert 70.0e9 < params < 71.0e9  # Llama-3 70B: 70.6 billion


# --- FSDP's units ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "knobs", "block", "count"), [
    ("torchvision:resnet50", {}, "Bottleneck", 16),
    ("torchvision:convnext_tiny", {}, "CNBlock", 18),
    ("torchvision:vit_b_16", {}, "EncoderBlock", 12),
    ("timm:test_vit", {}, "Block", None),
    ("hf:llama", {"layers": 3}, "LlamaDecoderLayer", 3),
    ("hf:gpt2", {"layers": 4}, "GPT2Block", 4),
    ("module:examples.my_model:build", {"args": {"depth": 3}}, "MixerBlock", 3),
])
def test_fsdp_units_are_the_models_blocks(name: str, knobs: dict, block: str, count: int | None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    with torch.device("meta"):
        model = model_of(experiment(name, **knobs).workload)
    units = wrap_units(model)
    assert {type(u).__name__ for u in units} == {block}
    if count is not None:
        assert len(units) == count
    in_units = sum(p.numel() for u in units for p in u.parameters())
    assert in_units > 0.8 * sum(p.numel() for p in model.parameters())


def test_wrap_class_overrides_the_rule_and_a_wrong_one_is_one_line() -> None:
    with torch.device("meta"):
        model = model_of(experiment("torchvision:resnet50").workload)
    assert len(wrap_units(model, "Sequential")) == 4  # layer1..layer4, not the blocks inside them
    assert "Bottleneck" in repeated_block_classes(model)
    with pytest.raises(ConfigError, match="no module of that class; its repeated blocks: .*Bottleneck"):
        wrap_units(model, "TransformerBlock")


# --- the user's files -----------------------------------------------------------------------------------


def _write_cifar(root: Path, per_batch: int) -> tuple[np.ndarray, list[int]]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    kept = None
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels}, f)
        kept = kept or (data, labels)
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [f"c{i}".encode() for i in range(10)]}))
    return kept


def _write_mnist(root: Path, train: int, test: int) -> np.ndarray:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    first = None
    for prefix, n in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 2051, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">ii", 2049, n) + labels.tobytes())
        first = images if first is None else first
    return first


def test_cifar10_folder_is_read_as_torchvision_writes_it(tmp_path: Path) -> None:
    data, labels = _write_cifar(tmp_path, per_batch=6)
    x_train, y_train, x_test, y_test = read_image_folder("cifar10", tmp_path)
    assert x_train.shape == (30, 3, 32, 32) and x_test.shape == (6, 3, 32, 32) and x_train.dtype == torch.uint8
    assert torch.equal(x_train[0], torch.from_numpy(data[0].reshape(3, 32, 32)))  # CHW, as CIFAR stores it
    assert y_train[:6].tolist() == labels
    task, _ = build("timm:test_vit", dataset="cifar10", data_dir=str(tmp_path))
    assert len(task.train) == 30 and len(task.test) == 6


def test_mnist_folder_is_read_and_made_three_channels(tmp_path: Path) -> None:
    images = _write_mnist(tmp_path, train=12, test=4)
    x_train, y_train, x_test, _ = read_image_folder("mnist", tmp_path)
    assert x_train.shape == (12, 1, 28, 28) and x_test.shape == (4, 1, 28, 28)
    assert torch.equal(x_train[3, 0], torch.from_numpy(images[3]))
    task, _ = build("torchvision:resnet18", dataset="mnist", data_dir=str(tmp_path))
    x, _ = task.train.get(torch.arange(2))
    assert x.shape == (2, 3, 32, 32) and torch.equal(x[:, 0], x[:, 2])  # grey repeated, resized to 32


def test_a_folder_without_the_dataset_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no cifar10 in it; expected cifar-10-batches-py/"):
        experiment("torchvision:resnet18", dataset="cifar10", data_dir=str(tmp_path))
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="no readable cifar10 in it"):
        read_image_folder("cifar10", tmp_path)


# --- every source under every kind of strategy, for real ------------------------------------------------


@pytest.fixture(scope="module")
def user_home(tmp_path_factory) -> Path:
    """A user's folder: their package beside where they run ddlscope."""
    home = tmp_path_factory.mktemp("sources")
    shutil.copytree(REPO / "examples", home / "examples")
    return home


STEPS = 4
GROUP_STRATEGIES = ("ddp", "fsdp")


def _overrides(source: str, strategy: str) -> dict:
    name, knobs = SMALL[source]
    return {"workload.name": name, **{f"workload.{k}": v for k, v in {**knobs, **FEW_SAMPLES}.items()},
            "workload.batch_size": 8, "workload.steps": STEPS, "strategy.name": strategy, "cluster.world_size": 2}


@pytest.fixture(scope="module")
def in_one_group(user_home: Path, tmp_path_factory) -> Path:
    """Every source under ddp and under fsdp: the runtime's loop on 2 gloo ranks, all eight runs one after
    another in one process group (tests/rank_runs.py), started from the user's folder, so that processes
    start once rather than once a run. The launcher's path (`ddlscope run`: the experiment handed to the
    ranks as JSON, the FLOPs profile, the store, `show` and `report`) is taken once per source, with the
    parameter server, below."""
    from rank_runs import spawn_runs

    out = tmp_path_factory.mktemp("sources-in-one-group")
    here = Path.cwd()
    os.chdir(user_home)
    try:
        spawn_runs(out, 2, [(f"{source}-{strategy}", _overrides(source, strategy), None)
                            for source in SMALL for strategy in GROUP_STRATEGIES])
    finally:
        os.chdir(here)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", list(SMALL))
def test_every_source_trains_under_ddp_fsdp_and_a_parameter_server(source: str, user_home: Path,
                                                                   in_one_group: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import run_cli_here as run_cli  # no process of its own needed: the fork server is reused

    monkeypatch.chdir(user_home)  # module:examples... is imported from where the user runs
    name, knobs = SMALL[source]
    with torch.device("meta"):
        names = list(model_of(experiment(name, **knobs).workload).state_dict())
    for strategy in GROUP_STRATEGIES:
        state = torch.load(in_one_group / f"{source}-{strategy}.pt")
        # the whole model (FSDP's shards gathered) under the model's own names, trained to finite values
        assert list(state) == names, strategy
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), strategy
        for rank in range(2):
            rows = json.loads((in_one_group / f"{source}-{strategy}-{rank}.json").read_text())
            losses = [r["loss"] for r in rows if r.get("kind") == "step" and r.get("loss") is not None]
            assert len(losses) == STEPS and all(np.isfinite(losses)), (strategy, rank, losses)
            assert [r for r in rows if r.get("kind") == "memory"], (strategy, rank)
        evals = [r for r in json.loads((in_one_group / f"{source}-{strategy}-0.json").read_text())
                 if r.get("kind") == "eval"]
        assert evals and np.isfinite(evals[-1]["loss"]), (strategy, evals)

    db = f"{source}.db"
    sets = [arg for k, v in {**knobs, **FEW_SAMPLES, "batch_size": 8}.items() for arg in ("--set", f"workload.{k}={v}")]
    result = run_cli("run", "--workload", name, "--strategy", "ps-async", "--world-size", "2", "--steps", str(STEPS),
                     "--db", db, *sets, cwd=user_home, timeout_s=200)
    assert result.returncode == 0, result.stderr[-2000:]
    with sqlite3.connect(user_home / db) as conn:
        runs = conn.execute("SELECT id, workload, strategy, status FROM runs ORDER BY id").fetchall()
        assert [(w, s, st) for _, w, s, st in runs] == [(name, "ps-async", "finished")]
        losses = [loss for (loss,) in conn.execute("SELECT loss FROM steps WHERE run_id=1 AND loss IS NOT NULL")]
        assert len(losses) >= STEPS and all(np.isfinite(losses)), losses
    shown = run_cli("show", "1", "--json", "--db", db, cwd=user_home, timeout_s=60)
    assert shown.returncode == 0, shown.stderr
    shown_json = json.loads(shown.stdout)
    assert shown_json["run"]["workload"] == name and shown_json["steps_recorded"] == STEPS
    assert shown_json["memory_bytes_by_rank"] and shown_json["final_eval"]
    report = run_cli("report", "1", "-o", f"{source}.html", "--db", db, cwd=user_home, timeout_s=120)
    assert report.returncode == 0, report.stderr
    assert name in (user_home / f"{source}.html").read_text()


@pytest.mark.parametrize("name", ["hf:gpt2", "hf:llama", "torchvision:shufflenet_v2_x0_5", "timm:test_vit"])
def test_a_spec_read_back_from_json_builds_as_a_rank_builds_it(name: str) -> None:
    """The launcher hands ranks the experiment as JSON, where every field reads as set."""
    from ddlscope.runtime.config import experiment_from_json, experiment_to_dict

    exp = experiment(name, **FEW_SAMPLES)
    again = experiment_from_json(json.dumps(experiment_to_dict(exp)))
    task = WORKLOADS.get(name).build(again.workload, again.seed)
    x, _ = task.train.get(torch.arange(2))
    assert task.model(x).shape[0] == 2


@pytest.mark.parametrize(("name", "knobs"), [("hf:llama", {"layers": 3}), ("torchvision:resnet18", {})])
def test_full_recompute_keeps_less_and_computes_the_same(name: str, knobs: dict) -> None:
    from ddlscope.runtime.instrument import ActivationMeter

    grads, kept = {}, {}
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        task, _ = build(name, **knobs, recompute=recompute, **FEW_SAMPLES)
        x, y = task.train.get(torch.arange(4))
        meter = ActivationMeter(task.model)
        with meter.measure():  # the forward: what autograd keeps for backward
            loss = task.loss_fn(task.model(x), y)
        loss.backward()
        kept[recompute] = meter.bytes
        grads[recompute] = torch.cat([p.grad.flatten() for p in task.model.parameters()])
    assert torch.allclose(grads["none"], grads["full"], atol=1e-5)
    assert kept["full"] < 0.6 * kept["none"]
