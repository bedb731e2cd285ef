"""Alpha-beta models of collectives, point-to-point and parameter-server traffic.

Every function works element-wise on numpy arrays as well as on plain
numbers, so the planner evaluates thousands of configurations in one call
and `predict` evaluates one through the very same code.

Conventions: `size_bytes` is the full (unsharded) buffer; `n` the group size;
`per_node` how many members of the group share a node. A group that spans
nodes gets `per_node` GPUs' share of the node's NICs (every group of the same
kind talks at the same time in data/tensor/pipeline parallelism, so a node's
NICs are split among them), and a ring never runs faster than its slowest hop
(NCCL pipelines the intra- and inter-node hops, so the bus bandwidth is the
minimum of the two, as nccl-tests measure).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from ddlscope.predict.catalogue import NodeShape

Algorithm = Literal["auto", "ring", "tree", "hierarchical"]

# NCCL's pipelined double binary tree has the ring's bus bandwidth in theory;
# nccl-tests put it ~10% lower for large messages, which is why NCCL keeps
# the ring for them and the tree (log-depth latency) for small ones at scale.
TREE_BANDWIDTH_PENALTY = 1.1


def group_members_per_node(size: np.ndarray | int, stride: np.ndarray | int, gpus_per_node: int) -> np.ndarray:
    """Members of a group of `size` ranks `stride` apart that land on one node (ranks fill nodes in order)."""
    size, stride = np.asarray(size, dtype=float), np.asarray(stride, dtype=float)
    fit = np.floor(gpus_per_node / np.maximum(stride, 1.0))
    return np.clip(np.minimum(size, fit), 1.0, None)


def ring_bandwidth_bytes_per_s(n, per_node, node: NodeShape) -> np.ndarray:
    """Bus bandwidth of a ring over `n` members, `per_node` of them per node."""
    n, per_node = np.asarray(n, dtype=float), np.asarray(per_node, dtype=float)
    spans_nodes = n > per_node
    inter = per_node * node.inter_bytes_per_s_per_gpu
    return np.where(spans_nodes, np.minimum(node.intra.achieved_bytes_per_s, inter), node.intra.achieved_bytes_per_s)


def step_latency_s(n, per_node, node: NodeShape) -> np.ndarray:
    spans_nodes = np.asarray(n, dtype=float) > np.asarray(per_node, dtype=float)
    return np.where(spans_nodes, node.inter.alpha_s, node.intra.alpha_s)


def ring_all_reduce_s(size_bytes, n, per_node, node: NodeShape) -> np.ndarray:
    """Reduce-scatter then all-gather around a ring: 2(n-1) steps of size/n each."""
    n = np.asarray(n, dtype=float)
    bw = ring_bandwidth_bytes_per_s(n, per_node, node)
    t = 2 * (n - 1) / n * np.asarray(size_bytes, dtype=float) / bw + 2 * (n - 1) * step_latency_s(n, per_node, node)
    return np.where(n > 1, t, 0.0)


def tree_all_reduce_s(size_bytes, n, per_node, node: NodeShape) -> np.ndarray:
    """Pipelined (double) binary tree: 2 log2(n) latencies, each byte up and down once."""
    n = np.asarray(n, dtype=float)
    bw = ring_bandwidth_bytes_per_s(n, per_node, node)
    depth = np.ceil(np.log2(np.maximum(n, 1.0)))
    t = (2 * depth * step_latency_s(n, per_node, node)
         + TREE_BANDWIDTH_PENALTY * 2 * np.asarray(size_bytes, dtype=float) / bw)
    return np.where(n > 1, t, 0.0)


def hierarchical_all_reduce_s(size_bytes, n, per_node, node: NodeShape) -> np.ndarray:
    """Reduce-scatter inside the node, all-reduce across nodes rail by rail, all-gather inside the node."""
    n, per_node = np.asarray(n, dtype=float), np.asarray(per_node, dtype=float)
    size_bytes = np.asarray(size_bytes, dtype=float)
    local = np.minimum(per_node, n)
    nodes = np.ceil(n / local)
    intra_bw = node.intra.achieved_bytes_per_s
    intra = 2 * (local - 1) / local * size_bytes / intra_bw + 2 * (local - 1) * node.intra.alpha_s
    rail_bytes = size_bytes / local
    inter = (2 * (nodes - 1) / nodes * rail_bytes / node.inter_bytes_per_s_per_gpu
             + 2 * (nodes - 1) * node.inter.alpha_s)
    return np.where(n > 1, intra + inter, 0.0)


def all_reduce_s(size_bytes, n, per_node, node: NodeShape, algorithm: Algorithm = "auto") -> np.ndarray:
    """All-reduce time; `auto` takes the faster of ring and tree, as NCCL's tuner does."""
    if algorithm == "ring":
        return ring_all_reduce_s(size_bytes, n, per_node, node)
    if algorithm == "tree":
        return tree_all_reduce_s(size_bytes, n, per_node, node)
    if algorithm == "hierarchical":
        return hierarchical_all_reduce_s(size_bytes, n, per_node, node)
    return np.minimum(ring_all_reduce_s(size_bytes, n, per_node, node),
                      tree_all_reduce_s(size_bytes, n, per_node, node))


