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

Latency follows NCCL's own cost model (src/graph/tuning.cc): each collective
pays a base latency and a per-hop latency that depend on the protocol, and
each protocol uses a share of the link's bandwidth; NCCL picks the fastest
protocol for the message size, and so does `nccl_time_s`. That gives the
nccl-tests bus bandwidth curve: latency-bound (LL) for small messages,
bandwidth-bound (Simple) for large ones, with a floor of several
microseconds per collective however small the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ddlscope.predict.catalogue import NodeShape

Algorithm = Literal["auto", "ring", "tree", "hierarchical"]

# NCCL's pipelined double binary tree has the ring's bus bandwidth in theory;
# nccl-tests put it ~10% lower for large messages, which is why NCCL keeps
# the ring for them and the tree (log-depth latency) for small ones at scale.
TREE_BANDWIDTH_PENALTY = 1.1


@dataclass(frozen=True)
class Protocol:
    name: str
    base_s: float  # per collective
    hop_factor: float  # per-hop latency relative to the Simple protocol's (the catalogue's link alpha)
    bandwidth_fraction: float  # share of the bus bandwidth the protocol can use


# NCCL 2.x tuning model (src/graph/tuning.cc): ring base latencies LL 6.6 us, LL128 14 us, Simple
# 8.4 us; NVLink hop latencies LL 0.6, LL128 1.9, Simple 3.4 us (hence the factors); LL carries 8 data
# bytes per 16 (flags), LL128 120 per 128 (the tuner takes ~0.92), Simple the whole link.
NCCL_PROTOCOLS = (Protocol("LL", 6.6e-6, 0.6 / 3.4, 0.5), Protocol("LL128", 14.0e-6, 1.9 / 3.4, 0.92),
                  Protocol("Simple", 8.4e-6, 1.0, 1.0))
PLAIN = (Protocol("alpha-beta", 0.0, 1.0, 1.0),)  # a link that is not NCCL's (gloo on loopback)


def nccl_time_s(hops_latency_s, transfer_s, node: NodeShape) -> np.ndarray:
    """The fastest protocol's time: base + the hops' latency + transfer at the protocol's share of bandwidth.

    `hops_latency_s`: the sum of the hops' Simple-protocol latencies; `transfer_s`: the bytes on the
    busiest link over its full achieved bandwidth.
    """
    protocols = NCCL_PROTOCOLS if node.intra.nccl else PLAIN
    hops_latency_s, transfer_s = np.asarray(hops_latency_s, dtype=float), np.asarray(transfer_s, dtype=float)
    best = None
    for p in protocols:
        t = p.base_s + hops_latency_s * p.hop_factor + transfer_s * (1.0 / p.bandwidth_fraction)
        best = t if best is None else np.minimum(best, t)
    return best


def ring_hops_latency_s(rounds, n, per_node, node: NodeShape) -> np.ndarray:
    """Latency of `rounds` trips around a ring of n: of each trip's n - 1 hops, nodes - 1 cross a node
    boundary (NIC latency), the rest stay on the node link (NCCL's tuner counts them the same way)."""
    n, per_node = np.asarray(n, dtype=float), np.asarray(per_node, dtype=float)
    nodes = np.ceil(n / np.minimum(per_node, n))
    inter_hops = nodes - 1
    return rounds * ((n - 1 - inter_hops) * node.intra.alpha_s + inter_hops * node.inter.alpha_s)


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


def ring_all_reduce_s(size_bytes, n, per_node, node: NodeShape) -> np.ndarray:
    """Reduce-scatter then all-gather around a ring: 2(n-1) steps of size/n each."""
    n = np.asarray(n, dtype=float)
    bw = ring_bandwidth_bytes_per_s(n, per_node, node)
    t = nccl_time_s(ring_hops_latency_s(2, n, per_node, node),
                    2 * (n - 1) / n * np.asarray(size_bytes, dtype=float) / bw, node)
    return np.where(n > 1, t, 0.0)


