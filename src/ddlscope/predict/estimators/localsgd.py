"""The model-averaging family (localsgd, diloco, cocod): one all-reduce of the model every `period` steps.

Cluster scale: a step is the slowest worker's compute (the average waits for
it) plus the average amortised over its period; hierarchical local SGD adds
the within-node average every `group_period` steps on the node's links;
CoCoD hides the average behind the next round's compute, so only what
exceeds `period` steps of compute shows. The warm-up's DDP steps are not in
the per-step estimate (they are a fixed number of steps at the start).

This machine: the average costs the calibrated gloo all-reduce of the
parameters (or the emulated link's time, if longer), two passes over them
(flatten, copy back) and one synchronisation wait (the calibrated
`sync_overhead_s`), as often as the run averages within the steps its mean
step is taken over (step 0 is left out; it averages after step 0, so a
12-step diloco run of period 20 waits for no average in them: issue 38's
+32%); once per period where the run's length is not known.

CoCoD on this machine (strategies/localsgd.py CoCoD): the average launched
after step s lands at the next average's step, or at the run's last step
(nothing stays in flight past the run), so it hides behind the steps in
between, not a whole period: a 12-step run of period 8 launches after steps
0 and 8 and waits at step 11 for what 3 steps did not hide (the emulated
36 ms average of the benchmark's row: ~18 ms, where a whole period hid it
all). And while it is in flight, gloo's thread moves the real bytes on the
ranks' own cores when they have no spare one: the rank's compute stretches
by the all-reduce's calibrated time (the row's forward and backward ran
~0.3-0.5 ms a step above localsgd's on the same model in the same runs).
Its synchronize phases pass over the model more than torch's averager does:
launching an average flattens the model into the snapshot, clones it into the
buffer in flight and divides that; landing flattens the model again, takes
the progress since the snapshot and adds it to the average (`cocod_passes`):
4 passes each, a 12-step run of period 8 making 12 in its 11 measured steps
(one launch, two landings) where two were priced.
"""

from __future__ import annotations

from dataclasses import replace

from ddlscope.calibrate.model import machine_probe, message_s, sync_at
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.predict.catalogue import Cluster
from ddlscope.specs import ConfigError
from ddlscope.specs.strategies.localsgd import CoCoDSpec, DiLoCoSpec, LocalSGDSpec, ModelAveragingSpec


def local_sgd(workload: pst.Workload, cluster: Cluster, period: int = 8, overlap: bool = False,
              algorithm: coll.Algorithm = "auto") -> pst.StrategyEstimate:
    """Average the weights every `period` local steps (local SGD / periodic averaging).

    overlap=True is CoCoD-SGD: the average runs while the next period's
    local steps compute, so only what exceeds `period` steps of compute shows.
    """
    if period < 1:
        raise ConfigError(f"period = {period}: must be >= 1")
    n, g = cluster.n_gpus, cluster.gpus_per_node
    c = pst.compute_s(workload, cluster)
    average = float(coll.all_reduce_s(workload.params * 4.0, n, min(n, g), cluster.node, algorithm))
    exposed_per_period = max(average - period * c, 0.0) if overlap else average
    step = c + exposed_per_period / period
    mem = (workload.params * (workload.state_bytes_per_param + 4.0)  # + the copy being averaged
           + workload.activation_bytes_per_sample * workload.batch_per_worker)
    return pst.StrategyEstimate("cocod" if overlap else "local-sgd", n, step, c, average / period,
                                exposed_per_period / period, mem, n * workload.batch_per_worker,
                                pst.single_samples_per_s(workload, cluster))


def straggler_bound(est: pst.StrategyEstimate, case: ClusterCase) -> pst.StrategyEstimate:
    """A strategy that meets every worker at its synchronisations runs at the slowest one's compute."""
    slowest = max(case.slowdowns) if case.slowdowns else 1.0
    if slowest <= 1.0:
        return est
    extra_s = est.compute_s * (slowest - 1.0)
    return replace(est, step_s=est.step_s + extra_s, compute_s=est.compute_s + extra_s, notes=est.notes + [
        f"waits for a {slowest:g}x slower worker at each synchronisation"])


def extra_copies_bytes(case: ClusterCase, copies: float) -> float:
    """Flat copies of the model a strategy keeps beside the model states (buffers in flight, anchors)."""
    return copies * case.workload.params * case.weight_bytes_per_param


def local_model_all_reduce_s(case: LocalCase, step: LocalStep, fraction: float = 1.0) -> tuple[float, float]:
    """(the all-reduce of the flat model, `fraction` of its bytes on the wire; flattening and copying it back)
    on this machine."""
    all_reduce_s = message_s(case.profile, "all_reduce", case.param_bytes * fraction, case.world, case.link)
    copies_s = 2 * case.param_bytes / case.memory_bandwidth_bytes_per_s * step.stretch
    return all_reduce_s, copies_s


def model_pass_s(case: LocalCase, stretch: float) -> float:
    """One pass over the model's bytes (a copy, a flatten, an elementwise op making a model-sized tensor) at
    the calibrated memory bandwidth, stretched as the rank's compute is."""
    return case.param_bytes / case.memory_bandwidth_bytes_per_s * stretch


