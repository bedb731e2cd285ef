"""2-D parallelism on a DeviceMesh, 4 ranks: `tp` with `dp` = 2 (FSDP2 over the dp dimension, tensor
parallel over the tp one) and `pipeline` with `dp` = 2 (two 2-stage 1F1B pipelines whose stages average
gradients) train like one process. Both run in one process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddlscope.runtime.config import load_experiment
from ddlscope.specs import ConfigError
from ddlscope.workloads import WORKLOADS
from rank_runs import records as _records
from rank_runs import spawn_runs
from rank_runs import train_rank as _train

WORLD = 4
GPT = {"workload.name": "gpt-synthetic", "workload.layers": 2, "workload.hidden": 32, "workload.heads": 4,
       "workload.seq_len": 16, "workload.batch_size": 8, "workload.steps": 2, "workload.optimizer": "sgd",
       "workload.lr": 0.5, "workload.eval_batches": 1, "seed": 5}
RUNS = {"fsdp-tp": {**GPT, "strategy.name": "tp", "strategy.dp": 2, "cluster.world_size": WORLD},
        "dp-pp": {**GPT, "strategy.name": "pipeline", "strategy.schedule": "1f1b", "strategy.micro_batches": 2,
                  "strategy.dp": 2, "cluster.world_size": WORLD}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mesh2d")
    spawn_runs(out, WORLD, [(name, overrides, None) for name, overrides in RUNS.items()])
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(RUNS))
def test_2d_mesh_trains_like_one_process(runs: Path, name: str):
    tmp_path = runs
    single_overrides = {**GPT, "strategy.name": "single", "cluster.world_size": 1}
    single, single_rows = _train(single_overrides, 0, 1, tmp_path / f"single-{name}.jsonl")
    two_d = torch.load(tmp_path / f"{name}.pt")
    assert list(two_d) == list(single)
    initial = WORKLOADS.get("gpt-synthetic").build(load_experiment(None, single_overrides).workload, 5).model
    moved = 0.0
    for key, before in initial.state_dict().items():
        torch.testing.assert_close(two_d[key], single[key], atol=1e-5, rtol=0)
        moved = max(moved, (single[key] - before).abs().max().item())
    assert moved > 1e-2
    single_losses = [r["loss"] for r in _records(single_rows, "step")]
    for rank in range(WORLD):  # each dp half's loss, averaged over dp: the whole batch's
        rows = json.loads((tmp_path / f"{name}-{rank}.json").read_text())
        assert [r["loss"] for r in _records(rows, "step")] == pytest.approx(single_losses, abs=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_fsdp_x_tp_shards_both_ways(runs: Path):
    single = torch.load(runs / "dp-pp.pt")  # the whole model (equal to one process's, tested above)
    # a rank holds 1/2 (tp) of the split weights, and FSDP 1/2 (dp) of everything: parameters of the
    # whole model / 4 for the split part, / 2 for the replicated part
    memory = _records(json.loads((runs / "fsdp-tp-0.json").read_text()), "memory")[0]["bytes"]
    split = sum(t.numel() for n, t in single.items()
                if n.startswith("blocks.") and ".ln_" not in n and not n.endswith("proj.bias"))
    rest = sum(t.numel() for t in single.values()) - split
    assert memory["parameters"] == pytest.approx(4 * (split / 4 + rest / 2), rel=0.02)


@pytest.mark.parametrize("name", list(RUNS))
def test_dp_must_divide_the_world(name: str):
    with pytest.raises(ConfigError, match="strategy.dp"):
        load_experiment(None, {**RUNS[name], "strategy.dp": 3})
