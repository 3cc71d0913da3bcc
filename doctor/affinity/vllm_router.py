"""vllm-router: its consistent_hash policy keys on X-Session-ID (then X-User-ID, X-Tenant-ID,
X-Request-ID, X-Correlation-ID); it forwards custom headers and names no replica in its answers."""

from __future__ import annotations

from kvwatch.doctor.affinity.base import Affinity

KEY_HEADER = "X-Session-ID"


def forward(header: str) -> str:
    return f"it passes {header} on; make every hop in front of it do so too"


def echo(header: str) -> str:
    return f"it returns no session header: check {header} arrives in the replicas' logs"


def hash_on(header: str) -> str:
    key = (
        "" if header.lower() == KEY_HEADER.lower() else f"; it reads no {header}: send the id as {KEY_HEADER}"
    )
    return f"`--policy consistent_hash` (or `sticky_least_loaded`), keyed by {KEY_HEADER}{key}"


AFFINITY = Affinity("vllm-router", "vllm-router", forward, echo, hash_on)