# torch's PeriodicModelAverager flattens the parameters into one buffer and copies the average back
AVERAGER_PASSES = 2


def local_sync_wait_s(case: LocalCase) -> float:
    """The calibrated wait of ranks meeting at a synchronisation (gloo's threads waking)."""
    return sync_at(machine_probe(case.profile, "sync", case.world), case.alone_s)[1]


class ModelAveragingEstimator(Estimator):
    copies = 1.0  # flat model copies beside the model states: the buffer torch's averager all-reduces

    def overlaps(self, spec: ModelAveragingSpec) -> bool:
        """Whether the average hides behind the next round's compute (CoCoD)."""
        return False

    def average_fraction(self, spec: ModelAveragingSpec) -> float:
        """The average's bytes against an fp32 model (localsgd's compression knob)."""
        return 1.0

    def cluster(self, spec: ModelAveragingSpec, case: ClusterCase) -> pst.StrategyEstimate:
        est = local_sgd(case.workload, case.cluster, period=spec.period, overlap=self.overlaps(spec))
        est.strategy = spec.name
        est = _compressed_average(est, case, self.average_fraction(spec))
        est = self._group_average(spec, case, est)
        return straggler_bound(est, case)

    def _group_average(self, spec: ModelAveragingSpec, case: ClusterCase,
                       est: pst.StrategyEstimate) -> pst.StrategyEstimate:
        return est

    def cluster_memory(self, spec: ModelAveragingSpec, case: ClusterCase) -> tuple[float, float | None]:
        return case.replicated_state_bytes + case.activation_bytes + extra_copies_bytes(case, self.copies), None

    def local_comm(self, spec: ModelAveragingSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        all_reduce_s, _ = local_model_all_reduce_s(case, step, self.average_fraction(spec))
        rate = measured_averages_per_step(spec, case)
        if self.overlaps(spec):
            # a step's compute hides the average in flight (as the run's own, without comm)
            exposed_per_step_s = exposed_in_flight_s(spec, case, all_reduce_s,
                                                     step.forward_s + step.backward_s + step.zero_grad_s)
        else:
            exposed_per_step_s = all_reduce_s * rate
        passes_s = self.model_passes_per_step(spec, case) * model_pass_s(case, step.stretch)
        comm = LocalComm(exposed_per_step_s + passes_s + local_sync_wait_s(case) * rate, holds_sync_wait=True)
        comm.notes.append(f"{spec.name}: one model all-reduce {all_reduce_s * 1e3:.2f} ms"
                          + (f" ({exposed_per_step_s * 1e3:.2f} ms a step not hidden by the steps until it lands)"
                             if self.overlaps(spec) else "")
                          + (f", every {1 / rate:g} steps" if rate else ", none within the run's measured steps"))
        return comm

    def local_waits_per_step(self, spec: ModelAveragingSpec, case: LocalCase) -> float:
        """A rank waits only at its averages (the steps between go straight on)."""
        return measured_averages_per_step(spec, case)

    def model_passes_per_step(self, spec: ModelAveragingSpec, case: LocalCase) -> float:
        """Passes over the model's bytes a measured step makes around its averages (synchronize phase)."""
        return AVERAGER_PASSES * measured_averages_per_step(spec, case)

    def local_compute_extra_s(self, spec: ModelAveragingSpec, case: LocalCase) -> tuple[float, list[str]]:
        """An average in flight (CoCoD) moves its bytes on gloo's thread while the ranks compute: on a
        machine with no core to spare, that thread's time (the all-reduce's calibrated time, without the
        emulated link, which only waits) comes out of the rank's compute, once per average launched."""
        if not self.overlaps(spec) or case.world + case.servers < case.cores:
            return 0.0, []
        transfer_s = message_s(case.profile, "all_reduce", case.param_bytes * self.average_fraction(spec),
                               case.world, None)
        extra_s = transfer_s * averages_in_flight_per_step(spec, case)
        return extra_s, [f"{spec.name}: the average in flight moves its bytes on the ranks' cores "
                         f"({transfer_s * 1e3:.2f} ms each, {extra_s * 1e3:.2f} ms a step of compute)"]


def measured_averages_per_step(spec: ModelAveragingSpec, case: LocalCase) -> float:
    """Averages per step within the steps the run's mean is taken over (the spec's schedule played over
    them); the long-run rate, one per period, where the run's length is not known."""
    steady = case.steady_steps()
    if steady is None:
        return spec.averages_per_step()
    return sum(1 for step in steady if spec.averages_after(step) is not None) / len(steady)


def in_flight_averages(spec: ModelAveragingSpec, steps: int) -> list[tuple[int, int]]:
    """(launched after step, lands in step) of each average of a `steps`-step CoCoD run: it lands when
    the next average is launched, or at the last step (the runtime lets nothing stay in flight past it)."""
    launches = [s for s in range(steps) if spec.averages_after(s) == "all"]
    return [(s, launches[i + 1] if i + 1 < len(launches) else steps - 1) for i, s in enumerate(launches)]


def cocod_passes() -> tuple[int, int]:
    """Passes over the model's bytes of (launching, landing) one CoCoD average (strategies/localsgd.py CoCoD):
    launching flattens the model into the snapshot, clones it into the buffer in flight and divides that
    in place (2 + 1 + 1); landing flattens the model (2), takes the progress since the snapshot (1), adds
    it to the average (1) and loads the sum (views, no pass)."""
    # imported here: federated's estimator imports this module
    from ddlscope.predict.estimators.federated import FLAT_PASSES, LOAD_PASSES

    return FLAT_PASSES + 2, FLAT_PASSES + 2 + LOAD_PASSES


def landings_per_step(spec: ModelAveragingSpec, case: LocalCase, overlap: bool) -> float:
    """CoCoD averages landing (merged into the model) within the measured steps, per step: in the step
    it was launched without overlap, else at the next launch or the run's last step (`in_flight_averages`);
    one per period where the run's length is not known."""
    steady = case.steady_steps()
    if steady is None or case.steps is None:
        return spec.averages_per_step()
    if not overlap:
        return measured_averages_per_step(spec, case)
    return sum(1 for _, lands in in_flight_averages(spec, case.steps) if lands in steady) / len(steady)


def exposed_in_flight_s(spec: ModelAveragingSpec, case: LocalCase, all_reduce_s: float, step_compute_s: float) -> float:
    """Seconds a step waits for averages in flight: each waits out what the steps between its launch and
    its landing did not hide, counted where it lands within the measured steps; a period's steps hide
    each where the run's length is not known."""
    steady = case.steady_steps()
    if steady is None or case.steps is None:
        return max(all_reduce_s - spec.period * step_compute_s, 0.0) * spec.averages_per_step()
    waits = [max(all_reduce_s - (lands - launched) * step_compute_s, 0.0)
             for launched, lands in in_flight_averages(spec, case.steps) if lands in steady]
    return sum(waits) / len(steady)


def averages_in_flight_per_step(spec: ModelAveragingSpec, case: LocalCase) -> float:
    """Averages whose bytes move during the measured steps (launched after step s, they move in step s + 1;
    one launched after the last step lands at once, its transfer inside the wait); one per period where
    the run's length is not known."""
    steady = case.steady_steps()
    if steady is None or case.steps is None:
        return spec.averages_per_step()
    return sum(1 for launched, lands in in_flight_averages(spec, case.steps)
               if lands > launched and launched + 1 in steady) / len(steady)


def _compressed_average(est: pst.StrategyEstimate, case: ClusterCase, fraction: float) -> pst.StrategyEstimate:
    """The estimate with the model average's all-reduce at `fraction` of its fp32 bytes (and two casts)."""
    if fraction == 1.0:
        return est
    n, g, node = case.cluster.n_gpus, case.cluster.gpus_per_node, case.cluster.node
    full_bytes = case.workload.params * 4.0
    ratio = float(coll.all_reduce_s(full_bytes * fraction, n, min(n, g), node) / coll.all_reduce_s(full_bytes, n,
                                                                                                 min(n, g), node))
    return replace(est, step_s=est.step_s - est.exposed_comm_s * (1 - ratio), comm_s=est.comm_s * ratio,
                   exposed_comm_s=est.exposed_comm_s * ratio)


@ESTIMATORS.register(LocalSGDSpec)
class LocalSGDEstimator(ModelAveragingEstimator):
    def average_fraction(self, spec: LocalSGDSpec) -> float:  # type: ignore[override]
        return 0.5 if spec.compression != "none" else 1.0
    def _group_average(self, spec: LocalSGDSpec, case: ClusterCase,
                       est: pst.StrategyEstimate) -> pst.StrategyEstimate:
        """Within-group averages every group_period steps, on the links inside a node."""
        if not spec.group_period:
            return est
        per_node = case.cluster.gpus_per_node
        group = spec.group_size or per_node
        bytes_ = case.workload.params * 4.0
        group_s = float(coll.all_reduce_s(bytes_, group, min(group, per_node), case.cluster.node))
        # The steps that average across all ranks skip the group average (torch's hierarchy).
        group_share = 1.0 / spec.group_period - 1.0 / spec.period
        extra_s = group_s * group_share
        return replace(est, step_s=est.step_s + extra_s, comm_s=est.comm_s + extra_s,
                       exposed_comm_s=est.exposed_comm_s + extra_s)


@ESTIMATORS.register(DiLoCoSpec)
class DiLoCoEstimator(LocalSGDEstimator):
    copies = 3.0  # the averaged buffer, the anchor (model at the last outer step) and its outer momentum


@ESTIMATORS.register(CoCoDSpec)
class CoCoDEstimator(ModelAveragingEstimator):
    copies = 2.0  # the snapshot and the buffer in flight

    def overlaps(self, spec: CoCoDSpec) -> bool:
        return spec.overlap

    def model_passes_per_step(self, spec: CoCoDSpec, case: LocalCase) -> float:  # type: ignore[override]
        launch, land = cocod_passes()
        return (launch * measured_averages_per_step(spec, case)
                + land * landings_per_step(spec, case, self.overlaps(spec)))
