"""The parameter-server family: ps-sync, ps-async, ssp, ps-stale-aware."""

from __future__ import annotations

from typing import ClassVar, Literal

from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, split_slowdowns,
                                              state_tensors)
from ddlscope.calibrate.model import STATE_TENSORS, concurrent_rounds_slowdown, ps_compute_stretch, ps_round_s
from ddlscope.specs.strategies.ps import PSAsyncSpec, PSSpec, PSSyncSpec, SSPSpec, StaleAwareSpec


class PSEstimator(Estimator):
    """Workers push gradients and pull parameters through the servers' links; the servers step."""

    mode: ClassVar[Literal["sync", "async", "ssp"]]

    def cluster(self, spec: PSSpec, case: ClusterCase) -> pst.StrategyEstimate:
        return pst.parameter_server(case.workload, case.cluster, self.mode, case.server,
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

    def local_memory(self, spec: PSSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        full = int(case.param_bytes)
        server_shard = -(-full // 4 // spec.servers) * 4  # ceil over fp32 elements
        return {"worker": {"parameters": full, "gradients": full, "optimizer": 0},
                "server": {"parameters": server_shard, "optimizer": state_tensors(case) * server_shard}}

    def local_comm(self, spec: PSSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """Each worker flattens its gradients, pushes them (a header and a data message) and pulls the
        parameters through the server's link, which serialises the workers: a round of all pushes and
        answers from the calibrated transport probe (sync: the round, one update; async: workers of
        equal speed arrive together and are served in turn, so the mean one queues behind half of the
        others, and a step lasts at least workers x (its share of the round + update)), then
        unflattens them."""
        world, servers, mem_bw = case.world, spec.servers, case.memory_bandwidth_bytes_per_s
        per_server = case.param_bytes / servers
        apply_s = case.per_tensor_s + server_apply_passes(spec, world, case.optimizer_kind) * per_server / mem_bw
        blocks = len(spec.blocks_pushed(0, 0))  # a block-cyclic worker exchanges one block a step
        exchanged = case.param_bytes if blocks == servers else blocks * per_server
        flatten_s = 2 * 2 * exchanged / mem_bw * step.stretch  # gather the pushed gradients, copy the answer back
        clients = spec.pushes_per_round(world)
        # Servers are processes on the workers' machine: their rounds run side by side only while
        # cores are free (the probe's round, one server and `clients` workers, keeps that many busy).
        side_by_side = min(servers, world * blocks)
        rounds_slowdown = concurrent_rounds_slowdown(side_by_side, clients, case.cores)
        round_s = ps_round_s(case.profile, clients, per_server, case.link, case.alone_s, rounds_slowdown)
        if spec.averages_rounds:
            comm_s = round_s + apply_s + flatten_s
        else:
            # Equal workers arrive together and are served in turn: the mean one waits for half of
            # the others; a saturated server (its work per round longer than a worker's cycle) more.
            service_s = round_s / clients + apply_s
            cycle = step.forward_s + step.backward_s + step.zero_grad_s + flatten_s + service_s
            queue_s = max((clients - 1) / 2 * service_s, clients * service_s - cycle)
            comm_s = service_s + flatten_s + max(queue_s, 0.0)
        # The transport probe's rounds with compute hold the wait for the other workers' pushes.
        comm = LocalComm(comm_s, holds_sync_wait=ps_compute_stretch(case.profile, case.world, case.alone_s) is not None)
        comm.notes.append(f"ps: the server link serialises the workers' pushes and pulls: one round ({clients:g} "
                          f"workers) {round_s * 1e3:.2f} ms, the server's update {apply_s * 1e3:.2f} ms, "
                          f"flattening a worker's gradients and parameters {flatten_s * 1e3:.2f} ms")
        if blocks < servers:
            comm.notes.append(f"ps: block-cyclic: a worker exchanges one of {servers} blocks a step")
        if servers > 1:
            comm.notes.append(f"ps: {side_by_side} server rounds at once share {case.cores} cores "
                              f"(x{rounds_slowdown:.2f} each)")
        return comm


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
        return pst.parameter_server(case.workload, case.cluster, "ssp", case.server, staleness=spec.staleness,
                                    slowdowns=split_slowdowns(spec, case))

    def cluster_notes(self, spec: SSPSpec, case: ClusterCase) -> list[str]:
        if not case.slowdowns:
            return []
        return [f"bounded staleness s={spec.staleness}: a persistent straggler still sets the pace in the long run"]
