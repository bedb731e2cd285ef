"""Omnivore's optimizer (PAPERS.md item 15), torch-free: pick compute groups and momentum from short probes.

Time to a target loss is hardware efficiency times statistical efficiency:
(samples needed to get there) x (time per sample). A probe run of `omnivore`
with k groups and explicit momentum m measures both: time per sample from
its mean step time, and loss decrease per sample from a least-squares line
through its training loss against samples seen. The prediction extrapolates
that line from the common start loss to the target; the pair with the least
predicted time wins.

More groups are faster per sample (less waiting inside a group, none across)
but add implicit momentum, about 1 - 1/k (specs/strategies/omnivore.py), so
the candidates lower the explicit momentum as groups grow, keeping the total
at the target (`compensated_momentum`); with `keep_momentum` each k > 1 is
also probed at the target itself, to show what the lowering buys.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ddlscope.specs.strategies.omnivore import compensated_momentum


@dataclass(frozen=True)
class Probe:
    """One short run of omnivore: its setting and what it measured."""

    groups: int
    momentum: float  # explicit
    step_s: float  # mean wall time of a step (every worker one step)
    samples_per_step: int  # the global batch
    losses: tuple[float, ...]  # training loss per step, the mean over the workers

    @property
    def time_per_sample_s(self) -> float:
        """Hardware efficiency (lower is better)."""
        return self.step_s / self.samples_per_step

    @property
    def loss_drop_per_sample(self) -> float:
        """Statistical efficiency: minus the slope of the least-squares line of loss against samples seen."""
        if len(self.losses) < 2:
            return 0.0
        samples = [step * self.samples_per_step for step in range(len(self.losses))]
        slope = statistics.linear_regression(samples, list(self.losses)).slope
        return -slope

    def predicted_time_to_s(self, start_loss: float, target_loss: float) -> float:
        """Seconds to go from `start_loss` to `target_loss` at this probe's two efficiencies (inf: it does not
        learn)."""
        drop = self.loss_drop_per_sample
        if drop <= 0:
            return math.inf
        return max(start_loss - target_loss, 0.0) / drop * self.time_per_sample_s


def check_settings(workers: int, momentum: float, groups: list[int] | None = None,
                   target_loss: float | None = None) -> None:
    """Refuse (ValueError, one line naming the flag) what the tuner cannot probe: no workers, a group count
    that does not divide them (0 divided by zero picking its momentum), a target loss that is not a number
    (nan compared as no probe reaching it, and the pick said so quietly)."""
    if workers < 1:
        raise ValueError(f"--workers = {workers}: must be >= 1")
    for k in groups or []:
        if k < 1 or workers % k:
            allowed = ", ".join(str(d) for d in range(1, workers + 1) if workers % d == 0)
            raise ValueError(f"--groups = {k}: must divide --workers = {workers} (equal compute groups); "
                             f"allowed: {allowed}")
    if not math.isfinite(momentum) or not 0 <= momentum < 1:
        raise ValueError(f"--momentum = {momentum}: must be a number from 0 to below 1")
    if target_loss is not None and not math.isfinite(target_loss):
        raise ValueError(f"--target-loss = {target_loss}: must be a finite number")


def candidates(workers: int, momentum: float, groups: list[int] | None = None,
               keep_momentum: bool = True) -> list[tuple[int, float]]:
    """(groups, explicit momentum) pairs to probe: every k that divides the workers (or those given), each
    with the momentum lowered by its implicit momentum, and with `keep_momentum` also at `momentum` itself."""
    ks = groups or [k for k in range(1, workers + 1) if workers % k == 0]
    pairs: list[tuple[int, float]] = []
    for k in ks:
        for m in (compensated_momentum(momentum, k), momentum if keep_momentum else None):
            if m is not None and (k, m) not in pairs:
                pairs.append((k, m))
    return pairs


@dataclass
class Choice:
    best: Probe
    start_loss: float
    target_loss: float
    predicted_s: dict[tuple[int, float], float]  # (groups, momentum) -> predicted seconds to the target
    reason: str


def default_target(probes: list[Probe]) -> tuple[float, float]:
    """(start loss, target loss): every probe starts from the same model and batch, so the start is their
    first loss (the mean); the target is halfway from there to the lowest loss any probe reached."""
    start = statistics.fmean(p.losses[0] for p in probes)
    lowest = min(min(p.losses) for p in probes)
    return start, start - (start - lowest) / 2


def choose(probes: list[Probe], target_loss: float | None = None) -> Choice:
    """The probe with the least predicted time to the target loss, and one line of why."""
    if not probes:
        raise ValueError("no probes to choose from")
    start, default = default_target(probes)
    target = default if target_loss is None else target_loss
    predicted = {(p.groups, p.momentum): p.predicted_time_to_s(start, target) for p in probes}
    ranked = sorted(probes, key=lambda p: (predicted[(p.groups, p.momentum)], p.groups))
    best = ranked[0]
    return Choice(best, start, target, predicted, _reason(best, ranked[1:], predicted, target))


def _reason(best: Probe, others: list[Probe], predicted: dict[tuple[int, float], float], target: float) -> str:
    best_s = predicted[(best.groups, best.momentum)]
    if math.isinf(best_s):
        return f"no probe lowered the loss towards {target:.3f}; probe longer or with a smaller learning rate"
    line = (f"groups={best.groups}, momentum={best.momentum:g}: {best_s:.3g} s predicted to loss {target:.3f} "
            f"({best.time_per_sample_s * 1e6:.0f} us a sample x {1 / best.loss_drop_per_sample:.0f} samples "
            f"per unit of loss)")
    if others:
        runner = others[0]
        runner_s = predicted[(runner.groups, runner.momentum)]
        faster = "faster per sample" if best.time_per_sample_s < runner.time_per_sample_s else "slower per sample"
        learns = ("learns more per sample" if best.loss_drop_per_sample > runner.loss_drop_per_sample
                  else "learns less per sample")
        ahead = "never gets there" if math.isinf(runner_s) else f"{runner_s:.3g} s"
        line += (f"; the next, groups={runner.groups}, momentum={runner.momentum:g}: {ahead} "
                 f"(the choice is {faster} and {learns})")
    return line


def table_rows(choice: Choice, probes: list[Probe]) -> list[dict[str, str]]:
    """What each probe measured and predicts, for the terminal table (the chosen one marked)."""
    rows = []
    for p in probes:
        s = choice.predicted_s[(p.groups, p.momentum)]
        rows.append({
            "groups": str(p.groups), "momentum": f"{p.momentum:g}",
            "implicit": f"{1 - 1 / p.groups:.2f}",
            # three significant digits: a 1.85 ms step is not "1.8" beside its "58" us per sample
            "ms/step": f"{p.step_s * 1e3:.3g}", "us/sample": f"{p.time_per_sample_s * 1e6:.0f}",
            "loss drop/1k samples": f"{p.loss_drop_per_sample * 1e3:.3f}",
            "predicted s": "inf" if math.isinf(s) else f"{s:.3g}",
            "chosen": "<-" if p is choice.best else ""})
    return rows