def reduce_scatter_s(size_bytes, n, per_node, node: NodeShape) -> np.ndarray:
    """Ring reduce-scatter of a `size_bytes` buffer: each rank ends with size/n, reduced."""
    n = np.asarray(n, dtype=float)
    bw = ring_bandwidth_bytes_per_s(n, per_node, node)
    t = (n - 1) / n * np.asarray(size_bytes, dtype=float) / bw + (n - 1) * step_latency_s(n, per_node, node)
    return np.where(n > 1, t, 0.0)


def all_gather_s(size_bytes, n, per_node, node: NodeShape) -> np.ndarray:
    """Ring all-gather into a `size_bytes` buffer: same traffic as reduce-scatter, no arithmetic."""
    return reduce_scatter_s(size_bytes, n, per_node, node)


def all_to_all_s(size_bytes, n, per_node, node: NodeShape) -> np.ndarray:
    """Each rank sends size/n to every other: off-node bytes go through its NIC share, the rest over the node link."""
    n, per_node = np.asarray(n, dtype=float), np.asarray(per_node, dtype=float)
    size_bytes = np.asarray(size_bytes, dtype=float)
    local = np.minimum(per_node, n)
    off_node = size_bytes * (n - local) / n / node.inter_bytes_per_s_per_gpu
    on_node = size_bytes * (local - 1) / n / node.intra.achieved_bytes_per_s
    t = np.maximum(off_node, on_node) + (n - 1) * step_latency_s(n, per_node, node)
    return np.where(n > 1, t, 0.0)


def p2p_s(size_bytes, across_nodes, node: NodeShape) -> np.ndarray:
    """One send/recv between two GPUs; across nodes it uses the sender's NIC share."""
    across_nodes = np.asarray(across_nodes, dtype=bool)
    bw = np.where(across_nodes, node.inter_bytes_per_s_per_gpu, node.intra.achieved_bytes_per_s)
    alpha = np.where(across_nodes, node.inter.alpha_s, node.intra.alpha_s)
    return alpha + np.asarray(size_bytes, dtype=float) / bw


def ps_push_s(size_bytes, workers, servers, server_bytes_per_s, server_aggregate_bytes_per_s,
              worker_bytes_per_s, alpha_s) -> np.ndarray:
    """Every worker pushes its gradient to the servers (sharded evenly over them).

    Three things can set the pace: the worker's own link, the servers' links
    (they receive workers x size in total) and the servers' CPUs summing the
    arrivals (`server_aggregate_bytes_per_s` of gradient per server).
    """
    size_bytes, workers, servers = (np.asarray(x, dtype=float) for x in (size_bytes, workers, servers))
    per_server_in = workers * size_bytes / servers
    return alpha_s + np.maximum.reduce([size_bytes / worker_bytes_per_s, per_server_in / server_bytes_per_s,
                                        per_server_in / server_aggregate_bytes_per_s])


def ps_pull_s(size_bytes, workers, servers, server_bytes_per_s, worker_bytes_per_s, alpha_s) -> np.ndarray:
    """Every worker pulls the fresh parameters; the servers' links send workers x size in total."""
    size_bytes, workers, servers = (np.asarray(x, dtype=float) for x in (size_bytes, workers, servers))
    return alpha_s + np.maximum(size_bytes / worker_bytes_per_s, workers * size_bytes / servers / server_bytes_per_s)


def bucketed_overlap_exposed_s(total_comm_s, latency_per_bucket_s, n_buckets, backward_s) -> np.ndarray:
    """Communication left exposed after a backward pass that fills `n_buckets` evenly (DDP, MG-WFBP).

    `total_comm_s` is the time of one collective over the whole buffer
    (latency + bytes/bandwidth). Bucket i is ready at backward_s * i / k and
    each takes c = latency + bytes/(k bandwidth) on the wire, one after the other. The last one finishes at
    max(backward_s / k + k c, backward_s + c), so what sticks out is that minus backward_s.
    """
    k = np.maximum(np.asarray(n_buckets, dtype=float), 1.0)
    per_bucket = (np.asarray(total_comm_s, dtype=float) - latency_per_bucket_s) / k + latency_per_bucket_s
    backward_s = np.asarray(backward_s, dtype=float)
    finish = np.maximum(backward_s / k + k * per_bucket, backward_s + per_bucket)
    return np.where(np.asarray(total_comm_s) > 0, finish - backward_s, 0.0)
