"""`pipeline` and `partitioned` on model sources (torchvision:, timm:, hf:): the model as layers applied in
order (workloads/sequential.py) reproduces the model; cut into stages over two ranks it trains like one
process; a model that is not a chain, or ties weights across layers, is refused in one line before launch.
`tp` splits a llama-family decoder by module role and trains like one process too.

Two ranks run the runtime's loop (tests/rank_runs.py) for every pipelined source in one process group; the
one-process references run here. One `ddlscope run` goes through the launcher and the store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddlscope.runtime.config import load_experiment
from ddlscope.specs import ConfigError
from ddlscope.workloads import WORKLOADS
from ddlscope.workloads.sequential import (
    DecoderLayer, NotAChain, TensorOp, balanced_cuts, split_layers, layer_sequence_of)
from ddlscope.workloads.sources import example_input, model_of
from rank_runs import records, spawn_runs, train_rank

pytestmark = pytest.mark.cli_in_this_process  # its runs need no process of their own (conftest.cli)

WORLD = 2
IMAGE = {"workload.image_size": 32, "workload.samples": 64, "workload.test_samples": 16}
TEXT = {"workload.layers": 2, "workload.hidden": 64, "workload.heads": 4, "workload.seq_len": 16,
        "workload.samples": 64, "workload.test_samples": 16}
SMALL = {"torchvision:resnet18": IMAGE, "torchvision:shufflenet_v2_x0_5": IMAGE, "timm:test_resnet": IMAGE,
         "hf:llama": TEXT, "hf:gpt2": TEXT, "hf:mistral": TEXT, "hf:qwen2": TEXT, "hf:qwen3": TEXT}
REFUSED = {"hf:bert": TEXT}  # not a chain to cut, but a model to build


def _exp(name: str, **extra):
    return load_experiment(None, {"workload.name": name, **{**SMALL, **REFUSED}.get(name, IMAGE), **extra})


def _model_and_batch(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    spec = _exp(name).workload
    torch.manual_seed(0)
    model = model_of(spec)
    x = example_input(spec, 4)
    x = torch.randint(0, spec.vocab, x.shape) if name.startswith("hf:") else torch.randn_like(x)
    return model, x


def _apply(layers: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("name", list(SMALL))
def test_the_layer_sequence_is_the_model(name: str):
    """The layers applied in order give the model's output exactly, in evaluation and in training
    (batch norms on the batch's statistics); and they hold every parameter of the model once."""
    model, x = _model_and_batch(name)
    layers = split_layers(model)
    assert len(layers) >= 3
    held = {id(p) for layer in layers for p in layer.parameters()}
    assert held == {id(p) for p in model.parameters()}
    for train in (False, True):
        if train and name == "hf:gpt2":
            continue  # gpt2's dropout draws differ call to call: evaluation alone is comparable
        model.train(train)
        torch.manual_seed(1)
        with torch.no_grad():
            expected = model(x)
            torch.manual_seed(1)
            got = _apply(layers, x)
        assert torch.equal(got, expected), (name, train, (got - expected).abs().max())


def test_the_tensor_ops_between_children_become_layers():
    """ResNet's forward flattens between its pool and its head: an nn.Flatten in the sequence;
    ShuffleNet's pools by x.mean([2, 3]): a TensorOp."""
    resnet, _ = _model_and_batch("torchvision:resnet18")
    layers = split_layers(resnet)
    assert [type(l).__name__ for l in layers[-3:]] == ["AdaptiveAvgPool2d", "Flatten", "Linear"]
    shufflenet, _ = _model_and_batch("torchvision:shufflenet_v2_x0_5")
    ops = [l for l in split_layers(shufflenet) if isinstance(l, TensorOp)]
    assert [op.target for op in ops] == ["mean"]


def test_a_decoder_stage_takes_hidden_states_alone():
    model, x = _model_and_batch("hf:llama")
    embedding, *blocks, head = split_layers(model)
    assert all(isinstance(b, DecoderLayer) for b in blocks) and len(blocks) == 2
    h = embedding(x)
    assert h.shape == (4, TEXT["workload.seq_len"], TEXT["workload.hidden"]) and h.is_floating_point()


def test_a_branching_forward_is_not_a_chain():
    """GoogLeNet's auxiliary heads branch off its trunk; ViT reads its class token, a tensor of the
    model itself."""
    torch.manual_seed(0)
    for name, reason in (("torchvision:googlenet", "feeds 2 steps"), ("torchvision:vit_b_16", "not a chain")):
        model = model_of(_exp(name).workload)
        assert layer_sequence_of(model) is None
        with pytest.raises(NotAChain, match=reason):
            split_layers(model)


def test_balanced_cuts_minimise_the_costliest_stage():
    assert balanced_cuts([1, 1, 1, 1], 2) == [2]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [1]
    assert balanced_cuts([1, 1, 1, 9], 2) == [3]
    assert balanced_cuts([1, 1, 1, 9], 2, allowed=[1, 2]) == [2]  # only where allowed
    assert balanced_cuts([3, 1, 1, 1, 3, 1], 3) == [1, 4]
    with pytest.raises(ConfigError, match="places to start"):
        balanced_cuts([1, 1, 1], 3, allowed=[2])


# --- refused before launch, in one line ---------------------------------------------------------------------


def _refusal(name: str, **extra) -> str:
    with pytest.raises(ConfigError) as caught:
        _exp(name, **extra)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_model_that_cannot_be_cut_is_refused_in_one_line():
    pipeline = {"strategy.name": "pipeline", "cluster.world_size": WORLD, "workload.batch_size": 8}
    assert "not a chain" in _refusal("torchvision:vit_b_16", **pipeline)
    assert "tied weights" in _refusal("hf:gpt2", **pipeline)  # embedding and head share one matrix
    assert "encoder" in _refusal("hf:bert", **pipeline)
    assert "not a chain" in _refusal("torchvision:googlenet", **{**pipeline, "strategy.name": "partitioned"})
    # more stages than places to start one: 2 blocks + embedding + head, 3 chunks on 2 ranks
    assert "6 stages" in _refusal("hf:llama", **pipeline, **{"strategy.schedule": "interleaved",
                                                             "strategy.chunks": 3, "strategy.micro_batches": 4})
    assert "partition" in _refusal("torchvision:resnet18", **pipeline, **{"strategy.partition": [40]})
    assert "partition" in _refusal("torchvision:resnet18", **{**pipeline, "strategy.name": "partitioned"},
                                   **{"strategy.partition": [40]})
    tp = {**pipeline, "strategy.name": "tp"}
    assert "heads" in _refusal("torchvision:resnet18", **tp)
    assert "by module role" in _refusal("hf:gpt2", **tp)  # one fused q/k/v matrix, no plan by role
    assert "kv_heads" in _refusal("hf:llama", **tp, **{"workload.kv_heads": 1})


def test_the_cli_refuses_in_one_line(cli):
    out = cli("run", "--workload", "torchvision:vit_b_16", "--strategy", "pipeline", "--world-size", "2",
              timeout_s=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in (out.stderr + out.stdout).splitlines() if line.strip()]
    assert len(lines) == 1 and "not a chain" in lines[0], lines


# --- two ranks train like one process ------------------------------------------------------------------------

BASE = {"workload.batch_size": 8, "workload.steps": 2, "workload.optimizer": "sgd", "workload.lr": 0.05,
        "seed": 5}
# Batch norms normalise over what a stage sees: one micro-batch per step keeps the whole batch together.
RUNS = {
    "resnet18-gpipe": ("torchvision:resnet18", {"strategy.schedule": "gpipe", "strategy.micro_batches": 1}),
    "test_resnet-gpipe": ("timm:test_resnet", {"strategy.schedule": "gpipe", "strategy.micro_batches": 1}),
    "llama-1f1b": ("hf:llama", {"strategy.schedule": "1f1b", "strategy.micro_batches": 4}),
    "llama-interleaved": ("hf:llama", {"strategy.schedule": "interleaved", "strategy.chunks": 2,
                                       "strategy.micro_batches": 4}),
    # each decoder layer recomputes in backward (its forward rebound): the stages' meta copy must follow
    "llama-1f1b-recompute": ("hf:llama", {"strategy.schedule": "1f1b", "strategy.micro_batches": 2,
                                          "workload.recompute": "full"}),
    # tensor parallel by module role: q/k/v, gate/up colwise, o/down rowwise
    "llama-tp": ("hf:llama", {"strategy.name": "tp"}),
}


def _overrides(name: str, strategy: dict | None) -> dict:
    base = {**BASE, "workload.name": name, **SMALL[name]}
    if strategy is None:
        return {**base, "strategy.name": "single", "cluster.world_size": 1}
    return {**base, "strategy.name": "pipeline", "cluster.world_size": WORLD, **strategy}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline-sources")
    spawn_runs(out, WORLD, [(run, _overrides(name, strategy), None) for run, (name, strategy) in RUNS.items()]
               + [("llama-partitioned", {**_overrides("hf:llama", None), "strategy.name": "partitioned",
                                         "cluster.world_size": WORLD}, None)])
    for name in sorted({name for name, _ in RUNS.values()}):
        state, rows = train_rank(_overrides(name, None), 0, 1, out / f"single-{_short(name)}.jsonl")
        torch.save(state, out / f"single-{_short(name)}.pt")
        (out / f"single-{_short(name)}.json").write_text(json.dumps(rows))
    return out


def _short(name: str) -> str:
    return name.partition(":")[2]


def _rows(out: Path, name: str) -> list[dict]:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("run", list(RUNS))
def test_a_pipelined_source_trains_like_one_process(runs: Path, run: str):
    """Parameters and buffers (batch-norm statistics) after two SGD steps, both steps' losses and the test
    loss equal one process's on the same batches."""
    name, _ = RUNS[run]
    single, piped = torch.load(runs / f"single-{_short(name)}.pt"), torch.load(runs / f"{run}.pt")
    assert list(piped) == list(single)  # the whole model, under the single-process names, in order
    initial = WORKLOADS.get(name).build(load_experiment(None, _overrides(name, None)).workload, BASE["seed"])
    moved = 0.0
    for key, before in initial.model.state_dict().items():
        # SGD at lr 0.05: equal parameters after two steps mean equal gradients (to 2e-5 / 0.05)
        torch.testing.assert_close(piped[key], single[key], atol=2e-5, rtol=1e-5)
        if before.is_floating_point():
            moved = max(moved, (single[key] - before).abs().max().item())
    assert moved > 1e-3  # training moved the parameters: equality is not trivially true
    single_rows = _rows(runs, f"single-{_short(name)}")
    expected = [r["loss"] for r in records(single_rows, "step")]
    for rank in range(WORLD):
        assert [r["loss"] for r in records(_rows(runs, f"{run}-{rank}"), "step")] == pytest.approx(expected, abs=1e-5)
    test_loss = records(single_rows, "eval")[-1]["loss"]
    assert records(_rows(runs, f"{run}-0"), "eval")[-1]["loss"] == pytest.approx(test_loss, rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_each_rank_holds_its_stages_only(runs: Path):
    """Stage 0 (embedding + first decoder layer) on rank 0, the rest on rank 1: parameter bytes add up
    to the model's, and neither rank holds it all."""
    total = sum(t.numel() * 4 for t in torch.load(runs / "single-llama.pt").values() if t.is_floating_point())
    held = [records(_rows(runs, f"llama-1f1b-{rank}"), "memory")[0]["bytes"]["parameters"] for rank in range(WORLD)]
    assert sum(held) == total and max(held) < total


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tensor_parallel_holds_half_of_each_projection(runs: Path):
    """tp on hf:llama: each rank holds 1/2 of every attention and MLP projection, all of the rest."""
    single = torch.load(runs / "single-llama.pt")
    split = sum(t.numel() for n, t in single.items() if n.endswith("_proj.weight"))
    rest = sum(t.numel() for t in single.values()) - split
    assert split > rest / 4  # the split is a real share of the model
    for rank in range(WORLD):
        held = records(_rows(runs, f"llama-tp-{rank}"), "memory")[0]["bytes"]["parameters"]
        assert held == 4 * (split // WORLD + rest)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_source_trains_partitioned(runs: Path):
    """`partitioned` cuts the same sequence: the task's loss on both ranks, rank 0 sends hidden states."""
    steps = [records(_rows(runs, f"llama-partitioned-{rank}"), "step") for rank in range(WORLD)]
    assert [r["loss"] for r in steps[0]] == [r["loss"] for r in steps[1]]
    assert {r["bytes_sent"] for r in steps[0]} == {BASE["workload.batch_size"] * TEXT["workload.seq_len"]
                                                  * TEXT["workload.hidden"] * 4}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ddlscope_run_pipelines_a_torchvision_model(cli, db_rows):
    out = cli("run", "--workload", "torchvision:shufflenet_v2_x0_5", "--strategy", "pipeline", "--world-size", "2",
              "--steps", "2", "--batch-size", "8", "--set", "workload.image_size=32", "--set", "workload.samples=64",
              "--set", "workload.test_samples=16", "--set", "strategy.micro_batches=2", "--quiet", timeout_s=200)
    assert out.returncode == 0, out.stderr
    assert db_rows("SELECT status FROM runs") == [("finished",)]
    steps = db_rows("SELECT rank, COUNT(*) FROM steps GROUP BY rank ORDER BY rank")
    assert steps == [(0, 2), (1, 2)]
    assert db_rows("SELECT COUNT(*) FROM evals WHERE loss IS NOT NULL")[0][0] >= 1
