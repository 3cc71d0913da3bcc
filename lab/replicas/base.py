"""The interface every kind of lab replica implements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvwatch.lab.process import Process
from kvwatch.lab.sessions import ENABLE_VARIABLE, EXPIRATION_VARIABLE
from kvwatch.lab.state import LabState, ReplicaSpec

# The lab fault that restarts every replica without SAGEMAKER_ENABLE_STATEFUL_SESSIONS.
DISABLE_SESSIONS = "disable-sessions"


@dataclass(frozen=True)
class ReplicaKind:
    name: str
    # Checks what the kind needs and gets it ready (an install, a model); raises LabError.
    prepare: Callable[[LabState], None]
    process: Callable[[LabState, ReplicaSpec], Process]
    # The flavour of metrics its replicas export, when the kind fixes it (a real engine does).
    flavour: str | None
    # True: prefix caching switches at runtime (the simulator's admin API); False: only by a restart
    # with other flags, as on a real engine.
    live_prefix_caching: bool
    help: str
    # kvwatch serve's probes in this lab: seconds between runs with --fast, and workload settings
    # that replace the example config's (a CPU engine wants shorter conversations).
    fast_probe_interval_s: float
    probe_workload: dict = field(default_factory=dict)
    # True: the replica serves the lab's admin API (/lab/faults, /lab/expire-sessions...), as the
    # simulator does.
    admin_api: bool = False


def container_environment(state: LabState, replica: ReplicaSpec) -> dict[str, str]:
    """What a replica behind the sagemaker gateway reads as a SageMaker container: stateful sessions on
    (unless the lab's `disable-sessions` fault is), kept in a directory of its own in the lab's."""
    if state.gateway != "sagemaker" or DISABLE_SESSIONS in state.faults:
        return {}
    expiration = {} if state.session_ttl_s is None else {EXPIRATION_VARIABLE: f"{state.session_ttl_s:g}"}
    return {
        ENABLE_VARIABLE: "true",
        "SAGEMAKER_SESSIONS_PATH": str(sessions_directory(state, replica)),
        **expiration,
    }


def sessions_directory(state: LabState, replica: ReplicaSpec) -> Path:
    return state.directory / "sagemaker-sessions" / replica.id
