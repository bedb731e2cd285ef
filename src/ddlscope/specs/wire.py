"""Bytes one collective puts on one rank's link, as a multiple of its payload.

Ring algorithms (Patarasuk & Yuan): the network emulation (strategies/comm.py)
waits for these bytes and the local predictor (calibrate/model.py) prices
them, so both read this one table.
"""

from __future__ import annotations

from typing import Callable

WIRE_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,  # reduce-scatter + all-gather of the payload
    "reduce_scatter": lambda n: (n - 1) / n,  # payload = the full input
    "all_gather": lambda n: n - 1,  # payload = this rank's shard; it receives n-1 of them
    "all_to_all": lambda n: 1.0,  # payload = what this rank sends to the others (uneven splits allowed)
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}


def wire_bytes(kind: str, payload_bytes: float, ranks: int) -> float:
    """Bytes on one rank's link for one message of `kind` among `ranks` members (none alone, but p2p)."""
    return payload_bytes * WIRE_FACTORS[kind](max(ranks, 1)) if ranks > 1 or kind == "p2p" else 0.0
