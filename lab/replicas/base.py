"""The interface every kind of lab replica implements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvwatch.lab.process import Process
from kvwatch.lab.state import LabState, ReplicaSpec


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
