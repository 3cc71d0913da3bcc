"""The interface every kind of lab gateway implements, and what the kinds share: the config generation
both listeners answer, so that a change is known to serve."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvwatch.core.connections import request_sync
from kvwatch.lab.process import LabError, Process, log_tail
from kvwatch.lab.state import LabState

LISTENERS = ("affinity", "round_robin")
GENERATION_PATH = "/-/lab-config"
POLL_INTERVAL_S = 0.05


@dataclass(frozen=True)
class Gateway:
    """Two listeners in front of the replicas: "affinity" keeps each session on one replica, hashing
    its session id (the gateway assigns one to a request without, and returns it), "round_robin"
    spreads requests. Both name the upstream in X-Upstream, stream unbuffered, write a JSON access log
    per listener to logs/gateway-<listener>.jsonl and answer their config generation at
    GENERATION_PATH."""

    name: str
    help: str
    log_format: str  # the collectors.gatewaylogs format of its access logs
    process: Callable[[LabState], Process]
    # Writes its config files for the state (replicas, gateway faults) into the state directory.
    write_configs: Callable[[LabState], None]
    # Makes the running gateway serve the written configs, the way an operator would; returns once it
    # does, with the wall time from which new requests got them (a reload is done only once the old
    # workers have finished their in-flight requests, seconds later), else raises LabError with the
    # gateway's log tail.
    apply: Callable[[LabState], float]
    # Where its admin port (lab.state.Ports.gateway_admin) serves Prometheus metrics; None: no admin port.
    metrics_path: str | None = None
    # Returns once the gateway holds no connection to a stopped replica's port, else raises LabError;
    # None: the gateway needs no wait (it passes a request a pooled connection fails on to another).
    forget_replica: Callable[[LabState, int], None] | None = None


def generation(files: Callable[[str], dict[str, str]]) -> str:
    """A digest of the config files `files(generation)` renders, rendered without one."""
    unstamped = json.dumps(files(""), sort_keys=True)
    return hashlib.sha256(unstamped.encode()).hexdigest()[:16]


def listener_generations(state: LabState) -> dict[str, str]:
    """The config generation each listener answers, or why it did not."""
    answers = {}
    for listener in LISTENERS:
        url = f"http://127.0.0.1:{getattr(state.ports, listener)}{GENERATION_PATH}"
        try:
            answers[listener] = request_sync("GET", url, 2).text.strip()
        except httpx.HTTPError as error:
            answers[listener] = f"no answer ({type(error).__name__})"
    return answers


def await_serving(
    state: LabState, problem: Callable[[], str | None], timeout_s: float, failure: str, log: str
):
    """Return once `problem` finds none; else raise LabError: "<failure> within N s", what it found last
    and the tail of logs/<log>.log."""
    if seen := wait_for(problem, timeout_s):
        raise LabError(
            f"{failure} within {timeout_s:.0f} s: {seen}; logs/{log}.log ends:\n{log_tail(state, log)}"
        )


def wait_for(problem: Callable[[], str | None], timeout_s: float) -> str | None:
    """Poll `problem` until it finds none (None returned) or `timeout_s` passes; the last one found."""
    deadline = time.monotonic() + timeout_s
    while (found := problem()) is not None and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
    return found
