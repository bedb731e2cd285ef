"""Language-model workloads on the GPT in `gpt.py`.

gpt-char: character-level LM on Shakespeare's six tragedies (package data,
see data/README.md); train on the first 90% of the text, test on the rest.
gpt-synthetic: the same model on uniformly random tokens, for throughput
and memory studies where what the model learns does not matter.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor

from ddlscope.specs import WorkloadSpec, remember_spec_class
from ddlscope.workloads import WORKLOADS
from ddlscope.workloads.base import Task, TensorDataset, Workload, cross_entropy
from ddlscope.workloads.gpt import GPT, GPTConfig
from ddlscope.workloads.recompute import RECOMPUTE_HELP, Recompute

CORPUS_RESOURCE = "data/shakespeare.txt.gz"
TRAIN_FRACTION = 0.9
EVAL_BATCH_SIZE = 64
SYNTHETIC_TEST_SAMPLES = 256


class GPTSpec(WorkloadSpec):
    name: str = "gpt-char"
    batch_size: int = Field(32, ge=1, description="global batch: sequences per step, summed over ranks")
    steps: int = Field(200, ge=1, description="optimizer steps to train")
    optimizer: Literal["sgd", "adamw"] = "adamw"
    lr: float = Field(3e-3, gt=0, description="learning rate")
    layers: int = Field(2, ge=1, description="transformer blocks")
    hidden: int = Field(128, ge=1, description="model width (embedding size)")
    heads: int = Field(4, ge=1, description="attention heads; must divide hidden")
    seq_len: int = Field(64, ge=1, description="tokens per training sequence (context length)")
    dropout: float = Field(0.0, ge=0, lt=1)
    recompute: Recompute = Field("none", description=RECOMPUTE_HELP)

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "GPTSpec":
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden = {self.hidden} must be divisible by heads = {self.heads} (each head gets hidden / heads dims)"
            )
        return self

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=vocab_size,
            seq_len=self.seq_len,
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            dropout=self.dropout,
            recompute=self.recompute,
        )


class GPTSyntheticSpec(GPTSpec):
    name: str = "gpt-synthetic"
    vocab_size: int = Field(256, ge=2, description="size of the random-token vocabulary")
    samples: int = Field(2048, ge=1, description="training sequences generated from the seed")


remember_spec_class(GPTSpec)
remember_spec_class(GPTSyntheticSpec)


def _build_model(spec: GPTSpec, vocab_size: int, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(spec.gpt_config(vocab_size))


# --- data ---------------------------------------------------------------------


@dataclass
class TokenWindows:
    """Next-token windows over one token stream.

    Sample id i covers tokens[i*stride : i*stride + seq_len + 1]: the first
    seq_len tokens are the input, the same window shifted by one the target.
    stride 1 gives every window (training); stride seq_len gives disjoint
    windows, so a full evaluation reads each token once.
    """

    tokens: Tensor  # 1-D int64
    seq_len: int
    stride: int = 1

    def __post_init__(self) -> None:
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(f"{len(self.tokens)} tokens are too few for one window of seq_len {self.seq_len}")

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len - 1) // self.stride + 1

    def get(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        starts = indices.to(torch.int64) * self.stride
        windows = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]  # (B, seq_len + 1)
        return windows[:, :-1], windows[:, 1:]


@dataclass(frozen=True)
class CharCorpus:
    vocab: str  # sorted distinct characters; token id = position in this string
    tokens: Tensor  # the whole text as int64 token ids

    def decode(self, ids: Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())


@lru_cache(maxsize=1)
def load_char_corpus() -> CharCorpus:
    """The Shakespeare corpus, tokenised per character (cached: built once per process)."""
    raw = resources.files("ddlscope").joinpath(CORPUS_RESOURCE).read_bytes()
    text = gzip.decompress(raw).decode("utf-8")
    # One code point per element, so a vectorised lookup replaces a Python loop.
    code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab_points, ids = np.unique(code_points, return_inverse=True)
    vocab = "".join(chr(c) for c in vocab_points)
    tokens = torch.from_numpy(ids.astype(np.int64).reshape(-1))
    return CharCorpus(vocab=vocab, tokens=tokens)


def char_splits(seq_len: int) -> tuple[TokenWindows, TokenWindows]:
    """Train: every window of the first 90% of the text. Test: disjoint windows of the rest."""
    tokens = load_char_corpus().tokens
    split = int(len(tokens) * TRAIN_FRACTION)
    return TokenWindows(tokens[:split], seq_len, stride=1), TokenWindows(tokens[split:], seq_len, stride=seq_len)


def synthetic_sequences(vocab_size: int, samples: int, seq_len: int, seed: int) -> Tensor:
    """(samples, seq_len + 1) uniformly random token ids, a pure function of the arguments."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (samples, seq_len + 1), generator=gen)


# --- workloads ----------------------------------------------------------------


@WORKLOADS.register("gpt-char")
class GptChar(Workload):
    spec_class: ClassVar[type[WorkloadSpec]] = GPTSpec
    description: ClassVar[str] = "character-level GPT on Shakespeare's tragedies (90/10 split), test perplexity"

    @classmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        spec = cls.checked(spec)
        train, test = char_splits(spec.seq_len)
        model = _build_model(spec, len(load_char_corpus().vocab), seed)
        return Task(
            model=model,
            train=train,
            test=test,
            loss_fn=cross_entropy,
            metric_name="perplexity",
            higher_is_better=False,
            eval_batch_size=EVAL_BATCH_SIZE,
        )


@WORKLOADS.register("gpt-synthetic")
class GptSynthetic(Workload):
    spec_class: ClassVar[type[WorkloadSpec]] = GPTSyntheticSpec
    description: ClassVar[str] = "GPT on random tokens: for throughput and memory studies only (nothing to learn)"
    accuracy_meaningful: ClassVar[bool] = False

    @classmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        spec = cls.checked(spec)
        sequences = synthetic_sequences(spec.vocab_size, spec.samples + SYNTHETIC_TEST_SAMPLES, spec.seq_len, seed)
        train_seqs, test_seqs = sequences[: spec.samples], sequences[spec.samples :]
        model = _build_model(spec, spec.vocab_size, seed)
        return Task(
            model=model,
            train=TensorDataset(train_seqs[:, :-1], train_seqs[:, 1:]),
            test=TensorDataset(test_seqs[:, :-1], test_seqs[:, 1:]),
            loss_fn=cross_entropy,
            metric_name="loss",
            higher_is_better=False,
            eval_batch_size=EVAL_BATCH_SIZE,
        )
