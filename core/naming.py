"""How kvwatch names what it points users to: a replica wherever it shows one (lab faults and status,
dashboard pages), its id and its address together, so that a fault's `r2` and a chart's `127.0.0.1:20812`
read as the same replica; a count with its noun agreeing, `1 session`, `2 sessions`; and the runbook the
alerts, the boards and the dashboard link."""

from __future__ import annotations

RUNBOOK = "alerts/runbook.md"  # in the repository
# A page that opens from Slack, PagerDuty, Alertmanager and Grafana, which a repository path does not.
# `make generate RUNBOOK_URL=...` and the config's dashboard.runbook_url move it (to a wiki, an internal
# mirror).
RUNBOOK_URL = f"https://github.com/kvwatch/kvwatch/blob/main/{RUNBOOK}"


def replica_name(address: str | None, replica_id: str | None = None) -> str:
    """`r2 (127.0.0.1:20812)`, or whichever of the two is known."""
    if address and replica_id:
        return f"{replica_id} ({address})"
    return address or replica_id or ""


def plural(count: int, one: str, many: str | None = None) -> str:
    """`1 session`, `2 sessions`; `many` where the plural is not `one` + s (`backend switches`)."""
    return f"{count} {one if count == 1 else many or one + 's'}"
