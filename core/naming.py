"""How kvwatch names things wherever it shows them: a replica (lab faults and status, dashboard pages) by
its id and its address together, so that a fault's `r2` and a chart's `127.0.0.1:20812` read as the same
replica; and a count with its noun agreeing, `1 session`, `2 sessions`."""

from __future__ import annotations


def replica_name(address: str | None, replica_id: str | None = None) -> str:
    """`r2 (127.0.0.1:20812)`, or whichever of the two is known."""
    if address and replica_id:
        return f"{replica_id} ({address})"
    return address or replica_id or ""


def plural(count: int, one: str, many: str | None = None) -> str:
    """`1 session`, `2 sessions`; `many` where the plural is not `one` + s (`backend switches`)."""
    return f"{count} {one if count == 1 else many or one + 's'}"
