"""`fsdp` (FSDP2 fully_shard): same training as DDP, sharded model state, recorded communication."""

import sqlite3
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import run_cli_here
from phase_checks import assert_store_phases
from ddlscope.runtime.instrument import optimizer_state_bytes, parameter_bytes
from ddlscope.specs import ConfigError
from ddlscope.strategies.comm import CommRecorder, LinkModel, _RecordedWork
from ddlscope.strategies.fsdp import (
    FSDPSpec, _CollectiveTimer, _TimedAllGather, _TimedReduceScatter, mixed_precision_policy)
from ddlscope.strategies.units import wrap_units
from ddlscope.workloads import WORKLOADS

STEPS = 5
# Tiny GPT; every dim-0 size is even, so FSDP shards without padding on 2 ranks.
GPT = ("--workload", "gpt-synthetic", "--set", "workload.hidden=32", "--set", "workload.seq_len=16",
       "--batch-size", "8", "--seed", "1", "--set", 'workload.optimizer="adamw"')


def _query(folder: Path, sql: str, *params: object) -> list[tuple]:
    with sqlite3.connect(folder / "ddlscope.db") as conn:
        return conn.execute(sql, params).fetchall()


def _run(folder: Path, *args: str, timeout_s: float = 120) -> int:
    """Run one experiment in `folder`; return its run id."""
    result = run_cli_here("run", "--quiet", *args, cwd=folder, timeout_s=timeout_s)
    assert result.returncode == 0, result.stdout + result.stderr
    return _query(folder, "SELECT MAX(id) FROM runs")[0][0]


@pytest.fixture(scope="module")
def ddp_and_fsdp(tmp_path_factory):
    """The same 2-rank training under ddp and fsdp; evaluations every 2 steps run between steps."""
    folder = tmp_path_factory.mktemp("fsdp_vs_ddp")
    common = (*GPT, "--world-size", "2", "--steps", str(STEPS),
              "--set", "workload.eval_every=2", "--set", "workload.eval_batches=1")
    ddp = _run(folder, *common, "--strategy", "ddp", "--set", f'save_model_path="{folder / "ddp.pt"}"')
    fsdp = _run(folder, *common, "--strategy", "fsdp", "--set", f'save_model_path="{folder / "fsdp.pt"}"',
                "--set", f'checkpoint_dir="{folder / "checkpoint"}"')
    return folder, ddp, fsdp


