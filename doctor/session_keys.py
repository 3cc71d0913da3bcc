"""Which session header a route keeps sessions by: the doctor sends the same sessions with each header of
the session-key family (collectors.sessionkeys: X-Session-Id, Dynamo's, LiteLLM's, SMG's...) and with none,
and names the header under which every session stayed on one backend while sessions without one did not.

Each header costs a few sessions, run one after another as the hash key check runs its own: it is asked
only when the route's answer says something (the sessions' backends, or their cached tokens).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from kvwatch.collectors import sessionkeys
from kvwatch.collectors.probe.records import SessionResult
from kvwatch.collectors.probe.session import ProbeSettings

# Runs the doctor's sessions with the given settings (doctor.route: its hash key check's sessions).
Sessions = Callable[[ProbeSettings], Awaitable[list[SessionResult]]]


def kept(sessions: list[SessionResult]) -> bool | None:
    """Did every session stay on one backend? None when the answers said nothing of where they landed."""
    said = [s.sticky for s in sessions]
    if not said or None in said:
        return None
    return all(said)


def family_headers() -> tuple[str, ...]:
    """Every session header of the family, each once whatever its case, in the registry's order."""
    return tuple({key.header.lower(): key.header for key in sessionkeys.SESSION_KEYS.values()}.values())


def named(header: str) -> str:
    """A header with the session keys that send it: `X-Session-Id (session key kvwatch, olla, llm-d)`."""
    keys = [k.name for k in sessionkeys.SESSION_KEYS.values() if k.header.lower() == header.lower()]
    return f"{header} (session key {', '.join(keys)})" if keys else header


@dataclass(frozen=True)
class KeptBy:
    """What the doctor found of the header the route keeps sessions by: `header`, or None for none of
    the family's; `without_header`: sessions that carried no session header stayed put too (the route
    places sessions by something else: the prompt's prefix, or one replica); None where not asked."""

    header: str | None
    without_header: bool | None = None

    def evidence(self) -> str:
        if self.without_header:
            return (
                "sessions without any session header stayed on one backend too: the route keeps them by "
                "something else than a session header (the prompt's prefix, or a single replica)"
            )
        if self.header is None:
            return f"no header of the family kept sessions on one backend ({', '.join(family_headers())})"
        return f"the route keeps sessions by {named(self.header)}"


async def kept_by_sent(sessions: Sessions, probe: ProbeSettings) -> KeptBy | None:
    """The route's sessions with the probe's own header stayed put: is it that header, or would they
    stay without any? None when the sessions without a header said nothing."""
    without = kept(await sessions(replace(probe, session_mode="none")))
    if without is None:
        return None
    return KeptBy(None if without else probe.session_header, without_header=without)


async def kept_by_another(sessions: Sessions, probe: ProbeSettings) -> KeptBy:
    """The route's sessions with the probe's own header moved: the first other header of the family
    under which every session stays on one backend, else none."""
    sent = (probe.session_header or "").lower()
    for header in family_headers():
        if header.lower() != sent and kept(await sessions(replace(probe, session_header=header))):
            return KeptBy(header)
    return KeptBy(None)
