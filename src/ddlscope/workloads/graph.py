"""A graph transformer on a generated stochastic-block-model graph: node classification, readable top to bottom.

    node features -> linear -> N x Block(h + attn(ln(h)), h + mlp(ln(h)))  (pre-LayerNorm)
                 -> final LayerNorm -> head -> class logits per node

Attention is restricted to the graph's edges: node i attends to its in-neighbours (and itself), a
softmax over incoming edges computed with scatter/index_add (`edge_attention`), so memory grows with
edges, not nodes squared. `attention = "dense"` computes the same thing as a dense N x N masked
attention, the baseline the study compares with.

The graph (package-free, no download): `nodes` nodes in `communities` equal communities, nodes
ordered by community; each node draws `degree_in` in-neighbours inside its community and
`degree_out` outside (duplicates dropped), plus a self-loop. Features are the community's centroid
plus noise, so a node is classified better from its neighbours than from its own features. The
graph and its train/test split use a fixed seed, independent of the run seed.

Where the nodes live is the model's `layout` (`GraphLayout`): the whole graph by default. A
node-parallel strategy (strategies/nodepar.py) installs a layout that owns one contiguous range of
nodes and fetches its halo (the in-neighbours other ranks own) each layer; the model's code is the
same either way. The model's input is a batch of node ids, its output their logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn
from torch.nn import functional as F

from ddlscope.specs import WorkloadSpec, remember_spec_class
from ddlscope.workloads import WORKLOADS
from ddlscope.workloads.base import Task, TensorDataset, Workload, cross_entropy

GRAPH_SEED = 0  # fixed: every run and every rank builds the same graph and split
TEST_FRACTION = 0.5
NOISE_STD = 1.5  # feature noise against a unit-norm centroid: features alone classify poorly
INIT_STD = 0.02


class GraphTransformerSpec(WorkloadSpec):
    name: str = "graph-transformer"
    batch_size: int = Field(64, ge=1, description="labelled training nodes per step (the whole graph is computed)")
    lr: float = Field(0.01, gt=0, description="learning rate")
    optimizer: Literal["sgd", "adamw"] = "adamw"
    nodes: int = Field(1024, ge=8, le=1_000_000, description="nodes in the generated graph")
    communities: int = Field(4, ge=2, le=64, description="blocks of the stochastic block model (= classes)")
    degree_in: int = Field(8, ge=0, description="in-neighbours each node draws inside its community")
    degree_out: int = Field(2, ge=0, description="in-neighbours each node draws outside its community")
    features: int = Field(16, ge=1, description="node feature width")
    hidden: int = Field(32, ge=1, description="model width")
    heads: int = Field(4, ge=1, description="attention heads")
    layers: int = Field(2, ge=1, description="transformer blocks")
    attention: Literal["sparse", "dense"] = Field(
        "sparse", description="sparse: softmax over each node's in-edges; dense: N x N masked attention")

    @model_validator(mode="after")
    def _consistent(self) -> "GraphTransformerSpec":
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be divisible by heads {self.heads}")
        if self.nodes < 2 * self.communities:
            raise ValueError(f"nodes {self.nodes} must be at least twice the communities ({self.communities})")
        return self

    def edges_estimate(self) -> int:
        """Edges including self-loops, before duplicates are dropped (an upper bound)."""
        return self.nodes * (self.degree_in + self.degree_out + 1)


remember_spec_class(GraphTransformerSpec)


# --- the graph --------------------------------------------------------------------


@dataclass(frozen=True)
class Graph:
    features: Tensor  # (nodes, features) float32
    labels: Tensor  # (nodes,) int64: the community
    src: Tensor  # (edges,) int64: messages flow src -> dst
    dst: Tensor  # (edges,) int64, sorted

    @property
    def nodes(self) -> int:
        return len(self.labels)


def community_of(nodes: int, communities: int) -> Tensor:
    """Nodes are ordered by community: node i is in community i * communities // nodes."""
    return torch.arange(nodes) * communities // nodes


def generate_graph(spec: GraphTransformerSpec) -> Graph:
    """The stochastic-block-model graph of the spec, the same for every seed, rank and run."""
    gen = torch.Generator().manual_seed(GRAPH_SEED)
    n, c = spec.nodes, spec.communities
    community = community_of(n, c)
    starts = torch.searchsorted(community, torch.arange(c))
    sizes = torch.bincount(community, minlength=c)
    dst = torch.arange(n)
    # inside: a uniform member of the node's own community; outside: one of the other n - size nodes
    inside = starts[community, None] + (torch.rand(n, spec.degree_in, generator=gen) * sizes[community, None]).long()
    outside = (torch.rand(n, spec.degree_out, generator=gen) * (n - sizes[community, None])).long()
    outside = torch.where(outside >= starts[community, None], outside + sizes[community, None], outside)
    src = torch.cat([dst[:, None], inside, outside], dim=1).reshape(-1)
    dst = dst.repeat_interleave(1 + spec.degree_in + spec.degree_out)
    pairs = torch.unique(torch.stack([dst, src], dim=1), dim=0)  # sorted by dst, duplicates dropped
    centroids = F.normalize(torch.randn(c, spec.features, generator=gen), dim=1)
    features = centroids[community] + NOISE_STD * torch.randn(n, spec.features, generator=gen)
    return Graph(features, community, pairs[:, 1].contiguous(), pairs[:, 0].contiguous())


def split_nodes(nodes: int) -> tuple[Tensor, Tensor]:
    """(train ids, test ids): a fixed random half each."""
    order = torch.randperm(nodes, generator=torch.Generator().manual_seed(GRAPH_SEED + 1))
    n_test = int(nodes * TEST_FRACTION)
    return order[n_test:].sort().values, order[:n_test].sort().values


