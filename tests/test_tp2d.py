"""2-D parallelism on a DeviceMesh: `tp` with `dp` = 2 on 4 ranks (FSDP2 over the dp dimension, tensor
parallel over the tp one) trains like one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddlscope.runtime.config import load_experiment
from ddlscope.specs import ConfigError
from ddlscope.workloads import WORKLOADS
from test_partitioned import _free_port, _records, _train

WORLD = 4
GPT = {"workload.name": "gpt-synthetic", "workload.layers": 2, "workload.hidden": 32, "workload.heads": 4,
       "workload.seq_len": 16, "workload.batch_size": 8, "workload.steps": 2, "workload.optimizer": "sgd",
       "workload.lr": 0.5, "workload.eval_batches": 1, "seed": 5}
TWO_D = {**GPT, "strategy.name": "tp", "strategy.dp": 2, "cluster.world_size": WORLD}


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        state, records = _train(TWO_D, rank, WORLD, Path(out) / f"2d-{rank}.jsonl")
        if rank == 0:
            torch.save(state, Path(out) / "2d.pt")
        (Path(out) / f"2d-{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_fsdp_x_tp_trains_like_one_process(tmp_path: Path):
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    single_overrides = {**GPT, "strategy.name": "single", "cluster.world_size": 1}
    single, single_rows = _train(single_overrides, 0, 1, tmp_path / "single.jsonl")
    two_d = torch.load(tmp_path / "2d.pt")
    assert list(two_d) == list(single)
    initial = WORKLOADS.get("gpt-synthetic").build(load_experiment(None, single_overrides).workload, 5).model
    moved = 0.0
    for name, before in initial.state_dict().items():
        torch.testing.assert_close(two_d[name], single[name], atol=1e-5, rtol=0)
        moved = max(moved, (single[name] - before).abs().max().item())
    assert moved > 1e-2
    single_losses = [r["loss"] for r in _records(single_rows, "step")]
    for rank in range(WORLD):  # each dp half's loss, averaged over dp: the whole batch's
        rows = json.loads((tmp_path / f"2d-{rank}.json").read_text())
        assert [r["loss"] for r in _records(rows, "step")] == pytest.approx(single_losses, abs=1e-5)
    # a rank holds 1/2 (tp) of the split weights, and FSDP 1/2 (dp) of everything: parameters of the
    # whole model / 4 for the split part, / 2 for the replicated part
    memory = _records(json.loads((tmp_path / "2d-0.json").read_text()), "memory")[0]["bytes"]
    split = sum(t.numel() for n, t in single.items()
                if n.startswith("blocks.") and ".ln_" not in n and not n.endswith("proj.bias"))
    rest = sum(t.numel() for t in single.values()) - split
    assert memory["parameters"] == pytest.approx(4 * (split / 4 + rest / 2), rel=0.02)


def test_dp_must_divide_the_world():
    with pytest.raises(ConfigError, match="strategy.dp"):
        load_experiment(None, {**TWO_D, "strategy.dp": 3})
