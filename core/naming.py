"""How kvwatch names a replica wherever it shows one (lab faults and status, dashboard pages): its id and
its address together, so that a fault's `r2` and a chart's `127.0.0.1:20812` read as the same replica."""

from __future__ import annotations


def replica_name(address: str | None, replica_id: str | None = None) -> str:
    """`r2 (127.0.0.1:20812)`, or whichever of the two is known."""
    if address and replica_id:
        return f"{replica_id} ({address})"
    return address or replica_id or ""