def _gpt_model():
    workload = WORKLOADS.get("gpt-synthetic")
    return workload.build(workload.spec_class(name="gpt-synthetic", hidden=32, seq_len=16), 1).model


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_fsdp_trains_like_ddp(ddp_and_fsdp):
    folder, ddp, fsdp = ddp_and_fsdp
    per_step = "SELECT step, AVG(loss), COUNT(*) FROM steps WHERE run_id=? GROUP BY step ORDER BY step"
    ddp_losses, fsdp_losses = _query(folder, per_step, ddp), _query(folder, per_step, fsdp)
    assert [s for s, _, n in fsdp_losses if n == 2] == list(range(STEPS))
    for (step, ddp_loss, _), (_, fsdp_loss, _) in zip(ddp_losses, fsdp_losses):
        assert fsdp_loss == pytest.approx(ddp_loss, abs=1e-4), f"step {step}"
    evals = "SELECT step, loss FROM evals WHERE run_id=? ORDER BY step"
    assert [s for s, _ in _query(folder, evals, fsdp)] == [1, 3, 4]
    for (_, ddp_loss), (_, fsdp_loss) in zip(_query(folder, evals, ddp), _query(folder, evals, fsdp)):
        assert fsdp_loss == pytest.approx(ddp_loss, abs=1e-4)

    ddp_state, fsdp_state = torch.load(folder / "ddp.pt"), torch.load(folder / "fsdp.pt")
    assert fsdp_state.keys() == ddp_state.keys()
    for name, value in ddp_state.items():
        assert not hasattr(fsdp_state[name], "to_local"), f"{name} saved as a shard"
        torch.testing.assert_close(fsdp_state[name], value, atol=1e-4, rtol=0)
    # Training moved the parameters, so the comparison is not trivially true.
    initial = _gpt_model().state_dict()
    assert max((fsdp_state[n] - initial[n]).abs().max().item() for n in initial) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_fsdp_records_every_collective(ddp_and_fsdp):
    folder, _, fsdp = ddp_and_fsdp
    rows = _query(folder, "SELECT step, bytes_sent, comm_s, comm_wait_s, backward_s FROM steps WHERE run_id=?", fsdp)
    assert len(rows) == 2 * STEPS
    model = _gpt_model()
    params = sum(p.numel() for p in model.parameters())
    block_params = sum(p.numel() for p in model.blocks.parameters())
    # fp32, 2 ranks: forward all-gathers every shard (half of each unit), backward gathers
    # the blocks again (resharded after forward; the root is kept), reduce-scatter sends
    # each unit's full gradients.
    expected = 4 * (params // 2 + block_params // 2 + params)
    # All ranks evaluate together after steps 1 and 3; the root is not resharded after
    # a forward, so the training forward right after an evaluation skips its all-gather.
    after_eval = expected - 4 * ((params - block_params) // 2)
    for step, bytes_sent, comm_s, comm_wait_s, backward_s in rows:
        assert bytes_sent == (after_eval if step in (2, 4) else expected), f"step {step}"
        assert comm_s > 0
        assert 0 < comm_wait_s <= comm_s + 0.05  # blocked collectives (+ a no-op synchronize)
        assert backward_s > 0
    assert assert_store_phases(folder / "ddlscope.db") == {"ddp", "fsdp"}


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp_writes_a_dcp_checkpoint_of_the_final_model(ddp_and_fsdp):
    import torch.distributed.checkpoint as dcp

    folder, _, _ = ddp_and_fsdp
    sealed = sorted((folder / "checkpoint").glob("step-*"))  # naming checkpoint_dir checkpoints the last step
    assert [p.name for p in sealed] == [f"step-{STEPS:08d}"]
    checkpoint = sealed[0]
    assert (checkpoint / "manifest.json").exists() and (checkpoint / ".metadata").exists() and len(list(checkpoint.glob("*.distcp"))) == 2
    state = {"model": {k: torch.zeros_like(v) for k, v in _gpt_model().state_dict().items()}}
    dcp.load(state, checkpoint_id=str(checkpoint))  # one process reads both ranks' shards
    final = torch.load(folder / "fsdp.pt")
    for name, value in final.items():
        torch.testing.assert_close(state["model"][name], value, atol=0, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_optimizer_state_is_two_adam_moments_and_fsdp_halves_it(ddp_and_fsdp):
    folder, ddp, fsdp = ddp_and_fsdp
    state = {}
    for strategy, run_id in (("ddp", ddp), ("fsdp", fsdp)):
        rows = _query(folder, "SELECT rank, category, bytes FROM memory WHERE run_id=? AND category IN "
                              "('parameters', 'optimizer')", run_id)
        state[strategy] = {(rank, category): b for rank, category, b in rows}
    params = sum(p.numel() for p in _gpt_model().parameters())
    for rank in (0, 1):
        # fp32 AdamW: exp_avg and exp_avg_sq of every parameter, 1-D norms and biases included
        assert state["ddp"][rank, "parameters"] == 4 * params
        assert state["ddp"][rank, "optimizer"] == 2 * 4 * params, f"ddp rank {rank}"
        # Every dim-0 size is even: each rank holds exactly half, not less (state lost) nor more.
        assert state["fsdp"][rank, "optimizer"] == state["ddp"][rank, "optimizer"] // 2, f"fsdp rank {rank}"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_fsdp_shards_model_state_over_4_ranks(tmp_path):
    common = ("--workload", "gpt-synthetic", "--world-size", "4", "--set", "workload.layers=2",
              "--set", "workload.hidden=256", "--set", "workload.seq_len=16", "--batch-size", "4",
              "--steps", "2", "--set", 'workload.optimizer="adamw"', "--set", "workload.eval_batches=1")
    runs = {s: _run(tmp_path, *common, "--strategy", s) for s in ("ddp", "fsdp")}
    peak = {}
    for strategy, run_id in runs.items():
        per_rank = _query(tmp_path, "SELECT rank, SUM(bytes) FROM memory WHERE run_id=? AND category IN "
                                    "('parameters', 'gradients', 'optimizer') GROUP BY rank", run_id)
        assert len(per_rank) == 4
        peak[strategy] = max(b for _, b in per_rank)
    ratio = peak["fsdp"] / peak["ddp"]
    print(f"model-state bytes per rank: fsdp {peak['fsdp']} / ddp {peak['ddp']} = {ratio:.3f}")
    assert ratio <= 0.35


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_fsdp_whole_model_unit_in_bf16(tmp_path):
    run_id = _run(tmp_path, "--workload", "mlp-digits", "--strategy", "fsdp", "--world-size", "2",
                  "--steps", "3", "--batch-size", "32", "--set", 'strategy.wrap="model"',
                  "--set", 'strategy.mixed_precision="bf16"', "--set", "strategy.reshard_after_forward=false")
    assert _query(tmp_path, "SELECT status FROM runs WHERE id=?", run_id) == [("finished",)]
    params = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    # one unit, 2 ranks: bf16 all-gather of this rank's half, fp32 reduce-scatter of all gradients
    expected = 2 * params // 2 + 4 * params
    rows = _query(tmp_path, "SELECT bytes_sent, loss FROM steps WHERE run_id=?", run_id)
    assert len(rows) == 6 and all(b == expected and loss == loss for b, loss in rows)
    (metric,) = _query(tmp_path, "SELECT metric FROM evals WHERE run_id=?", run_id)[0]
    assert 0 <= metric <= 1


# --- in-process: knobs, units, precision policy --------------------------------


def test_fsdp_knobs_are_validated():
    spec = FSDPSpec()
    assert (spec.reshard_after_forward, spec.wrap, spec.mixed_precision) == (True, "block", "none")
    with pytest.raises(ValueError):
        FSDPSpec(mixed_precision="fp16")
    with pytest.raises(ValueError):
        FSDPSpec(wrap="layer")


def test_wrap_units_are_transformer_blocks_or_top_level_children():
    gpt = _gpt_model()
    assert wrap_units(gpt) == list(gpt.blocks)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert wrap_units(mlp) == [mlp[0], mlp[2]]


def test_bf16_is_refused_on_a_gpu_without_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(ConfigError, match="bf16"):
        mixed_precision_policy("bf16", torch.device("cuda", 0))
    assert mixed_precision_policy("bf16", torch.device("cpu")).param_dtype == torch.bfloat16
    assert mixed_precision_policy("none", torch.device("cuda", 0)).param_dtype is None


def test_timed_collectives_record_sync_and_async_ops():
    """Sync ops complete when they return; an async op completes in its Work's wait(),
    after what the emulated link still owes (here 20 ms of latency)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        recorder = CommRecorder(LinkModel(alpha_s=0.02, bandwidth_bytes_per_s=1e12), ranks=1)
        timer = _CollectiveTimer(recorder)
        group = dist.group.WORLD
        shard, full = torch.ones(8), torch.zeros(8)
        assert _TimedAllGather(timer)(full, shard, group) is None
        work = _TimedReduceScatter(timer)(torch.zeros(8), full, group, dist.ReduceOp.SUM, async_op=True)
        assert isinstance(work, _RecordedWork) and isinstance(work, dist.Work)
        began = time.perf_counter()
        work.wait()
        assert time.perf_counter() - began >= 0.015 and work.is_completed()
        blocked = timer.pop_blocked()
        assert len(blocked) == 2 and all(s >= 0 for _, s in blocked)
        stats = recorder.pop(time.perf_counter())
        assert stats.bytes_sent == 2 * 8 * 4 and stats.total_s >= 0.02
        torch.testing.assert_close(full, shard)
    finally:
        dist.destroy_process_group()


def test_optimizer_state_counts_both_adam_moments_of_every_parameter():
    # Biases and norm weights are 1-D; they hold state too. Adam keeps exp_avg and exp_avg_sq
    # (each the parameter's size and dtype) plus a 0-d `step` per parameter, which the count leaves out.
    model = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    assert parameter_bytes(model) == 4 * (6 * 4 + 4 + 4 + 4)
    assert optimizer_state_bytes(optimizer) == 2 * parameter_bytes(model)
