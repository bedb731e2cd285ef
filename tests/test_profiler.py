"""The step profiler (runtime/profiler.py): one count of a step's FLOPs, GEMMs, bytes and ops for every reader."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddlscope.runtime.profiler import first_batch, optimizer_states_per_param, profile_step, profile_task
from ddlscope.strategies.units import wrap_units
from ddlscope.workloads import WORKLOADS


def _sum_loss(out: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
    return out.sum()  # its backward saves nothing: what is saved comes from the model


def test_one_linear_layer_by_hand():
    """Linear(4, 3) on 2 samples: addmm forward (2 x 4 x 3) and the weight gradient's mm (3 x 2 x 4);
    autograd saves the input (2 x 4 fp32 = 32 bytes) and a view of the weight, which is no activation."""
    layer = nn.Linear(4, 3)
    step = profile_step(layer, _sum_loss, torch.randn(2, 4), torch.zeros(2), count_ops=True)
    assert step.flops == 2 * (2 * 2 * 4 * 3)
    assert step.linear_gemms == ((2, 3, 4),)
    assert step.activation_bytes == 2 * 4 * 4
    assert step.param_numel == (12, 3) and step.param_dim0 == (3, 3)
    assert step.param_bytes == step.gradient_bytes == 15 * 4
    assert step.optimizer_bytes("adamw", 0.0) == 2 * 15 * 4 and step.optimizer_bytes("sgd", 0.0) == 0
    assert step.counted_on == "meta" and step.batch == 2
    assert step.ops is not None and step.ops.ops > 0
    assert sorted((mm.m, mm.k, mm.n) for mm in step.ops.matmuls) == [(2, 4, 3), (3, 2, 4)]
    assert sum(mm.flops for mm in step.ops.matmuls) == step.flops
    assert all(p.grad is None for p in layer.parameters())  # counted on copies


def test_convolutions_are_counted_as_their_implicit_gemms():
    """Conv2d(4, 6, 3, stride 2, padding 1) on 2 x 4 x 8 x 8 (out 2 x 6 x 4 x 4): forward (N Ho Wo = 32) x
    (C_in kh kw = 36) @ (36 x 6); the backward's input and weight gradients, the same multiply-adds each
    (written in the forward's orientation). A first layer (input without grad) has no input-gradient
    GEMM. Their FLOPs equal torch's FLOP counter's; a grouped conv divides k and n by the groups and
    multiplies the batch (torch's counter counts grouped backward differently, so only by hand)."""
    net = nn.Sequential(nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1))
    step = profile_step(net, _sum_loss, torch.randn(2, 4, 8, 8), torch.zeros(2), count_ops=True)
    assert step.ops is not None
    shapes = sorted((mm.batch, mm.m, mm.k, mm.n) for mm in step.ops.matmuls)
    assert shapes == sorted([(1, 32, 36, 6)] * 2 + [(1, 32, 54, 6)] * 3)
    assert sum(mm.flops for mm in step.ops.matmuls) == step.flops
    grouped = nn.Sequential(nn.Conv2d(4, 6, 1), nn.Conv2d(6, 6, 3, padding=1, groups=3))
    step = profile_step(grouped, _sum_loss, torch.randn(2, 4, 8, 8), torch.zeros(2), count_ops=True)
    assert step.ops is not None
    assert sorted((mm.batch, mm.m, mm.k, mm.n) for mm in step.ops.matmuls)[-3:] == [(3, 128, 18, 2)] * 3


def test_units_follow_the_fsdp_rule():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    step = profile_step(mlp, _sum_loss, torch.randn(3, 4), torch.zeros(3))
    assert step.units == len(wrap_units(mlp)) == 2
    assert step.unit_param_numel == (40, 18) and step.root_param_numel == 0
    gpt = WORKLOADS.get("gpt-synthetic").build(WORKLOADS.get("gpt-synthetic").spec_class(hidden=32, seq_len=8), 0)
    step = profile_task(gpt, 2)
    assert step.units == len(gpt.model.blocks) == 2
    assert sum(step.unit_param_numel) + step.root_param_numel == step.params  # embeddings, ln_f, lm_head: the root


def test_optimizer_states():
    assert [optimizer_states_per_param(*o) for o in (("adamw", 0.0), ("sgd", 0.9), ("sgd", 0.0))] == [2, 1, 0]


def test_op_counts_need_a_real_model():
    with torch.device("meta"):
        layer = nn.Linear(4, 3)
    assert profile_step(layer, _sum_loss, torch.randn(2, 4), torch.zeros(2)).flops == 96  # shapes work on meta
    with pytest.raises(ValueError, match="real model"):
        profile_step(layer, _sum_loss, torch.randn(2, 4), torch.zeros(2), count_ops=True)


def test_real_data_with_a_meta_model_gpt_char():
    """gpt-char built under the meta device keeps its corpus on the CPU (read from package data):
    the batch is taken with CPU ids and moved, and the profile equals the real model's."""
    workload = WORKLOADS.get("gpt-char")
    spec = workload.spec_class(hidden=32, seq_len=16)
    with torch.device("meta"):
        on_meta = workload.build(spec, 0)
    assert next(on_meta.model.parameters()).device.type == "meta"
    assert first_batch(on_meta.train, 3)[0].device.type == "cpu"
    real = workload.build(spec, 0)
    assert profile_task(on_meta, 3) == profile_task(real, 3)
