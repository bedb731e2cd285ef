"""The local SGD family's rules and estimators, without a multi-rank run: schedules, CoCoD's merge on a
one-rank gloo group, and what the estimators must do with period, overlap, staleness and a straggler."""

from __future__ import annotations

import pytest
import torch

from ddlscope.specs.strategies.hpsgd import HPSGDSpec
from ddlscope.specs.strategies.localsgd import CoCoDSpec, DiLoCoSpec, LocalSGDSpec
from ddlscope.specs.strategies.osp import OSPSpec


def test_osp_first_stage_takes_the_most_important_tensors_up_to_the_fraction_of_bytes():
    importance, sizes = [0.1, 0.9, 0.5, 0.7], [100, 100, 300, 500]
    # 1 (100 bytes), then 3 would make 600 of 1000 > 50%: passed over for 2 (400), then 0 (500)
    assert OSPSpec(fraction=0.5).first_stage(importance, sizes) == [0, 1, 2]
    assert OSPSpec(fraction=0.05).first_stage(importance, sizes) == [1]  # the most important always goes
    assert OSPSpec(fraction=1.0).first_stage(importance, sizes) == [0, 1, 2, 3]


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _torch_schedule(averager, monkeypatch, steps: int) -> list[int]:
    """The steps after which torch's averager averages, seen by replacing its all-reduce."""
    from torch.distributed.algorithms.model_averaging import utils

    seen: list[int] = []
    monkeypatch.setattr(utils, "average_parameters_or_parameter_groups", lambda *_: seen.append(averager.step))
    for _ in range(steps):
        averager.average_parameters([torch.nn.Parameter(torch.zeros(1))])
    return seen


@pytest.mark.timeout(60)
def test_averaging_schedule_is_torchs(one_rank_group, monkeypatch):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager

    spec = LocalSGDSpec(period=3, warmup_steps=2)
    mine = [s for s in range(12) if spec.averages_after(s)]
    assert mine == [2, 5, 8, 11]
    assert _torch_schedule(PeriodicModelAverager(3, 2), monkeypatch, 12) == mine
    assert [s for s in range(5) if LocalSGDSpec(period=1).averages_after(s)] == [0, 1, 2, 3, 4]
    hierarchical = LocalSGDSpec(period=4, group_period=2, warmup_steps=1)
    assert [hierarchical.averages_after(s) for s in range(9)] == [
        None, None, "group", None, "all", None, "group", None, "all"]
    assert _torch_schedule(HierarchicalModelAverager({2: 1, 4: 1}, 1), monkeypatch, 9) == [2, 4, 6, 8]
    assert hierarchical.averages_per_step() == pytest.approx(0.5)
    assert DiLoCoSpec().period == 20 and DiLoCoSpec(group_period=5).averages_after(20) == "all"


def test_hpsgd_applies_each_average_once_and_drains_at_the_last_step():
    spec, last = HPSGDSpec(staleness=2), 6
    applied = [s for step in range(last + 1) for s in spec.applies_after(step, last)]
    assert applied == list(range(last + 1))  # every step's average, once, in order
    assert spec.applies_after(1, last) == [] and spec.applies_after(3, last) == [1]
    assert HPSGDSpec(staleness=0).applies_after(3, last) == [3]


@pytest.mark.timeout(60)
def test_cocod_keeps_the_progress_made_while_the_average_was_in_flight(one_rank_group):
    from ddlscope.runtime.config import load_experiment
    from ddlscope.strategies import RunContext
    from ddlscope.strategies.localsgd import CoCoD

    exp = load_experiment(None, {"strategy.name": "cocod", "strategy.period": 2, "cluster.world_size": 1,
                                 "workload.steps": 10})
    model = torch.nn.Linear(3, 1)
    strategy = CoCoD(exp.strategy, RunContext(0, 1, 0, 0, torch.device("cpu"), "gloo", exp))
    strategy.model = strategy.wrap(model)
    strategy.average(0)  # launches the average of the current model
    snapshot = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # local steps while it is in flight
    strategy.average(1)  # not due: nothing lands
    assert strategy.in_flight is not None
    strategy.average(2)  # lands: average (one rank: the snapshot) + progress since the snapshot
    for p, s in zip(model.parameters(), snapshot):
        torch.testing.assert_close(p.detach(), s + 1.0)
    assert strategy.comm.pop(0.0).bytes_sent == 2 * sum(p.numel() * 4 for p in model.parameters())


