"""The privacy a DP-SGD run spends, from Google's dp-accounting library (torch-free, no accountant of our own).

Each step releases, for every sample, at most one noisy clipped sum it took
part in (a global batch is split over the workers, so a sample is in one
worker's batch at most), with probability `sampling_rate` = global batch /
training samples: a Poisson-sampled Gaussian mechanism, composed over the
steps and turned into epsilon at delta by the Renyi-DP accountant. The data
order here samples batches without replacement per epoch, not by Poisson
sampling; reporting it as Poisson sampling at the same rate is the usual
practice (Opacus, TensorFlow Privacy) and is said so in docs/strategies.md.
"""

from __future__ import annotations

import math


def dp_sgd_epsilon(sampling_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """Epsilon at `delta` after `steps` Poisson-sampled Gaussian steps (RDP accountant); inf without noise."""
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling rate {sampling_rate} outside (0, 1]")
    if not 0 < delta < 1:
        raise ValueError(f"delta {delta} outside (0, 1)")
    if noise_multiplier <= 0:
        return math.inf
    from dp_accounting import dp_event, rdp  # imported here: a second or so, only for private runs

    accountant = rdp.RdpAccountant()
    step = dp_event.PoissonSampledDpEvent(sampling_rate, dp_event.GaussianDpEvent(noise_multiplier))
    accountant.compose(step, steps)
    return float(accountant.get_epsilon(delta))
