"""Memory before launch: the model table's numbers, the pricing by traits, `ddlscope memory`, and one
estimate checked against a measured 2-rank run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import run_cli_here
from ddlscope.cli import main
from ddlscope.predict.model_memory import MemoryQuery, price
from ddlscope.runtime.config import load_experiment
from ddlscope.runtime.instrument import ActivationMeter
from ddlscope.specs import STRATEGY_SPECS
from ddlscope.strategies.units import wrap_units
from ddlscope.workloads.base import cross_entropy
from ddlscope.workloads.model_table import table_of_workload, trace_model_table

ROOT = Path(__file__).resolve().parents[1]
F32 = 4


def _spec(name: str, **knobs: object):
    overrides = {"workload.name": name, "strategy.name": "ddp", **{f"workload.{k}": v for k, v in knobs.items()}}
    return load_experiment(None, overrides).workload


def _query(strategy: str, world: int = 2, batch: int = 8, **kw: object) -> MemoryQuery:
    spec = STRATEGY_SPECS.get(strategy)()
    return MemoryQuery(traits=spec.traits, world_size=world, global_batch=batch, extra_ranks=spec.extra_ranks(),
                       **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the table
def test_resnet50_parameter_count_is_torchvisions():
    table = table_of_workload(_spec("torchvision:resnet50", classes=1000), batch=2, seed=0, units_of=wrap_units)
    assert table.param_count == 25_557_032
    assert table.param_bytes == 25_557_032 * F32
    assert table.counted_on == "fake"
    assert len(table.units) == 16  # the Bottleneck blocks
    conv1 = next(row for row in table.layers if row.name == "conv1")
    assert conv1.gemms[0].conv and (conv1.gemms[0].k, conv1.gemms[0].n) == (3 * 7 * 7, 64)
    assert conv1.forward_flops == conv1.gemms[0].flops


def test_repeated_units_copied_count_as_traced():
    """Units past the second of each shape are copied, not traced: the totals are the full trace's (a
    Bottleneck keeps its own output, through its last ReLU: counted once)."""
    spec = _spec("torchvision:resnet50")
    copied = table_of_workload(spec, batch=2, seed=0, units_of=wrap_units)
    traced = table_of_workload(spec, batch=2, seed=0)  # no units: every block traced
    assert copied.activation_bytes == traced.activation_bytes
    assert copied.forward_flops == traced.forward_flops
    assert [r.activation_bytes for r in copied.layers] == [r.activation_bytes for r in traced.layers]


@pytest.mark.parametrize("name", ["hf:llama", "hf:gpt2"])
def test_hf_activations_match_the_runtime_meter(name):
    """On fake tensors transformers would build an attention mask a real (unpadded) batch never needs."""
    from ddlscope.workloads.sources import model_of

    spec = _spec(name, layers=3)
    table = table_of_workload(spec, batch=2, seed=0, units_of=wrap_units)
    torch.manual_seed(0)
    model = model_of(spec).train()
    x, y = (torch.randint(0, spec.vocab, (2, spec.seq_len)) for _ in range(2))  # two storages, as in a run
    meter = ActivationMeter(model)
    with meter.measure():
        cross_entropy(model(x), y)
    assert table.activation_bytes == meter.bytes


class _TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_tiny_mlp_activation_bytes_by_hand():
    batch = 3
    model = _TinyMLP()
    x, y = torch.zeros(batch, 8), torch.zeros(batch, dtype=torch.int64)
    table = trace_model_table(model, cross_entropy, x, y, name="tiny")
    by_row = {row.name: row.activation_bytes for row in table.layers}
    # fc1 keeps its input; relu its output, which fc2 keeps too (one storage, counted once); the loss keeps
    # log_softmax's output, the int64 targets and nll_loss's scalar total weight. Weights are not activations.
    assert by_row == {"fc1": batch * 8 * F32, "act": batch * 16 * F32, "fc2": 0,
                      "(loss)": batch * 4 * F32 + batch * 8 + F32}
    assert table.activation_bytes == 364
    # FLOPs: two GEMMs, 2 m k n each.
    assert table.forward_flops == 2 * batch * 8 * 16 + 2 * batch * 16 * 4
    meter = ActivationMeter(model)
    with meter.measure():
        cross_entropy(model(x), y)
    assert meter.bytes == table.activation_bytes  # the runtime's own counter agrees


def test_recompute_keeps_only_unit_inputs():
    blocks = nn.Sequential(_TinyBlock(), _TinyBlock())
    model = nn.Sequential(blocks, nn.Linear(8, 4))
    x, y = torch.zeros(5, 8), torch.zeros(5, dtype=torch.int64)
    table = trace_model_table(model, cross_entropy, x, y, name="blocks", units=list(blocks))
    outside = sum(row.activation_bytes for row in table.layers if row.unit is None)
    # Each block keeps its 5 x 8 fp32 input; the second block's input is the first's output, which the
    # head's input is not (the head reads the second block's output, saved by the head: outside the units).
    assert [u.input_bytes for u in table.units] == [5 * 8 * F32, 5 * 8 * F32]
    assert table.activation_bytes_recompute == outside + 2 * 5 * 8 * F32
    assert table.activation_bytes_recompute < table.activation_bytes


class _TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_tied_weights_count_once():
    table = table_of_workload(_spec("hf:gpt2"), batch=2, seed=0)
    model = __import__("ddlscope.workloads.sources", fromlist=["model_of"]).model_of(_spec("hf:gpt2"))
    assert table.param_count == sum(p.numel() for p in model.parameters())  # parameters() dedupes the tie


# --------------------------------------------------------------------------- pricing by traits
@pytest.fixture(scope="module")
def resnet18_table():
    return table_of_workload(_spec("torchvision:resnet18"), batch=4, seed=0, units_of=wrap_units)


def test_fsdp_shards_model_states_over_the_ranks(resnet18_table):
    ddp = price(resnet18_table, _query("ddp", world=4, batch=16))[0].bytes
    fsdp = price(resnet18_table, _query("fsdp", world=4, batch=16))[0].bytes
    expected = sum(math.ceil(p.dim0 / 4) * (p.numel // p.dim0) * F32 for p in resnet18_table.params)
    assert fsdp["parameters"] == fsdp["gradients"] == expected
    assert fsdp["optimizer"] == 2 * expected  # AdamW: two states per parameter
    assert fsdp["parameters"] == pytest.approx(ddp["parameters"] / 4, rel=1e-3)
    assert fsdp["activations"] == ddp["activations"]  # the same 4 samples per rank


def test_parameter_server_workers_hold_no_optimizer_state(resnet18_table):
    worker, server = price(resnet18_table, _query("ps-async", world=2, batch=8))
    assert worker.bytes["optimizer"] == 0
    assert worker.bytes["parameters"] == resnet18_table.param_bytes
    assert server.role == "server"
    assert server.bytes["optimizer"] == 2 * resnet18_table.param_bytes  # one server: the whole model, AdamW


def test_sgd_without_momentum_keeps_no_state(resnet18_table):
    worker = price(resnet18_table, _query("ddp", optimizer="sgd", momentum=0.0))[0]
    assert worker.bytes["optimizer"] == 0
    assert price(resnet18_table, _query("ddp", optimizer="sgd", momentum=0.9))[0].bytes["optimizer"] == \
        resnet18_table.param_bytes


def test_recompute_prices_kept_inputs_and_one_rebuilt_unit(resnet18_table):
    plain = price(resnet18_table, _query("ddp", world=2, batch=8))[0]
    recomputed = price(resnet18_table, _query("ddp", world=2, batch=8, recompute=True))[0]
    assert recomputed.bytes["activations"] == resnet18_table.activation_bytes_recompute  # traced at 4 per rank
    assert recomputed.transient_bytes == resnet18_table.largest_unit_activation_bytes
    assert recomputed.total_bytes < plain.total_bytes


def test_pricing_reads_traits_not_names(resnet18_table):
    from dataclasses import replace

    fsdp = STRATEGY_SPECS.get("fsdp")()
    unsharded = MemoryQuery(traits=replace(fsdp.traits, shards_model_states=False), world_size=2, global_batch=8)
    assert price(resnet18_table, unsharded)[0].bytes["parameters"] == resnet18_table.param_bytes


# --------------------------------------------------------------------------- the command
def test_memory_json(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code = main(["memory", "torchvision:resnet18", "--strategy", "fsdp", "--world-size", "2", "--batch", "8",
                 "--cluster", "a100-80gb:1x2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 11_181_642 and out["world_size"] == 2 and out["global_batch"] == 8
    (est,) = out["estimates"]
    assert est["strategy"] == "fsdp" and est["per_rank_batch"] == 4 and est["fits"] is True
    worker = est["ranks"][0]
    assert set(worker["bytes"]) == {"parameters", "gradients", "optimizer", "activations", "buffers", "communication"}
    assert worker["bytes"]["parameters"] == 11_181_642 * F32 / 2
    assert worker["bytes"]["activations"] == 1_895_620  # measured by a 2-rank run of this experiment
    assert out["device"]["memory_bytes"] == 80 * 2**30


def test_memory_table_over_every_strategy(capsys):
    assert main(["memory", "module:examples.my_model:build", "-n", "2", "-b", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = {e["strategy"] for e in out["estimates"]}
    assert names == set(STRATEGY_SPECS.names())
    single = next(e for e in out["estimates"] if e["strategy"] == "single")
    assert "world_size" in single["unavailable"]


def test_large_model_does_not_fit(capsys):
    code = main(["memory", "hf:llama", "--strategy", "ddp", "--cluster", "h100:1x8", "--batch", "8",
                 "--set", "workload.hidden=4096", "--set", "workload.layers=32", "--set", "workload.heads=32",
                 "--set", "workload.kv_heads=8", "--set", "workload.intermediate=14336",
                 "--set", "workload.vocab=128256", "--set", "workload.seq_len=2048", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 8_030_261_248  # Llama 3 8B
    assert out["estimates"][0]["fits"] is False


@pytest.mark.parametrize("argv, message", [
    (["memory", "torchvision:resnet18", "--world-size", "0"], "error: --world-size = 0: must be >= 1"),
    (["memory", "torchvision:resnet18", "--cluster", "h100:1x8", "--world-size", "4"],
     "error: --world-size = 4 disagrees with --cluster h100:1x8 (8 GPUs); give one of them"),
])
def test_memory_bad_input(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == message and captured.out == ""
    assert list(tmp_path.iterdir()) == []  # nothing written


# --------------------------------------------------------------------------- estimate vs measurement
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_estimate_matches_a_measured_fsdp_run(tmp_path, capsys, monkeypatch):
    model = "module:examples.my_model:build"
    db = tmp_path / "m.db"
    ran = run_cli_here("run", "--workload", model, "--strategy", "fsdp", "--world-size", "2", "--steps", "2",
                  "--batch-size", "8", "--db", str(db), "--quiet", cwd=ROOT, timeout_s=200)
    assert ran.returncode == 0, ran.stderr
    from ddlscope.store import Store

    with Store(db) as store:
        run_id = store.list_runs()[0].id
        measured = {row["category"]: row["bytes"] for row in store.memory(run_id) if row["rank"] == 0}
    monkeypatch.chdir(ROOT)
    assert main(["memory", model, "--strategy", "fsdp", "-n", "2", "-b", "8", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)["estimates"][0]["ranks"][0]["bytes"]
    for category in ("parameters", "gradients", "optimizer", "activations"):
        assert estimate[category] == pytest.approx(measured[category], rel=0.05), category