# ---------------------------------------------------------------------------- estimators
def _cluster_estimate(spec, slowdowns=None):
    from ddlscope.predict.catalogue import make_cluster
    from ddlscope.predict.estimators import ClusterCase, estimator_for
    from ddlscope.predict.strategies import ServerSpec, image_workload

    workload = image_workload("resnet50", batch_per_worker=32)
    cluster = make_cluster("a100-80gb", 4, 8)
    n = cluster.n_gpus
    case = ClusterCase(workload=workload, cluster=cluster, stragglers=max(slowdowns or [1.0]),
                       slowdowns=slowdowns and [1.0] * (n - 1) + [slowdowns[0]], server=ServerSpec(),
                       activation_bytes=1e9, weight_bytes_per_param=4.0, optimizer_bytes_per_param=8.0)
    return estimator_for(spec).cluster(spec, case), estimator_for(spec).cluster_memory(spec, case)[0]


def test_cluster_estimates_order_the_family_as_their_mechanisms_imply():
    from ddlscope.specs.strategies.ddp import DDPSpec

    ddp, _ = _cluster_estimate(DDPSpec())
    every, _ = _cluster_estimate(LocalSGDSpec(period=1))
    rare, mem_rare = _cluster_estimate(LocalSGDSpec(period=16))
    cocod, mem_cocod = _cluster_estimate(CoCoDSpec(period=16))
    stale0, _ = _cluster_estimate(HPSGDSpec(staleness=0))
    stale1, mem_stale1 = _cluster_estimate(HPSGDSpec(staleness=1))
    assert rare.compute_s == pytest.approx(every.compute_s)
    # period 16 pays 1/16 of the average: its exposed communication is exactly that share
    assert rare.exposed_comm_s == pytest.approx(every.exposed_comm_s / 16, rel=1e-9)
    assert cocod.step_s <= rare.step_s < every.step_s
    assert 0 <= stale1.exposed_comm_s <= stale0.exposed_comm_s and stale1.step_s <= stale0.step_s
    assert stale0.exposed_comm_s == pytest.approx(stale0.comm_s)  # nothing hides a staleness-0 all-reduce
    # a model copy is 4 bytes x 25.6 M parameters: cocod keeps two, hpsgd at staleness 1 two, localsgd one
    copy_bytes = 4.0 * image_params()
    assert mem_cocod - mem_rare == pytest.approx(copy_bytes, rel=1e-6)
    assert mem_stale1 - mem_rare == pytest.approx(copy_bytes, rel=1e-6)
    assert 0.2 < ddp.step_s / every.step_s < 5  # same compute, comparable all-reduce


def image_params() -> float:
    from ddlscope.predict.strategies import image_workload

    return image_workload("resnet50", batch_per_worker=32).params


def test_a_straggler_holds_every_synchronising_strategy():
    for spec in (LocalSGDSpec(period=8), HPSGDSpec(), DiLoCoSpec()):
        even, _ = _cluster_estimate(spec)
        slow, _ = _cluster_estimate(spec, slowdowns=[2.0])
        assert slow.step_s - even.step_s == pytest.approx(even.compute_s, rel=1e-9)  # one more compute time
        assert slow.samples_per_s == pytest.approx(even.samples_per_s * even.step_s / slow.step_s, rel=1e-9)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides", [
    {"strategy.name": "hpsgd", "strategy.staleness": 2},
    {"strategy.name": "osp", "strategy.fraction": 0.5},
    {"strategy.name": "diloco", "strategy.period": 2},
    {"strategy.name": "localsgd", "strategy.period": 2, "strategy.warmup_steps": 2},
])
def test_a_restart_from_the_strategy_state_continues_like_an_uninterrupted_run(one_rank_group, overrides):
    """What a checkpoint keeps (owed averages, second stages, the anchor, the step) is enough to go on."""
    import contextlib

    from ddlscope.runtime.config import load_experiment
    from ddlscope.strategies import RunContext, runtime_class

    exp = load_experiment(None, {**overrides, "cluster.world_size": 1, "workload.steps": 6,
                                 "workload.momentum": 0.5})
    ctx = RunContext(0, 1, 0, 0, torch.device("cpu"), "gloo", exp)
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(6)]

    class Timer:
        def phase(self, _name: str):
            return contextlib.nullcontext()

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        strategy = runtime_class(exp.strategy)(exp.strategy, ctx)
        model = strategy.wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        strategy.attach(model, optimizer, torch.nn.functional.cross_entropy)
        return strategy, model, optimizer

    whole, whole_model, _ = fresh()
    for batch in batches:
        whole.train_step(batch, Timer())
    first, first_model, first_opt = fresh()
    for batch in batches[:3]:
        first.train_step(batch, Timer())
    saved = (first.checkpoint_state(), first_model.state_dict(), first_opt.state_dict())
    second, second_model, second_opt = fresh()
    second_model.load_state_dict(saved[1])
    second_opt.load_state_dict(saved[2])
    second.restore_checkpoint_state(saved[0])
    for batch in batches[3:]:
        second.train_step(batch, Timer())
    for a, b in zip(whole_model.parameters(), second_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
