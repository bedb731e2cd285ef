"""The fits of a calibration (numpy only): time = alpha + bytes / beta per collective, and time =
overhead + flops / peak over square matmuls.

The alpha-beta fit: gloo on loopback is noisy at small sizes (scheduler
wake-ups are tens of microseconds, comparable to the whole message), so one
least-squares fit over all sizes gives a poorly determined (often negative)
intercept. Instead beta comes from a least-squares fit of time = a + bytes/beta
on the sizes where bandwidth dominates (>= 64 KiB), with its R^2, and alpha is
the median, over the small sizes (<= 16 KiB), of time - bytes/beta: a direct
latency estimate. R^2 over all sizes with that (alpha, beta) is reported too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BANDWIDTH_FIT_MIN_BYTES = 64 * 1024
LATENCY_MAX_BYTES = 16 * 1024


def fit_alpha_beta(sizes: Any, times: Any, min_bw_bytes: int = BANDWIDTH_FIT_MIN_BYTES,
                   max_lat_bytes: int = LATENCY_MAX_BYTES) -> dict[str, float]:
    """time = alpha + bytes / beta: beta from least squares on large sizes, alpha from small ones.

    Falls back to one least-squares fit over everything when either group has too few points.
    Returns alpha_s, beta_bytes_per_s, r2 (on the bandwidth fit), r2_all (all sizes, final model),
    alpha_fit_s (the least-squares intercept).
    """
    x, y = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    big = x >= min_bw_bytes
    if big.sum() < 3:
        big = np.ones_like(x, dtype=bool)
    A = np.stack([np.ones(big.sum()), x[big]], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(A, y[big], rcond=None)
    slope = max(float(slope), 1e-18)
    r2 = _r2(y[big], intercept + slope * x[big])
    small = x <= max_lat_bytes
    if small.sum() >= 1 and big.sum() < len(x):
        alpha = float(np.median(y[small] - x[small] * slope))
    else:
        alpha = float(intercept)
    alpha = max(alpha, 0.0)
    return {"alpha_s": alpha, "beta_bytes_per_s": 1.0 / slope, "r2": r2,
            "r2_all": _r2(y, alpha + slope * x), "alpha_fit_s": float(intercept)}


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


def fit_matmul(sizes: list[int], seconds: list[float]) -> dict[str, float]:
    """time = overhead + flops / peak over square matmuls."""
    flops = [2.0 * n**3 for n in sizes]
    A = np.stack([np.ones(len(sizes)), np.asarray(flops)], axis=1)
    (overhead, inv_peak), *_ = np.linalg.lstsq(A, np.asarray(seconds), rcond=None)
    inv_peak = max(float(inv_peak), 1e-18)
    return {"overhead_s": max(float(overhead), 0.0), "peak_flops": 1.0 / inv_peak,
            "r2": _r2(np.asarray(seconds), overhead + inv_peak * np.asarray(flops))}