# --- attention over edges ---------------------------------------------------------------


def edge_attention(q: Tensor, k: Tensor, v: Tensor, src: Tensor, dst: Tensor) -> Tensor:
    """Each dst node's attention over its in-edges: softmax_j(q_i . k_j / sqrt(d)) v_j for edges j -> i.

    q: (n_dst, heads, d) for the nodes computed here; k, v: (n_src, heads, d) for every node an edge
    starts from; src, dst index them. Every dst node needs at least one edge (the self-loop).
    """
    scores = (q[dst] * k[src]).sum(-1) / math.sqrt(q.shape[-1])  # (edges, heads)
    index = dst[:, None].expand_as(scores)
    # subtract each node's max before exp (stability); a constant per node, so no gradient through it
    node_max = torch.full(q.shape[:2], -math.inf, dtype=q.dtype, device=q.device).scatter_reduce(0, index, scores, "amax")
    weights = torch.exp(scores - node_max.detach()[dst])
    weights = weights / torch.zeros(q.shape[:2], dtype=q.dtype, device=q.device).index_add(0, dst, weights)[dst]
    return torch.zeros_like(q).index_add(0, dst, weights[..., None] * v[src])


def dense_attention(q: Tensor, k: Tensor, v: Tensor, src: Tensor, dst: Tensor) -> Tensor:
    """The same attention as `edge_attention`, as a dense (heads, n_dst, n_src) masked softmax."""
    mask = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    mask[dst, src] = True
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask).transpose(0, 1)


ATTENTION = {"sparse": edge_attention, "dense": dense_attention}


# --- where the nodes live -----------------------------------------------------------------


class GraphLayout:
    """The whole graph in this process: every node computed here, no halo."""

    def __init__(self, graph: Graph):
        self.owned = torch.arange(graph.nodes)  # global ids of the nodes computed here, ascending
        self.src, self.dst = graph.src, graph.dst  # local ids: dst < len(owned), src < len(owned) + halo

    def to(self, device: torch.device) -> "GraphLayout":
        """Move the index tensors where the model computes (a no-op when they are there)."""
        if self.src.device != device:
            self.owned, self.src, self.dst = (t.to(device) for t in (self.owned, self.src, self.dst))
        return self

    def with_halo(self, rows: Tensor) -> Tensor:
        """The rows of the owned nodes followed by those of the halo (none here)."""
        return rows

    def select(self, out: Tensor, node_ids: Tensor) -> Tensor:
        """Rows of `out` (one per owned node) for the given global node ids."""
        return out[node_ids]


# --- the model --------------------------------------------------------------------


class EdgeSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str):
        super().__init__()
        self.heads = heads
        self.attend = ATTENTION[attention]
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, h: Tensor, layout: GraphLayout) -> Tensor:
        n, width = h.shape
        q, k, v = self.qkv(h).view(n, 3, self.heads, width // self.heads).unbind(1)
        # keys and values of the in-neighbours other ranks own: one halo exchange per layer
        kv = layout.with_halo(torch.cat([k, v], dim=-1).reshape(n, -1)).view(-1, self.heads, 2 * width // self.heads)
        k_all, v_all = kv.chunk(2, dim=-1)
        return self.proj(self.attend(q, k_all, v_all, layout.src, layout.dst).reshape(n, width))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str):
        super().__init__()
        self.ln_attn = nn.LayerNorm(hidden)
        self.attn = EdgeSelfAttention(hidden, heads, attention)
        self.ln_mlp = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, h: Tensor, layout: GraphLayout) -> Tensor:
        h = h + self.attn(self.ln_attn(h), layout)
        return h + self.mlp(self.ln_mlp(h))


class GraphTransformer(nn.Module):
    def __init__(self, spec: GraphTransformerSpec, graph: Graph):
        super().__init__()
        self.register_buffer("features", graph.features, persistent=False)  # data, not state: not checkpointed
        self.layout = GraphLayout(graph)
        self.embed = nn.Linear(spec.features, spec.hidden)
        self.blocks = nn.ModuleList(Block(spec.hidden, spec.heads, spec.attention) for _ in range(spec.layers))
        self.ln_final = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.communities)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=INIT_STD)
                nn.init.zeros_(module.bias)

    def node_logits(self) -> Tensor:
        """Logits of every node this process computes (the layout's owned nodes, in order)."""
        layout = self.layout.to(self.features.device)
        h = self.embed(self.features[layout.owned])
        for block in self.blocks:
            h = block(h, layout)
        return self.head(self.ln_final(h))

    def forward(self, node_ids: Tensor) -> Tensor:
        """Node ids (B,) -> class logits (B, communities). The whole (owned) graph is computed."""
        return self.layout.select(self.node_logits(), node_ids)


@WORKLOADS.register("graph-transformer")
class GraphTransformerWorkload(Workload):
    spec_class: ClassVar[type[WorkloadSpec]] = GraphTransformerSpec
    description: ClassVar[str] = ("graph transformer, attention over edges, node classification on a generated "
                                  "stochastic block model (nodes, communities, degrees are knobs), accuracy")

    @classmethod
    def build(cls, spec: WorkloadSpec, seed: int) -> Task:
        spec = cls.checked(spec)
        graph = generate_graph(spec)
        train_ids, test_ids = split_nodes(spec.nodes)
        torch.manual_seed(seed)
        model = GraphTransformer(spec, graph)
        return Task(model=model, train=TensorDataset(train_ids, graph.labels[train_ids]),
                    test=TensorDataset(test_ids, graph.labels[test_ids]), loss_fn=cross_entropy,
                    metric_name="accuracy", higher_is_better=True, eval_batch_size=max(len(test_ids), 1))
