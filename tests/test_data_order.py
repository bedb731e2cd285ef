"""The data order: deterministic, shared by all ranks, crossing epochs cleanly."""

import torch

from ddlscope.runtime.data import GlobalBatchSampler


def test_ranks_partition_the_global_batch():
    sampler = GlobalBatchSampler(100, 32, seed=1)
    for step in range(10):
        parts = [sampler.rank_batch(step, r, 8) for r in range(4)]
        assert torch.equal(torch.cat(parts), sampler.global_batch(step))


def test_each_epoch_is_a_permutation_and_batches_span_epochs():
    sampler = GlobalBatchSampler(10, 4, seed=0)
    stream = torch.cat([sampler.global_batch(s) for s in range(5)])  # 20 ids = two epochs
    assert sorted(stream[:10].tolist()) == list(range(10)) and sorted(stream[10:].tolist()) == list(range(10))
    assert not torch.equal(stream[:10], stream[10:])  # a new order each epoch


def test_same_seed_same_order_other_seed_other_order():
    a, b, c = (GlobalBatchSampler(1000, 16, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.global_batch(7), b.global_batch(7))
    assert not torch.equal(a.global_batch(7), c.global_batch(7))
    # any step can be computed on its own (resumable mid-epoch)
    assert torch.equal(GlobalBatchSampler(1000, 16, seed=3).global_batch(40), a.global_batch(40))
