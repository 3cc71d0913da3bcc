"""What every gateway or router module of the family gives the doctor: where that system is told to
keep a session on one replica, in its own words."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Affinity:
    """The settings one gateway or router reads for session affinity, each a fix for one session header."""

    name: str  # as `kvwatch doctor --gateway` names it
    title: str  # as a fix names it, e.g. "Envoy / Istio"
    forward: Callable[[str], str]  # make it pass the session header on, unchanged
    echo: Callable[[str], str]  # make it return the header, so that clients can check it arrived
    hash_on: Callable[[str], str]  # make it pick the replica by the header
    # Its marks in a response's headers (lower-case names); None: it leaves none
    recognise: Callable[[Mapping[str, str]], bool] | None = None

    def fix(self, setting: str, header: str) -> str:
        """One setting's fix (forward, echo or hash_on), named after the system it is for."""
        return f"{self.title}: {getattr(self, setting)(header)}"
