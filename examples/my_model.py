"""Your own model under ddlscope: `--workload module:examples.my_model:build` (run from the repo root).

A `module:` factory returns either an nn.Module (an image classifier: it gets
the spec's channels x image_size x image_size images and `classes` outputs)
or a `UserWorkload` that also says what the model takes, its data, loss and
metric. Keyword arguments come from `workload.args`:

    ddlscope run --workload module:examples.my_model:build --strategy fsdp \
        --set workload.args='{width = 64, depth = 3}'
    ddlscope run --workload module:examples.my_model:tiny_lm --strategy ddp

See docs/models.md for the whole protocol.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ddlscope.workloads.sources import UserWorkload


class MixerBlock(nn.Module):
    """One MLP-Mixer block: mix across patches, then across channels (Tolstikhin et al. 2021)."""

    def __init__(self, patches: int, width: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.token_mlp = nn.Sequential(nn.Linear(patches, 2 * patches), nn.GELU(), nn.Linear(2 * patches, patches))
        self.channel_mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:  # (batch, patches, width)
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, width: int = 32, depth: int = 2, patch: int = 4, image_size: int = 32, classes: int = 10):
        super().__init__()
        patches = (image_size // patch) ** 2
        self.stem = nn.Conv2d(3, width, patch, stride=patch)
        self.mixers = nn.ModuleList(MixerBlock(patches, width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)
        for block in self.mixers:
            x = block(x)
        return self.head(x.mean(dim=1))


def build(width: int = 32, depth: int = 2) -> nn.Module:
    """A bare nn.Module: ddlscope feeds it 3x32x32 images (workload.image_size) of 10 classes."""
    return Mixer(width=width, depth=depth)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


def tiny_lm(width: int = 64, vocab: int = 256) -> UserWorkload:
    """A UserWorkload: token inputs (workload.vocab, workload.seq_len; keep vocab equal), next-token
    targets from ddlscope's Markov-chain sequences, perplexity."""
    torch.manual_seed(0)
    return UserWorkload(model=TinyLM(vocab, width), inputs="tokens", metric="perplexity")
