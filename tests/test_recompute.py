"""`workload.recompute` (workloads/recompute.py): none, selective and full give the same gradients, and the
activations autograd keeps per block are what Korthikanti et al. 2022 count, as the step's meter sees them."""

from __future__ import annotations

import pytest
import torch

from ddlscope.runtime.config import load_experiment
from ddlscope.runtime.instrument import ActivationMeter
from ddlscope.specs import ConfigError
from ddlscope.workloads import WORKLOADS

BATCH, SEQ, HIDDEN, HEADS = 4, 16, 32, 4
GPT = {"workload.name": "gpt-synthetic", "workload.hidden": HIDDEN, "workload.heads": HEADS,
       "workload.seq_len": SEQ, "workload.batch_size": BATCH, "workload.samples": 64}
VISION = {"workload.batch_size": 8, "workload.samples": 16, "workload.test_samples": 10, "workload.width": 8}


def _step(overrides: dict) -> tuple[dict[str, torch.Tensor], int, float]:
    """One forward and backward on a fixed batch: the gradients, the activation bytes the meter saw, the loss."""
    exp = load_experiment(None, overrides)
    task = WORKLOADS.get(exp.workload.name).build(exp.workload, 3)
    x, y = task.train.get(torch.arange(exp.workload.batch_size))
    meter = ActivationMeter(task.model)
    with meter.measure():
        loss = task.loss_fn(task.model(x), y)
    loss.backward()
    return {name: p.grad for name, p in task.model.named_parameters()}, meter.bytes, loss.item()


@pytest.mark.parametrize("overrides", [
    {**GPT, "workload.layers": 2},
    {**VISION, "workload.name": "resnet-cifar", "workload.blocks": 1},
    {**VISION, "workload.name": "vgg-cifar"},
    {**VISION, "workload.name": "convnext-cifar"},
], ids=["gpt", "resnet", "vgg", "convnext"])
def test_recompute_gives_the_same_gradients_and_keeps_less(overrides: dict):
    modes = ["none", "full"] + (["selective"] if overrides["workload.name"].startswith("gpt") else [])
    runs = {mode: _step({**overrides, "workload.recompute": mode}) for mode in modes}
    plain_grads, plain_bytes, plain_loss = runs["none"]
    for mode in modes[1:]:
        grads, kept, loss = runs[mode]
        assert loss == plain_loss
        for name, grad in plain_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6)
        assert 0 < kept < plain_bytes, (mode, kept, plain_bytes)


def _per_block_bytes(mode: str) -> int:
    """What one more block adds to the kept activations (the embedding, head and loss cancel out)."""
    return _step({**GPT, "workload.layers": 3, "workload.recompute": mode})[1] - \
        _step({**GPT, "workload.layers": 2, "workload.recompute": mode})[1]


def test_a_fully_recomputed_block_keeps_exactly_its_input():
    """Korthikanti's 2 s b h bytes of a 16-bit input: 4 s b h in fp32."""
    assert _per_block_bytes("full") == 4 * SEQ * BATCH * HIDDEN


def test_a_block_keeps_16_sbh_floats_and_selective_drops_the_attention_cores_log_sum_exp():
    """Without recompute, in fp32 without dropout, a block keeps 16 s b h floats (its input and norm outputs,
    q k v, the attention output, the MLP's 4h wide input and GeLU output), the attention's log-sum-exp per
    head and token, and each LayerNorm's mean and 1/std per token. Fused attention (SDPA) keeps no s x s
    scores, so Korthikanti's selective recompute, which exists to drop those (5 a s / h of
    s b h (34 + 5 a s / h)), frees only the log-sum-exp here."""
    sbh = SEQ * BATCH * HIDDEN
    log_sum_exp = BATCH * HEADS * SEQ * 4
    norm_statistics = 2 * 2 * BATCH * SEQ * 4
    plain = _per_block_bytes("none")
    assert plain == 16 * 4 * sbh + log_sum_exp + norm_statistics
    assert _per_block_bytes("selective") == plain - log_sum_exp


def test_evaluation_under_recompute_runs_plainly():
    exp = load_experiment(None, {**GPT, "workload.layers": 2, "workload.recompute": "full"})
    task = WORKLOADS.get("gpt-synthetic").build(exp.workload, 3)
    x, _ = task.train.get(torch.arange(BATCH))
    with torch.no_grad():
        assert task.model(x).shape == (BATCH, SEQ, exp.workload.vocab_size)


def test_selective_recompute_is_refused_for_a_network_without_attention():
    with pytest.raises(ConfigError, match="recompute"):
        load_experiment(None, {**VISION, "workload.name": "resnet-cifar", "workload.recompute": "selective"})


@pytest.mark.parametrize("mode, extra_forwards", [("none", 0), ("full", 1)])
def test_the_profile_counts_model_flops_once_and_hardware_flops_as_the_step_runs_them(mode, extra_forwards):
    """Model FLOPs and the GEMMs are the model's whatever the recompute, the activations what it keeps; hardware FLOPs
    add one forward of each recomputed block (REFERENCE.md: 96 against 72 per B s l h^2, blocks only), less
    each block's last GEMM: torch's checkpoint stops re-running a block once the tensors its backward needs
    are rebuilt, and nothing needs the MLP projection's output."""
    from ddlscope.runtime.profiler import profile_step

    def profile(recompute: str):
        exp = load_experiment(None, {**GPT, "workload.layers": 2, "workload.recompute": recompute})
        task = WORKLOADS.get("gpt-synthetic").build(exp.workload, 3)
        x, y = task.train.get(torch.arange(BATCH))
        return profile_step(task.model, task.loss_fn, x, y)

    plain, recomputing = profile("none"), profile(mode)
    assert (recomputing.flops, recomputing.linear_gemms) == (plain.flops, plain.linear_gemms)
    # what the step keeps: the profile's own count (every saved tensor, the math attention kernel's too)
    if mode == "none":
        assert recomputing.activation_bytes == plain.activation_bytes
    else:
        assert recomputing.activation_bytes < plain.activation_bytes / 2
    block_gemms = plain.linear_gemms[:-1]  # every nn.Linear but the head, in call order: qkv, proj, fc, proj
    rerun = [gemm for i, gemm in enumerate(block_gemms) if i % 4 != 3]
    block_forward_flops = sum(2 * m * n * k for m, n, k in rerun)
    attention = 2 * 2 * BATCH * HEADS * SEQ * SEQ * (HIDDEN // HEADS)  # QK^T and AV per block (math kernel)
    expected_extra = extra_forwards * (block_forward_flops + 2 * attention)
    assert recomputing.hardware_flops - recomputing.flops == expected_extra
