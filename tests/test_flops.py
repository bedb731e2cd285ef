"""Model FLOPs per step (counted with FlopCounterMode) and MFU / HFU in the summary."""

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from conftest import run_cli_here
from ddlscope.runtime.flops import count_step_flops, gpt_closed_form_flops, parse_flops_message
from ddlscope.workloads import WORKLOADS

TINY = ("--workload", "gpt-synthetic", "--set", "workload.hidden=32", "--set", "workload.seq_len=16",
        "--batch-size", "8", "--steps", "4", "--seed", "1")


def _gpt(**knobs):
    workload = WORKLOADS.get("gpt-synthetic")
    spec = workload.spec_class(name="gpt-synthetic", **knobs)
    return spec, workload.build(spec, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("knobs,batch", [({}, 4), ({"hidden": 256, "layers": 4, "seq_len": 128}, 2)])
def test_counted_flops_match_the_closed_form(knobs, batch):
    spec, task = _gpt(**knobs)
    x, y = task.train.get(torch.arange(batch))
    counted = count_step_flops(task.model, task.loss_fn, x, y)
    closed = gpt_closed_form_flops(batch, spec.seq_len, spec.layers, spec.hidden, spec.vocab_size)
    assert counted.per_rank_batch == batch
    assert counted.hardware_flops == counted.model_flops  # no recomputation anywhere in ddlscope
    assert counted.model_flops == pytest.approx(closed, rel=0.05)


@pytest.mark.timeout(60)
def test_counting_leaves_the_model_and_rng_alone():
    _, task = _gpt(hidden=32, seq_len=16, dropout=0.1)
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    rng = torch.get_rng_state()
    x, y = task.train.get(torch.arange(4))
    count_step_flops(task.model, task.loss_fn, x, y)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in task.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in task.model.state_dict().items())
    assert next(task.model.parameters()).device.type == "cpu"


def test_counted_flops_scale_with_the_batch():
    _, task = _gpt(hidden=32, seq_len=16)
    small, large = (count_step_flops(task.model, task.loss_fn, *task.train.get(torch.arange(b))).model_flops
                    for b in (2, 4))
    assert large == 2 * small


@lru_cache(maxsize=None)
def _run(folder: str, strategy: str, world: int) -> tuple[dict, list[dict]]:
    result = run_cli_here("run", "--quiet", "--json", *TINY, "--strategy", strategy, "--world-size", str(world),
                     "--name", f"{strategy}{world}", cwd=Path(folder), timeout_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)
    events = run_cli_here("export", summary["run"]["name"], "--format", "json", cwd=Path(folder), timeout_s=30)
    assert events.returncode == 0, events.stderr
    flops = [parse_flops_message(e["message"]) | {"rank": e["rank"]}
             for e in json.loads(events.stdout)["events"] if e["kind"] == "flops"]
    return summary, flops


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mfu"))


def _check_bounds(summary: dict, flops: list[dict], world: int) -> None:
    assert 0 < summary["mfu"] <= 1
    assert 0 < summary["hfu"] <= 1 and summary["hfu"] == pytest.approx(summary["mfu"])
    assert set(summary["mfu_by_rank"]) == {str(r) for r in range(world)}
    assert all(0 < v <= 1 for v in summary["mfu_by_rank"].values())
    step_s = summary["cpu_derived_step_s"] if summary["oversubscribed"] else summary["mean_step_s"]
    assert summary["achieved_flops_per_s"] == pytest.approx(summary["model_flops_per_step"] / step_s)
    # per rank: that rank's FLOPs over the step time over that rank's own peak
    for f in flops:
        expected = float(f["model_flops_per_step"]) / step_s / float(f["peak_flops_per_s"])
        assert summary["mfu_by_rank"][str(f["rank"])] == pytest.approx(expected, rel=1e-9)


@pytest.mark.multiprocess
@pytest.mark.timeout(40)
def test_mfu_single(folder):
    summary, flops = _run(folder, "single", 1)
    _check_bounds(summary, flops, 1)
    assert [int(f["per_rank_batch"]) for f in flops] == [8]
    assert summary["model_flops_per_step"] == pytest.approx(gpt_closed_form_flops(8, 16, 2, 32, 256), rel=0.08)


@pytest.mark.multiprocess
@pytest.mark.timeout(40)
def test_mfu_ddp_counts_the_per_rank_batch(folder):
    summary, flops = _run(folder, "ddp", 2)
    _check_bounds(summary, flops, 2)
    assert sorted(f["rank"] for f in flops) == [0, 1]
    assert {int(f["per_rank_batch"]) for f in flops} == {4}
    single, _ = _run(folder, "single", 1)  # same global batch on one rank: twice the FLOPs per rank
    assert summary["model_flops_per_step"] * 2 == pytest.approx(single["model_flops_per_step"])


@pytest.mark.multiprocess
@pytest.mark.timeout(40)
def test_mfu_fsdp_does_not_divide_compute_by_sharding(folder):
    summary, flops = _run(folder, "fsdp", 2)
    _check_bounds(summary, flops, 2)
    assert {int(f["per_rank_batch"]) for f in flops} == {4}
    # Sharding splits parameters, not compute: each rank runs the whole model on its batch.
    _, task = _gpt(hidden=32, seq_len=16)
    whole = count_step_flops(task.model, task.loss_fn, *task.train.get(torch.arange(4))).model_flops
    assert summary["model_flops_per_step"] == whole
