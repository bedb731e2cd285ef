"""Workloads: deterministic builds, right shapes, trainable, sane metrics."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from ddlscope.workloads import WORKLOADS, Task
from ddlscope.workloads.digits import CnnDigitsSpec, MlpDigitsSpec
from ddlscope.workloads.gpt import GPT, GPTConfig
from ddlscope.workloads.text import GPTSpec, GPTSyntheticSpec, TokenWindows, load_char_corpus

CPU = torch.device("cpu")
ALL = ["mlp-digits", "cnn-digits", "gpt-char", "gpt-synthetic"]


def build(name: str, seed: int = 0, **knobs: object) -> Task:
    workload = WORKLOADS.get(name)
    return workload.build(workload.spec_class(**knobs), seed)


def expected_shapes(name: str, batch: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(input, target, output) shapes for the default spec of each workload."""
    if name == "mlp-digits":
        return (batch, 64), (batch,), (batch, 10)
    if name == "cnn-digits":
        return (batch, 1, 8, 8), (batch,), (batch, 10)
    vocab = len(load_char_corpus().vocab) if name == "gpt-char" else 256
    return (batch, 64), (batch, 64), (batch, 64, vocab)


def test_registry_lists_the_four_workloads() -> None:
    assert set(ALL) <= set(WORKLOADS.names())
    for name in ALL:
        workload = WORKLOADS.get(name)
        assert workload.spec_class().name == name
        assert workload.description


def test_spec_defaults() -> None:
    mlp = MlpDigitsSpec()
    assert (mlp.batch_size, mlp.lr, mlp.hidden, mlp.layers) == (64, 0.1, 128, 2)
    assert CnnDigitsSpec().channels == 16
    spec = GPTSpec()
    assert (spec.batch_size, spec.lr, spec.optimizer, spec.steps) == (32, 3e-3, "adamw", 200)
    assert (spec.layers, spec.hidden, spec.heads, spec.seq_len, spec.dropout) == (2, 128, 4, 64, 0.0)
    assert (GPTSyntheticSpec().vocab_size, GPTSyntheticSpec().samples) == (256, 2048)


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_model_and_data(name: str) -> None:
    a, b = build(name, seed=3), build(name, seed=3)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    ids = torch.tensor([0, 5, len(a.train) - 1])
    for ta, tb in zip(a.train.get(ids), b.train.get(ids)):
        assert torch.equal(ta, tb)


@pytest.mark.parametrize("name", ALL)
def test_different_seed_different_init(name: str) -> None:
    a, b = build(name, seed=0), build(name, seed=1)
    assert any(not torch.equal(pa, pb) for pa, pb in zip(a.model.parameters(), b.model.parameters()))


@pytest.mark.parametrize("name", ALL)
def test_shapes(name: str) -> None:
    task = build(name)
    x, y = task.train.get(torch.arange(5))
    in_shape, target_shape, out_shape = expected_shapes(name, 5)
    assert x.shape == in_shape and y.shape == target_shape
    assert y.dtype == torch.int64
    assert task.model(x).shape == out_shape


