"""Federated rounds (fedavg, mm-psgd, mc-psgd): local steps, then one weighted model all-reduce per round.

Cluster scale, per local step (advise's unit): local SGD whose period is the
round's local steps (`local_steps`, else NOMINAL_LOCAL_STEPS: a client's data
size is not known at cluster scale), each sampled client training
`models_trained_per_round` models (mc-psgd: two, and two models in the
average), and only `client_fraction` of the workers computing. The slowest
sampled client sets the round (straggler_bound).

This machine, per run step (a round): one all-reduce of the trained models,
the flat copies around it and one synchronisation wait; and the round's
`local_steps` minibatches for each model trained (strategies/federated.py
trains every model of the round on all of them), each read, computed and
stepped as a step of `workload.batch_size` is. With `local_epochs` instead
(the client's data size is not in the facts) a round's compute is priced as
one minibatch, and the notes say so.
"""

from __future__ import annotations

from dataclasses import replace

from ddlscope.calibrate.model import message_s
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.predict.estimators.localsgd import extra_copies_bytes, local_sgd, local_sync_wait_s, straggler_bound
from ddlscope.specs.strategies.federated import FedAvgSpec

NOMINAL_LOCAL_STEPS = 10  # local minibatches per round when the spec gives epochs (data size unknown here)


def local_steps_per_round(spec: FedAvgSpec) -> int:
    return spec.local_steps or NOMINAL_LOCAL_STEPS


def kept_copies(spec: FedAvgSpec) -> float:
    """Flat model copies beside the model states: the averaged buffer per trained model, and the per-block
    predictors (mm-psgd's sums, mc-psgd's sums and chains)."""
    per_block = spec.blocks * (spec.models_trained_per_round()) if spec.per_block() else 0
    return spec.models_trained_per_round() + per_block


# strategies/averaging.py: flat_parameters concatenates the parameters and clones the result (two passes
# over the model); load_flat_parameters makes them views of the flat vector (torch's vector_to_parameters
# rebinds param.data: no pass)
FLAT_PASSES, LOAD_PASSES = 2, 0


def round_copies(spec: FedAvgSpec) -> tuple[int, int]:
    """Passes over one model's bytes a round makes (strategies/federated.py train_step): (before and
    between the trainings: the round's start model flattened (mc-psgd: and the chain cloned), each
    loaded, each but the last flattened after training; in the synchronize phase: the last one
    flattened, all concatenated and scaled by the client's weight). What follows the average (loading
    it, the per-block sums) falls between the run's steps and no step holds it."""
    models = spec.models_trained_per_round()
    before = FLAT_PASSES + (models - 1) + models * LOAD_PASSES + (models - 1) * FLAT_PASSES
    return before, FLAT_PASSES + 2 * models


def round_spread_wait_s(spec: FedAvgSpec, case: LocalCase) -> float:
    """How much longer than one minibatch's the mean client waits at the average for the slowest: the
    clients meet once a round, after all its minibatches, and a rank that is slower than the other
    stays slower for the whole round (a mc-psgd run here: rank 0's thread CPU 98-103 ms a round
    against rank 1's 82-85 ms, four rounds in a row, rank 1 waiting 24-44 ms at each average), so
    the kernels' side-by-side spread (the facts' slowest_wait_s, one minibatch's) adds up over the
    round's minibatches, one per minibatch, not as independent draws would (by the square root of
    their number); local.py adds the one minibatch's wait. Still under it on a quiet machine: mc-psgd's
    ranks arrived 5.9 ms apart a round (3 ms of mean wait) where this priced 1.0 ms."""
    if not spec.traits.synchronous:
        return 0.0
    minibatches = spec.local_steps * spec.models_trained_per_round() if spec.local_steps else 1
    return (minibatches - 1) * case.kernel_slowest_wait_s


@ESTIMATORS.register(FedAvgSpec)
class FederatedEstimator(Estimator):
    def cluster(self, spec: FedAvgSpec, case: ClusterCase) -> pst.StrategyEstimate:
        models = spec.models_trained_per_round()
        steps = local_steps_per_round(spec)
        est = local_sgd(case.workload, case.cluster, period=steps)
        n = case.cluster.n_gpus
        sampled = max(1, round(spec.client_fraction * n)) / n
        # fewer clients compute a round; each trains `models` models on the same samples, one after another
        est = replace(est, strategy=spec.name, step_s=est.step_s * models, compute_s=est.compute_s * models,
                      comm_s=est.comm_s * models, exposed_comm_s=est.exposed_comm_s * models,
                      samples_per_step=est.samples_per_step * sampled, notes=est.notes + [
                          f"{spec.name}: a round of {steps} local steps"
                          + ("" if spec.local_steps else " (nominal: local_epochs over data of unknown size)")
                          + f", {sampled:.0%} of the clients sampled, {models} model(s) trained per round"])
        return straggler_bound(est, case)

    def cluster_memory(self, spec: FedAvgSpec, case: ClusterCase) -> tuple[float, float | None]:
        return (case.replicated_state_bytes + case.activation_bytes
                + extra_copies_bytes(case, kept_copies(spec))), None

    def local_minibatches(self, spec: FedAvgSpec, case: LocalCase) -> float:
        """A round's minibatches: local_steps for each model trained; one where the round is local_epochs."""
        return float(spec.local_steps * spec.models_trained_per_round()) if spec.local_steps else 1.0

    def local_data_reads(self, spec: FedAvgSpec, case: LocalCase) -> float:
        """The round's samples are read once (the run step's batch), whatever the models trained on them."""
        return float(spec.local_steps) if spec.local_steps else 1.0

    def local_compute_factor(self, spec: FedAvgSpec, case: LocalCase) -> float:
        return self.local_minibatches(spec, case)

    def local_compute_extra_s(self, spec: FedAvgSpec, case: LocalCase) -> tuple[float, list[str]]:
        """The round's model copies before and between its trainings, which its forward phases hold."""
        copies = round_copies(spec)[0]
        return copies * case.param_bytes / case.memory_bandwidth_bytes_per_s * case.side_by_side_stretch(), []

    def local_comm(self, spec: FedAvgSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        models = spec.models_trained_per_round()
        payload = models * case.param_bytes
        all_reduce_s = message_s(case.profile, "all_reduce", payload, case.world, case.link)
        copies_s = round_copies(spec)[1] * case.param_bytes / case.memory_bandwidth_bytes_per_s * step.stretch
        comm = LocalComm(all_reduce_s + copies_s + local_sync_wait_s(case) + round_spread_wait_s(spec, case),
                         holds_sync_wait=True)
        comm.notes.append(f"{spec.name}: one weighted all-reduce of {models} model(s) per round "
                          f"({all_reduce_s * 1e3:.2f} ms)" + (
                              f"; a round computes {spec.local_steps} minibatches for each model" if spec.local_steps
                              else "; a round's compute is all its local minibatches (local_epochs over data of a "
                                   "size the facts do not hold), which this estimate prices as one"))
        return comm
