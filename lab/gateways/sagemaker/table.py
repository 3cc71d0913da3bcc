"""The SageMaker front's session pins as a router's session table: each binding (session -> instance)
idles out after the lab's session TTL (idle since its last request started or ended), the table holds
at most its capacity (a new session beyond it is refused, 503, as Dynamo's full affinity table
answers), and it counts what a router's binding tracker counts, under llm-d's names
(`llm_d_epp_session_control_*`), so that kvwatch's rules and alerts read the lab as they read llm-d:
bindings now, invalidations by reason (idle, close, pod_delete, error), and rejections."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

INVALIDATION_REASONS = ("idle", "close", "pod_delete", "error")


@dataclass
class SessionTable:
    ttl_s: float | None = None  # idle seconds a binding lives; None: until closed
    capacity: int | None = None  # bindings at most; None: unbounded
    clock: Callable[[], float] = time.monotonic
    bindings: dict[str, tuple[str, float]] = field(default_factory=dict)  # session -> (instance, last use)
    invalidations: Counter = field(default_factory=Counter)
    rejections: int = 0
    idled: set[str] = field(default_factory=set)  # sessions dropped idle: refused as expired from then on

    def instance_of(self, session_id: str) -> str | None:
        """The instance a session is bound to, its binding refreshed; None when unbound or idled out."""
        self.expire()
        if session_id not in self.bindings:
            return None
        instance, _ = self.bindings[session_id]
        self.bindings[session_id] = (instance, self.clock())
        return instance

    def admits(self) -> bool:
        """Room for one more binding; counts a rejection when there is none."""
        self.expire()
        if self.capacity is not None and len(self.bindings) >= self.capacity:
            self.rejections += 1
            return False
        return True

    def bind(self, session_id: str, instance: str) -> None:
        self.bindings[session_id] = (instance, self.clock())

    def touch(self, session_id: str) -> None:
        """A bound session was just used: its idle time starts again."""
        if session_id in self.bindings:
            self.bind(session_id, self.bindings[session_id][0])

    def drop(self, session_id: str, reason: str) -> None:
        if self.bindings.pop(session_id, None) is not None:
            self.invalidations[reason] += 1
            if reason == "idle":
                self.idled.add(session_id)

    def expire(self) -> None:
        """Drop the bindings idle for longer than the TTL."""
        if self.ttl_s is None:
            return
        now = self.clock()
        for session_id, (_, used) in list(self.bindings.items()):
            if now - used > self.ttl_s:
                self.drop(session_id, "idle")

    def pins(self) -> dict[str, str]:
        self.expire()
        return {session_id: instance for session_id, (instance, _) in self.bindings.items()}

    def exposition(self) -> str:
        """The table's series in Prometheus' text format, as llm-d's EPP names them."""
        self.expire()
        invalidations = "llm_d_epp_session_control_invalidations_total"
        lines = [
            "# HELP llm_d_epp_session_control_bindings Sessions bound to an instance now.",
            "# TYPE llm_d_epp_session_control_bindings gauge",
            f"llm_d_epp_session_control_bindings {len(self.bindings)}",
            "# HELP llm_d_epp_session_control_invalidations_total Session bindings dropped, by reason.",
            "# TYPE llm_d_epp_session_control_invalidations_total counter",
            *(
                f'{invalidations}{{reason="{reason}"}} {self.invalidations[reason]}'
                for reason in INVALIDATION_REASONS
            ),
            "# HELP llm_d_epp_session_control_bind_rejections_total New sessions refused: a full table.",
            "# TYPE llm_d_epp_session_control_bind_rejections_total counter",
            f"llm_d_epp_session_control_bind_rejections_total {self.rejections}",
        ]
        return "\n".join(lines) + "\n"