@pytest.mark.parametrize("name", ALL)
def test_a_few_steps_on_a_fixed_batch_lower_the_loss(name: str) -> None:
    task = build(name)
    x, y = task.train.get(torch.arange(16))
    # transformers diverge with plain SGD at the rates the small nets like
    opt = torch.optim.SGD(task.model.parameters(), lr=0.3 if "digits" in name else 0.1)
    losses = []
    for _ in range(8):
        loss = task.loss_fn(task.model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.97 * losses[0], losses


@pytest.mark.parametrize(
    ("name", "metric", "check"),
    [
        ("mlp-digits", "accuracy", lambda m: 0.0 <= m <= 1.0),
        ("cnn-digits", "accuracy", lambda m: 0.0 <= m <= 1.0),
        # untrained: about uniform over the vocabulary
        ("gpt-char", "perplexity", lambda m: 1.0 < m < 3 * len(load_char_corpus().vocab)),
        ("gpt-synthetic", "loss", lambda m: 0.0 < m < 10.0),
    ],
)
def test_evaluate_metric(name: str, metric: str, check) -> None:
    task = build(name)
    result = task.evaluate(task.model, CPU, max_batches=3)
    assert result.metric_name == metric
    assert check(result.metric)
    assert result.loss > 0
    assert task.higher_is_better == (metric == "accuracy")


def test_full_evaluation_of_gpt_char_reads_each_test_token_once() -> None:
    task = build("gpt-char")
    result = task.evaluate(task.model, CPU)  # eval_batches 0: the whole test split
    assert result.metric_name == "perplexity" and result.metric > 1.0
    assert len(task.test) <= 2000  # disjoint windows keep a full evaluation cheap


def test_char_corpus_and_windows() -> None:
    corpus = load_char_corpus()
    assert len(corpus.vocab) < 100
    assert list(corpus.vocab) == sorted(set(corpus.vocab))
    assert len(corpus.tokens) > 500_000

    seq_len = 64
    task = build("gpt-char", seq_len=seq_len)
    split = int(len(corpus.tokens) * 0.9)
    test_chars = len(corpus.tokens) - split
    # every window that fits: ids 0 .. n - seq_len - 1
    assert len(task.train) == split - seq_len
    assert len(task.test) == (test_chars - 1) // seq_len

    x, y = task.train.get(torch.tensor([0, len(task.train) - 1]))
    assert torch.equal(x[0], corpus.tokens[:seq_len]) and torch.equal(y[0], corpus.tokens[1 : seq_len + 1])
    assert torch.equal(y[1], corpus.tokens[split - seq_len : split])  # last window ends at the split

    x, y = task.test.get(torch.tensor([1, len(task.test) - 1]))
    assert torch.equal(x[0], corpus.tokens[split + seq_len : split + 2 * seq_len])
    assert torch.equal(y[0], corpus.tokens[split + seq_len + 1 : split + 2 * seq_len + 1])
    assert y.shape == (2, seq_len)
    assert corpus.decode(x[0]) and set(corpus.decode(x[0])) <= set(corpus.vocab)


def test_token_windows_length_formula() -> None:
    windows = TokenWindows(torch.arange(10), seq_len=3, stride=3)
    assert len(windows) == 3  # starts 0, 3, 6; start 9 has no room for a target
    x, y = windows.get(torch.tensor([2]))
    assert x.tolist() == [[6, 7, 8]] and y.tolist() == [[7, 8, 9]]
    assert len(TokenWindows(torch.arange(10), seq_len=3)) == 7


def test_gpt_synthetic_sizes_and_seeded_data() -> None:
    task = build("gpt-synthetic", samples=100, vocab_size=50, seq_len=16)
    assert len(task.train) == 100 and len(task.test) == 256
    x, _ = task.train.get(torch.arange(100))
    assert 0 <= int(x.min()) and int(x.max()) < 50
    other = build("gpt-synthetic", seed=1, samples=100, vocab_size=50, seq_len=16)
    assert not torch.equal(x, other.train.get(torch.arange(100))[0])
    assert WORKLOADS.get("gpt-synthetic").accuracy_meaningful is False
    assert "throughput" in WORKLOADS.get("gpt-synthetic").description


def test_gpt_spec_rejects_hidden_not_divisible_by_heads() -> None:
    with pytest.raises(ValidationError, match="heads"):
        GPTSpec(hidden=130, heads=4)
    with pytest.raises(ValidationError):
        GPTSpec(unknown_knob=1)


def test_gpt_is_causal_and_exposes_blocks() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, seq_len=8, layers=3, hidden=16, heads=2)).eval()
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 3
    assert model.lm_head.weight.data_ptr() != model.token_emb.weight.data_ptr()  # untied
    idx = torch.randint(11, (2, 8))
    changed = idx.clone()
    changed[:, -1] = (idx[:, -1] + 1) % 11
    # changing the last token must not change any earlier position's logits
    assert torch.allclose(model(idx)[:, :-1], model(changed)[:, :-1])


def test_mlp_digits_learns() -> None:
    task = build("mlp-digits")
    opt = torch.optim.SGD(task.model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        x, y = task.train.get(torch.randint(len(task.train), (128,), generator=gen))
        loss = task.loss_fn(task.model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    result = task.evaluate(task.model, CPU)
    assert result.metric >= 0.9, result
