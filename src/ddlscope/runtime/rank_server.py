"""The process ranks are forked from, started as early as a command knows it will launch ranks.

Ranks start as forks of one server process per launcher that has imported torch and ddlscope's runtime
once (runtime/launcher.py, launch_processes): a spawned rank imported them itself (~3-4 s of every run's
start on this machine, two ranks importing at once on two cores). The server imports them in its own
process, so starting it before the launcher's own imports (torch.distributed's elastic agent, the
runtime) lets both import at once, on two cores, instead of one after the other: ~2 s of a short run's
~9 s here. Torch-free, so that a command can call it before it imports torch's launcher.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver

FORKSERVER_PRELOAD = ["torch", "torch.distributed", "ddlscope.runtime.launcher"]


def start_rank_server(threads_per_rank: int = 1) -> None:
    """Start the fork server now, without waiting for its imports; the first launch uses it (and a
    later call, or a launch, finds it running). OMP_NUM_THREADS is the ranks' while the server imports
    torch, as when the launch itself started it (each rank sets its thread count again)."""
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before
