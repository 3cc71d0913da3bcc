"""The interface every session-key convention implements: the header(s) a session id travels in, and the
response header in which a router says what became of the session's pin."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# What a round's pin outcome reads as when the router's value is none of the convention's own.
OTHER_OUTCOME = "other"


@dataclass(frozen=True)
class SessionKey:
    """One way a router or client names a conversation.

    `header` carries the session id on every round. `parent_header` and `final_header` are the
    convention's other request headers (Dynamo: a sub-agent's parent session, and the last request of a
    session). The probe sends `final_header: true` on a session's last round; never `parent_header`: a
    probe conversation is no sub-agent of another, so it has no parent to name. `pin_header` is a
    response header in which the router reports the pin's outcome, one of `pin_outcomes`.
    """

    name: str
    header: str
    about: str  # who sends or reads it, for the docs and the doctor
    parent_header: str | None = None
    final_header: str | None = None
    pin_header: str | None = None
    pin_outcomes: tuple[str, ...] = ()

    @property
    def request_headers(self) -> tuple[str, ...]:
        """Every request header of the convention, the session id's first."""
        return tuple(h for h in (self.header, self.parent_header, self.final_header) if h)

    def pin_outcome(self, response_headers: Mapping[str, str]) -> str | None:
        """The pin's outcome the response reports: one of `pin_outcomes` (OTHER_OUTCOME for any other
        value, which never becomes a label of its own); None when the response does not say."""
        if self.pin_header is None or not (value := response_headers.get(self.pin_header)):
            return None
        value = value.strip().lower()
        return value if value in self.pin_outcomes else OTHER_OUTCOME