def tree_all_reduce_s(size_bytes, n, per_node, node: NodeShape) -> np.ndarray:
    """Pipelined (double) binary tree: 2 log2(n) latencies, each byte up and down once."""
    n = np.asarray(n, dtype=float)
    bw = ring_bandwidth_bytes_per_s(n, per_node, node)
    local = np.minimum(np.asarray(per_node, dtype=float), n)
    inter_depth = np.ceil(np.log2(np.ceil(n / local)))
    intra_depth = np.ceil(np.log2(local))
    t = nccl_time_s(2 * (inter_depth * node.inter.alpha_s + intra_depth * node.intra.alpha_s),
                    TREE_BANDWIDTH_PENALTY * 2 * np.asarray(size_bytes, dtype=float) / bw, node)
    return np.where(n > 1, t, 0.0)


def hierarchical_all_reduce_s(size_bytes, n, per_node, node: NodeShape) -> np.ndarray:
    """Reduce-scatter inside the node, all-reduce across nodes rail by rail, all-gather inside the node."""
    n, per_node = np.asarray(n, dtype=float), np.asarray(per_node, dtype=float)
    size_bytes = np.asarray(size_bytes, dtype=float)
    local = np.minimum(per_node, n)
    nodes = np.ceil(n / local)
    intra_bw = node.intra.achieved_bytes_per_s
    intra = np.where(local > 1, nccl_time_s(2 * (local - 1) * node.intra.alpha_s,
                                            2 * (local - 1) / local * size_bytes / intra_bw, node), 0.0)
    rail_bytes = size_bytes / local
    inter = np.where(nodes > 1, nccl_time_s(2 * (nodes - 1) * node.inter.alpha_s,
                                            2 * (nodes - 1) / nodes * rail_bytes / node.inter_bytes_per_s_per_gpu,
                                            node), 0.0)
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
    t = nccl_time_s(ring_hops_latency_s(1, n, per_node, node), (n - 1) / n * np.asarray(size_bytes, dtype=float) / bw,
                    node)
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
    hops = (local - 1) * node.intra.alpha_s + (n - local) * node.inter.alpha_s  # one message to every other rank
    t = nccl_time_s(hops, np.maximum(off_node, on_node), node)
    return np.where(n > 1, t, 0.0)


def p2p_s(size_bytes, across_nodes, node: NodeShape) -> np.ndarray:
    """One send/recv between two GPUs; across nodes it uses the sender's NIC share."""
    across_nodes = np.asarray(across_nodes, dtype=bool)
    bw = np.where(across_nodes, node.inter_bytes_per_s_per_gpu, node.intra.achieved_bytes_per_s)
    alpha = np.where(across_nodes, node.inter.alpha_s, node.intra.alpha_s)
    return nccl_time_s(alpha, np.asarray(size_bytes, dtype=float) / bw, node)


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


# NCCL runs each channel of a collective as one thread block resident on its own SM for the collective's
# whole duration (NCCL documentation, NCCL_MIN_CTAS / NCCL_MAX_CTAS: "one CTA per channel"); for large
# messages on an NVSwitch node it uses 16 channels (NCCL environment documentation: NCCL_NVLS_NCHANNELS
# defaults to 16 on Hopper; nccl-tests on DGX A100 log 16-32 "coll channels" for the ring). 16 is the
# low end, so the effect below is, if anything, understated.
NCCL_CHANNELS = 16


def sm_contention_s(overlapped_comm_s, compute_s, sms: int) -> np.ndarray:
    """Compute time lost to a collective that runs beside it: while they overlap the kernels have
    sms - NCCL_CHANNELS of the SMs, so the overlapped stretch does NCCL_CHANNELS / sms less work, done later.

    `sms` 0 (a device without SMs in the catalogue, a calibrated CPU): nothing charged.
    """
    if sms <= 0:
        return np.zeros_like(np.asarray(compute_s, dtype=float))
    overlap = np.minimum(np.asarray(overlapped_comm_s, dtype=float), np.asarray(compute_s, dtype=float))
    return np.maximum(overlap, 0.0) * min(NCCL_CHANNELS, sms) / sms


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
