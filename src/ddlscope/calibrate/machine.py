"""`calibrate()`: the whole profile of this machine, as the dict profile.py declares and writes.

Compute in this process, then per world size one launch of gloo ranks that time
the collectives and run the probes (probes.py); every collective fitted twice
(fit.py): its median and its fastest repeats.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from ddlscope.calibrate.fit import fit_alpha_beta
from ddlscope.calibrate.probes import COLLECTIVES, PROBES, measure_collectives, measure_compute
from ddlscope.calibrate.profile import CalibrationProfile


def message_sizes(quick: bool) -> list[int]:
    """~1 KiB .. 16 MiB (quick: x4 steps) or 32 MiB (x2 steps), in bytes, multiples of 4*8."""
    top, factor = (16 << 20, 4) if quick else (32 << 20, 2)
    sizes, s = [], 1024
    while s <= top:
        sizes.append(s)
        s *= factor
    return sizes


def calibrate(world_sizes: list[int], quick: bool = False) -> dict[str, Any]:
    """The whole hardware profile as a dict (written to TOML by `write_profile`)."""
    import torch

    sizes = message_sizes(quick)
    repeats = 3 if quick else 5
    profile: dict[str, Any] = {
        "meta": {"created_at": time.time(), "host": socket.gethostname(), "cores": os.cpu_count() or 1,
                 "torch": torch.__version__, "quick": quick, "backend": "gloo",
                 "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                 "load_average_1min": os.getloadavg()[0]},  # other work on the machine skews every figure
        "compute": measure_compute(quick),
        "collectives": {},
    }
    profile.update({probe: {} for probe in PROBES})
    for ws in world_sizes:
        measured = measure_collectives(ws, sizes, repeats, quick)
        entry: dict[str, Any] = {}
        for op in COLLECTIVES:
            payload = [s // ws // 4 * 4 if op == "all_gather" else s for s in sizes]
            typical, fastest = measured["median"][op], measured["fastest"][op]
            entry[op] = {**fit_alpha_beta(payload, typical), "sizes": payload, "seconds": typical,
                         "fastest": {**fit_alpha_beta(payload, fastest), "seconds": fastest}}
        profile["collectives"][f"ws{ws}"] = entry
        for probe in PROBES:
            profile[probe][f"ws{ws}"] = measured[probe]
    # The layout profile.py declares: a probe whose output drifts from it fails here, not in a later load.
    CalibrationProfile.model_validate(profile)
    return profile
