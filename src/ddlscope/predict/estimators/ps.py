"""The parameter-server family: ps-sync, ps-async, ssp, ps-stale-aware."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Sequence

import numpy as np

from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.catalogue import Cluster
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, split_slowdowns,
                                              state_tensors)
from ddlscope.calibrate.model import (STATE_TENSORS, concurrent_rounds_slowdown, machine_probe, ps_compute_stretch,
                                      ps_round_s, sync_at)
from ddlscope.specs.strategies.ps import PSAsyncSpec, PSSpec, PSSyncSpec, SSPSpec, StaleAwareSpec
from ddlscope.specs import ConfigError


def ps_exchange_s(workload: pst.Workload, cluster: Cluster, server: pst.ServerSpec, concurrent: float,
                  nbytes: float | None = None, servers: int | None = None, updates: float = 1.0) -> float:
    """One push and one pull of `nbytes` (default: the whole gradient) with `concurrent` clients on `servers`
    servers' links (default: all of them), plus the servers' `updates` optimizer steps over what they received
    (parameter_server's clients are workers; omnivore's, group leaders)."""
    grad_bytes = workload.params * workload.grad_bytes_per_param
    nbytes = grad_bytes if nbytes is None else nbytes
    servers = server.servers if servers is None else servers
    worker_bw = cluster.inter_bytes_per_s_per_gpu if cluster.nodes > 1 else cluster.intra_bytes_per_s
    server_bw, agg = server.link_gb_per_s * 1e9, server.aggregate_gb_per_s * 1e9
    push = coll.ps_push_s(nbytes, concurrent, servers, server_bw, agg, worker_bw, server.alpha_s)
    pull = coll.ps_pull_s(nbytes, concurrent, servers, server_bw, worker_bw, server.alpha_s)
    if not server.update_s:
        return float(push + pull)
    # each update steps the bytes it received; `servers` servers step their shares side by side
    return float(push + pull + updates * server.update_s * nbytes / grad_bytes / servers)


def parameter_server(workload: pst.Workload, cluster: Cluster, mode: Literal["sync", "async", "ssp"] = "sync",
                     server: pst.ServerSpec = pst.ServerSpec(), staleness: int = 3, jitter_cv: float = 0.0,
                     slowdowns: Sequence[float] | None = None, block_cyclic: bool = False) -> pst.StrategyEstimate:
    """Workers push gradients and pull weights through the servers' links and CPUs.

    sync: every step waits for the slowest worker, then all push and pull
    through the shared servers. async: each worker cycles on its own; the
    servers cap the total update rate. ssp: async bounded by `staleness`
    steps, so in the long run every worker runs at the slowest one's pace,
    but random jitter is absorbed over a window of staleness + 1 steps.
    block_cyclic (async only): each update exchanges one server's block
    (1/servers of the bytes) with that server alone; the servers share the
    updates, each hearing from workers / servers of them at a time.
    """
    if mode not in ("sync", "async", "ssp"):
        raise ConfigError(f"mode = {mode!r}: allowed: sync, async, ssp")
    if block_cyclic and mode != "async":
        raise ConfigError(f"block_cyclic is a ps-async knob, not for mode {mode!r}")
    w = cluster.n_gpus
    c_each = pst.compute_s(workload, cluster) * pst.worker_slowdowns(w, slowdowns)
    grad_bytes = workload.params * workload.grad_bytes_per_param

    def exchange_s(concurrent: float, nbytes: float = grad_bytes, servers: int = server.servers,
                   updates: float = 1.0) -> float:
        return ps_exchange_s(workload, cluster, server, concurrent, nbytes, servers, updates)

    mem = (workload.params * (workload.state_bytes_per_param - 8.0)  # optimizer moments live on the servers
           + workload.activation_bytes_per_sample * workload.batch_per_worker)
    if mode == "sync":
        c = float(c_each.max())
        comm = exchange_s(w)
        step = c + comm + pst.straggler_wait_s(c, w, jitter_cv)
        return pst.StrategyEstimate("ps-sync", w, step, c, comm, comm, mem, w * workload.batch_per_worker,
                                    pst.single_samples_per_s(workload, cluster))
    if block_cyclic:
        block, per_server = grad_bytes / server.servers, max(w / server.servers, 1.0)
        alone = exchange_s(1, block, 1)
        capacity = server.servers / (exchange_s(per_server, block, 1, per_server) / per_server)
    else:
        alone = exchange_s(1)
        # the servers move push + pull of every update, sum every push and step every update
        capacity = 1.0 / (exchange_s(w, updates=w) / w)
    jitter = (pst.straggler_wait_s(float(c_each.mean()), w, jitter_cv, window_steps=staleness + 1)
              if mode == "ssp" else 0.0)
    cycles = c_each + alone
    if mode == "ssp":  # nobody gets more than `staleness` steps ahead: the slowest sets the pace
        cycles = np.full(w, float(cycles.max()) + jitter)
    rate = min(float(np.sum(1.0 / cycles)), capacity)
    step = w / rate  # mean time for every worker to finish one step
    staleness_steps = float(rate * np.mean(cycles) - 1.0)
    if mode == "ssp":
        staleness_steps = min(staleness_steps, float(staleness))
    est = pst.StrategyEstimate(f"ps-{mode}", w, step, float(c_each.mean()), alone,
                               max(step - float(c_each.mean()), 0.0), mem, w * workload.batch_per_worker,
                               pst.single_samples_per_s(workload, cluster),
                               mean_staleness_steps=max(staleness_steps, 0.0))
    if rate >= capacity:
        est.notes.append("server-bound: the servers' links or CPUs cap the update rate")
    return est


class PSEstimator(Estimator):
    """Workers push gradients and pull parameters through the servers' links; the servers step."""

    mode: ClassVar[Literal["sync", "async", "ssp"]]

    def cluster(self, spec: PSSpec, case: ClusterCase) -> pst.StrategyEstimate:
        return parameter_server(case.workload, case.cluster, self.mode, case.server,
                                slowdowns=split_slowdowns(spec, case))  # batch_split: specs/strategies/batching.py

    def cluster_memory(self, spec: PSSpec, case: ClusterCase) -> tuple[float, float | None]:
        # workers hold weights and gradients; the server the weights and the optimizer state
        p, wb = case.workload.params, case.weight_bytes_per_param
        return p * 2 * wb + case.activation_bytes, p * (wb + case.optimizer_bytes_per_param)

    def local_compute_stretch(self, spec: PSSpec, case: LocalCase) -> float | None:
        # Beside a parameter server the workers' compute also meets the server's transport: the
        # transport probe with compute measures that stretch for a matmul (its rounds include the
        # wait for the other workers' pushes); the workload's own kernels side by side, where timed,
        # are what these workers compute.
        if case.kernel_stretch is not None:
            return case.kernel_stretch
        return ps_compute_stretch(case.profile, case.world, case.alone_s)

    def local_compute_extra_s(self, spec: PSSpec, case: LocalCase) -> tuple[float, list[str]]:
        """Asynchronous workers do not compute in lockstep: while one computes, the server serves the
        others' exchanges on the same cores (`served_beside_compute_s`)."""
        if spec.averages_rounds:  # a synchronous round: the workers compute together, the server waits
            return 0.0, []
        stretch = self.local_compute_stretch(spec, case)
        extra_s = served_beside_compute_s(case, exchange_parts(spec, case),
                                          case.alone_s * (case.side_by_side_stretch() if stretch is None else stretch))
        if extra_s <= 0:
            return 0.0, []
        return extra_s, [f"ps: the server serves the other workers' exchanges on the cores a worker computes on: "
                         f"{extra_s * 1e3:.2f} ms more compute a step"]

    def local_memory(self, spec: PSSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        full = int(case.param_bytes)
        server_shard = -(-full // 4 // spec.servers) * 4  # ceil over fp32 elements
        return {"worker": {"parameters": full, "gradients": full, "optimizer": 0},
                "server": {"parameters": server_shard, "optimizer": state_tensors(case) * server_shard}}

    def local_comm(self, spec: PSSpec, case: LocalCase, step: LocalStep, between_pushes_s: float = 0.0,
                   staggered: bool = False) -> LocalComm:
        """Each worker flattens its gradients, pushes them (a header and a data message) and pulls the
        parameters through the server's link, which serialises the workers: a round of all pushes and
        answers from the calibrated transport probe (sync: the round, one update; async: workers of
        equal speed arrive together and are served in turn, so the mean one queues behind half of the
        others, and a step lasts at least workers x (its share of the round + update)), then
        unflattens them. `between_pushes_s`: a client's other blocking work between two pushes (an
        omnivore group's all-reduce and broadcast), in its cycle; `staggered`: clients that such work
        keeps apart do not arrive together, so they queue only when the server is saturated. On the
        real network each exchange also waits for the server's and the worker's gloo threads to wake
        on cores the other workers compute on (`exchange_wakeup_s`)."""
        world, servers, mem_bw = case.world, spec.servers, case.memory_bandwidth_bytes_per_s
        x = exchange_parts(spec, case)
        per_server, apply_s, blocks, clients = x.per_server_bytes, x.apply_s, x.blocks, x.clients
        side_by_side, rounds_slowdown = x.side_by_side, x.rounds_slowdown
        exchanged = case.param_bytes if blocks == servers else blocks * per_server
        flatten_s = 2 * 2 * exchanged / mem_bw * step.stretch  # gather the pushed gradients, copy the answer back
        round_s = ps_round_s(case.profile, clients, per_server, case.link, case.alone_s, rounds_slowdown)
        # The transport probe's rounds with compute hold the wait for the other workers' pushes.
        holds_sync_wait = ps_compute_stretch(case.profile, case.world, case.alone_s) is not None
        wakeup_s = exchange_wakeup_s(case, x.measured_round_s, round_s) if holds_sync_wait else 0.0
        if spec.averages_rounds:
            comm_s = round_s + apply_s + flatten_s
        else:
            # Equal workers arrive together and are served in turn: the mean one waits for half of
            # the others; a saturated server (its work per round longer than a worker's cycle) more.
            service_s = round_s / clients + apply_s
            cycle = step.forward_s + step.backward_s + step.zero_grad_s + flatten_s + service_s + between_pushes_s
            together_s = 0.0 if staggered else (clients - 1) / 2 * service_s
            queue_s = max(together_s, clients * service_s - cycle)
            comm_s = service_s + flatten_s + max(queue_s, 0.0)
        comm = LocalComm(comm_s + wakeup_s, holds_sync_wait=holds_sync_wait)
        comm.notes.append(f"ps: the server link serialises the workers' pushes and pulls: one round ({clients:g} "
                          f"workers) {round_s * 1e3:.2f} ms, the server's update {apply_s * 1e3:.2f} ms, "
                          f"flattening a worker's gradients and parameters {flatten_s * 1e3:.2f} ms")
        if wakeup_s > 0:
            comm.notes.append(f"ps: an exchange waits {wakeup_s * 1e3:.2f} ms for the server's and the worker's "
                              f"gloo threads to wake on cores the workers compute on")
        if blocks < servers:
            comm.notes.append(f"ps: block-cyclic: a worker exchanges one of {servers} blocks a step")
        if servers > 1:
            comm.notes.append(f"ps: {side_by_side} server rounds at once share {case.cores} cores "
                              f"(x{rounds_slowdown:.2f} each)")
        return comm


@dataclass(frozen=True)
class ExchangeParts:
    """What one worker's exchange with the servers is made of on this machine (PSEstimator.local_comm)."""

    per_server_bytes: float  # a server's shard
    apply_s: float  # the server's update of its shard per push
    blocks: int  # servers a worker exchanges with in one step (block-cyclic: one)
    clients: float  # pushes a server takes in one round
    side_by_side: int  # server rounds running at once
    rounds_slowdown: float  # how much those rounds stretch each other on the cores
    measured_round_s: float  # one server's round from the transport probe, without any emulated link


def exchange_parts(spec: PSSpec, case: LocalCase) -> ExchangeParts:
    """A worker's exchange with the servers under `spec` on the case's machine, before any emulated link."""
    servers = spec.servers
    per_server = case.param_bytes / servers
    apply_s = (case.per_tensor_s + server_apply_passes(spec, case.world, case.optimizer_kind) * per_server
               / case.memory_bandwidth_bytes_per_s)
    blocks = len(spec.blocks_pushed(0, 0))  # a block-cyclic worker exchanges one block a step
    clients = spec.pushes_per_round(case.world)
    # Servers are processes on the workers' machine: their rounds run side by side only while
    # cores are free (the probe's round, one server and `clients` workers, keeps that many busy).
    side_by_side = min(servers, case.world * blocks)
    rounds_slowdown = concurrent_rounds_slowdown(side_by_side, clients, case.cores)
    measured_round_s = ps_round_s(case.profile, clients, per_server, None, case.alone_s, rounds_slowdown)
    return ExchangeParts(per_server, apply_s, blocks, clients, side_by_side, rounds_slowdown, measured_round_s)


def served_beside_compute_s(case: LocalCase, x: ExchangeParts, compute_s: float) -> float:
    """Compute an asynchronous worker loses, each step, to the server serving the other workers meanwhile.

    Each of the other world - 1 workers exchanges once in a worker's cycle; its exchange keeps the
    servers it pushes to and its own gloo thread (both ends of the loopback copies) runnable for the
    server's real time on it (the probe's round per client + the update; an emulated link's wait is a
    sleep, not CPU). While it runs, the world - 1 computing workers share the cores with those threads:
    each computes at min(1, cores / runnable) of a core instead of the min(1, cores / world) it has
    beside the other workers alone (which the kernels' side-by-side stretch and the turn-taking hold).
    A worker's compute overlaps at most its own length of them, and loses (1 - that ratio) of it.
    """
    if case.world < 2:
        return 0.0
    service_s = x.measured_round_s / x.clients + x.apply_s
    overlap_s = min((case.world - 1) * service_s, compute_s)
    runnable = (case.world - 1) + x.side_by_side + 1
    ratio = min(1.0, case.cores / runnable) / min(1.0, case.cores / case.world)
    return max(1.0 - ratio, 0.0) * overlap_s


def exchange_wakeup_s(case: LocalCase, measured_round_s: float, round_s: float) -> float:
    """What an exchange with the servers waits, beyond the transport probe's round, for gloo's threads to wake.

    A push wakes the server blocked in recv, its answer the worker blocked in wait, each on cores the
    workers compute on: a meeting of ranks, whose wait the synchronisation probe measures (sync_overhead_s,
    at every process of the run, servers too), once an exchange (a worker's pushes to several servers go
    out together and meet at once). The transport probe's rounds, back to back after equal matmul blocks,
    hold less of it than a run's steps: on the two quiet benchmark runs (load ~2) the loopback rows'
    waiting ran 1.4-4.1 ms a step over the probe's round + update + copies, the wait 3.1-4.2 ms there.
    An emulated link's wait is a sleep that the real transfer and its wake-ups run inside of: only what
    of `measured_round_s` (the probe's, without the link) + the wait outlasts the `round_s` priced with
    the link is exposed (none, on the benchmark's custom link).
    """
    meeting_s = sync_at(machine_probe(case.profile, "sync", case.world + case.servers), case.alone_s)[1]
    return max(measured_round_s + meeting_s - round_s, 0.0)


def server_apply_passes(spec: PSSpec, workers: int, opt_kind: str) -> float:
    """Passes over a server's shard per worker step, as runtime/ps_server.py makes them.

    Synchronous rounds keep each push (a clone: read + write), stack them
    (read + write each), sum (all read, one written) and divide (read +
    write), once per round, i.e. per worker step; asynchronous pushes are
    scaled (read + write) each. Then the optimizer step: 3 passes (gradient
    read, parameter read + write) plus 2 per state tensor.
    """
    optimizer = 3 + 2 * STATE_TENSORS[opt_kind]
    if spec.averages_rounds:
        return 2 * workers + 2 * workers + (workers + 1) + 2 + optimizer
    return 2 + optimizer


@ESTIMATORS.register(PSSyncSpec)
class PSSyncEstimator(PSEstimator):
    mode = "sync"


@ESTIMATORS.register(PSAsyncSpec, StaleAwareSpec)
class PSAsyncEstimator(PSEstimator):
    # At cluster scale the stale-aware rate and its periodic barrier are not modelled: both run as async.
    mode = "async"


@ESTIMATORS.register(SSPSpec)
class SSPEstimator(PSEstimator):
    mode = "ssp"

    def cluster(self, spec: SSPSpec, case: ClusterCase) -> pst.StrategyEstimate:
        return parameter_server(case.workload, case.cluster, "ssp", case.server, staleness=spec.staleness,
                                slowdowns=split_slowdowns(spec, case))

    def cluster_notes(self, spec: SSPSpec, case: ClusterCase) -> list[str]:
        if not case.slowdowns:
            return []
        return [f"bounded staleness s={spec.staleness}: a persistent straggler still sets the pace in the long run"]
