"""Federated data: which client holds which training samples, and in what order it reads them.

Torch-free (numpy on the label array), so a layout can be inspected, tested
and plotted without a run. The strategy's spec (specs/strategies/federated.py)
names the layout; `ClientData` builds it from the training labels:

- iid: the samples shuffled and cut into one part per client;
- dirichlet: label skew (Hsu et al. 2019): for each class, its samples are
  split over the clients in proportions drawn from Dirichlet(alpha);
- block-cyclic: the labels split into `blocks` groups; each sample belongs to
  the block of its label's group (or, with probability 1 - block_purity, to
  another block at random); each block's samples are cut over the clients as
  iid; during block b a client reads its part of block b;
- replicated: every client holds the whole set and reads it in the same order
  (the equivalence checks: federated averaging of identical clients is one
  client's training).

`size_skew` makes client sizes unbalanced (lognormal shares, sigma =
size_skew) for iid and block-cyclic; Dirichlet proportions are unbalanced by
themselves. Every layout is a pure function of the labels, the knobs, the
number of clients and the seed: every rank builds the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddlscope.specs.strategies.federated import FedAvgSpec

TEST_SPLIT_SEED = 0  # the test samples' blocks are fixed: every run is evaluated on the same ones


def client_shares(clients: int, size_skew: float, rng: np.random.Generator) -> np.ndarray:
    """Each client's share of the samples (sums to 1): equal, or lognormal(0, size_skew) normalised."""
    if size_skew <= 0:
        return np.full(clients, 1.0 / clients)
    raw = rng.lognormal(0.0, size_skew, clients)
    return raw / raw.sum()


def cut(ids: np.ndarray, shares: np.ndarray) -> list[np.ndarray]:
    """`ids` cut in order into consecutive parts of the given shares; every part gets at least one id
    when there are as many ids as parts (a client with no data would train on nothing)."""
    n, parts = len(ids), len(shares)
    counts = np.floor(shares * n).astype(int)
    counts[np.argsort(-(shares * n - counts))[: n - counts.sum()]] += 1  # the remainder to the largest fractions
    if n >= parts:
        for empty in np.flatnonzero(counts == 0):
            counts[np.argmax(counts)] -= 1
            counts[empty] = 1
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [ids[bounds[k]:bounds[k + 1]] for k in range(parts)]


def iid(ids: np.ndarray, clients: int, size_skew: float, rng: np.random.Generator) -> list[np.ndarray]:
    return cut(rng.permutation(ids), client_shares(clients, size_skew, rng))


def dirichlet(labels: np.ndarray, clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Label skew: each class's samples split over the clients in Dirichlet(alpha) proportions."""
    parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        proportions = rng.dirichlet(np.full(clients, alpha))
        for k, piece in enumerate(cut(members, proportions)):
            parts[k].append(piece)
    out = [np.sort(np.concatenate(p)) for p in parts]
    for k in range(clients):  # a client left without samples takes one from the largest
        if len(out[k]) == 0:
            big = int(np.argmax([len(p) for p in out]))
            out[k], out[big] = out[big][:1], out[big][1:]
    return out


def label_groups(num_classes: int, blocks: int) -> list[np.ndarray]:
    """The labels of each block: 0..C-1 in `blocks` consecutive groups (as equal as can be)."""
    return np.array_split(np.arange(num_classes), blocks)


def assign_blocks(labels: np.ndarray, num_classes: int, blocks: int, purity: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Each sample's block: its label group's, or with probability 1 - purity another block at random."""
    group_of = np.zeros(num_classes, dtype=int)
    for b, group in enumerate(label_groups(num_classes, blocks)):
        group_of[group] = b
    home = group_of[labels]
    if blocks == 1 or purity >= 1:
        return home
    moved = rng.random(len(labels)) >= purity
    other = (home + rng.integers(1, blocks, len(labels))) % blocks  # uniformly one of the other blocks
    return np.where(moved, other, home)


@dataclass
class Round:
    """What one client reads in one round: the sample ids in order, and its minibatches' sizes."""

    ids: np.ndarray
    minibatches: list[int]


class ClientData:
    """The federated layout of one run: parts[block][client] = that client's sample ids in that block."""

    def __init__(self, spec: FedAvgSpec, labels: np.ndarray, clients: int, seed: int):
        self.spec, self.clients, self.seed = spec, clients, seed
        labels = np.asarray(labels)
        self.num_classes = int(labels.max()) + 1
        rng = np.random.default_rng([seed, 0xDA7A])
        ids = np.arange(len(labels))
        if spec.partition == "replicated":
            self.parts = [[ids for _ in range(clients)]]
        elif spec.partition == "dirichlet":
            self.parts = [dirichlet(labels, clients, spec.alpha, rng)]
        elif spec.partition == "block-cyclic":
            blocks = assign_blocks(labels, self.num_classes, spec.blocks, spec.block_purity, rng)
            self.parts = [iid(np.flatnonzero(blocks == b), clients, spec.size_skew, rng) for b in range(spec.blocks)]
        else:
            self.parts = [iid(ids, clients, spec.size_skew, rng)]

    @property
    def blocks(self) -> int:
        return len(self.parts)

    def size(self, client: int, block: int = 0) -> int:
        return len(self.parts[block][client])

    def weights(self, round_: int) -> dict[int, float]:
        """The averaging weight of each client sampled this round: its sample count in the round's block
        over the sampled clients' total (FedAvg's n_k / n)."""
        block = self.spec.block_of_round(round_)
        sampled = self.spec.sampled_clients(round_, self.clients, self.seed)
        sizes = {k: self.size(k, block) for k in sampled}
        total = sum(sizes.values())
        return {k: n / total for k, n in sizes.items()}

    def round(self, client: int, round_: int, batch: int) -> Round:
        """The client's reading of this round: `local_epochs` fresh permutations of its part of the round's
        block, each cut into minibatches of `batch` (the last one of an epoch may be smaller); or exactly
        `local_steps` minibatches of `batch` from consecutive permutations."""
        spec = self.spec
        mine = self.parts[spec.block_of_round(round_)][client]
        # Replicated clients read in the same order: their order does not depend on who they are.
        who = 0 if spec.partition == "replicated" else client
        rng = np.random.default_rng([self.seed, who, round_, 0x0D3])
        n = len(mine)
        if spec.local_steps:
            epochs = -(-spec.local_steps * batch // n)
            stream = np.concatenate([rng.permutation(mine) for _ in range(epochs)])
            return Round(stream[: spec.local_steps * batch], [batch] * spec.local_steps)
        per_epoch = [batch] * (n // batch) + ([n % batch] if n % batch else [])
        ids = np.concatenate([rng.permutation(mine) for _ in range(spec.local_epochs)])
        return Round(ids, per_epoch * spec.local_epochs)

    def test_blocks(self, test_labels: np.ndarray) -> list[np.ndarray]:
        """The test samples of each block, by the training blocks' rule with a fixed seed: block b's test
        set follows block b's distribution. Without block-cyclic data, one block: the whole test set."""
        test_labels = np.asarray(test_labels)
        if self.spec.partition != "block-cyclic":
            return [np.arange(len(test_labels))]
        rng = np.random.default_rng([TEST_SPLIT_SEED, 0x7E57])
        blocks = assign_blocks(test_labels, self.num_classes, self.spec.blocks, self.spec.block_purity, rng)
        return [np.flatnonzero(blocks == b) for b in range(self.spec.blocks)]

    def describe(self) -> str:
        """One line: the clients' sizes per block."""
        return "; ".join(f"block {b}: " + "/".join(str(len(p)) for p in part) for b, part in enumerate(self.parts))
