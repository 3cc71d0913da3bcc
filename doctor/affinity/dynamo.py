"""NVIDIA Dynamo's frontend: session affinity by `X-Dynamo-Session-ID`, but only when the frontend runs
with `--router-session-affinity-ttl-secs N`; without the flag the header is trace identity only, and
its KV router places each round on its own (the doctor's "Dynamo session header sent but affinity off").
It leaves no mark in a response's headers; `nvext.worker_id` names the worker when asked (`router: dynamo`).
"""

from __future__ import annotations

from kvwatch.doctor.affinity.base import Affinity

SESSION_HEADER = "X-Dynamo-Session-ID"
TTL_FLAG = "--router-session-affinity-ttl-secs"


def forward(header: str) -> str:
    if sends_session_header(header):
        return f"it reads {SESSION_HEADER} itself; every hop before it must pass the header on"
    return (
        f"it keeps sessions by {SESSION_HEADER} (or a coding agent's own session header): send the id in it"
    )


def echo(header: str) -> str:
    return "it returns no session header, but names the worker in `nvext.worker_id` (`router: dynamo`)"


def hash_on(header: str) -> str:
    return (
        f"start the frontend with `{TTL_FLAG} N` (without it {SESSION_HEADER} is trace identity only) and "
        f"send the session id in {SESSION_HEADER}"
    )


def sends_session_header(header: str | None) -> bool:
    """Does the route send Dynamo's own session header?"""
    return (header or "").lower() == SESSION_HEADER.lower()


AFFINITY = Affinity("dynamo", "Dynamo", forward, echo, hash_on)
