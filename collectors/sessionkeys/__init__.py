"""Session keys: how today's routers and clients name a conversation, one module per convention
(`kvwatch`, `dynamo`, `litellm`, `smg`, `aiperf`, `llm_d`, `sagemaker`, `olla`) behind one interface
(`SessionKey`), one registry (`SESSION_KEYS`; a target's `session.key`, the config refuses any other).

A probe route sends its session id in its key's header (or in a target's own `session.header`); every
response is read for the pin outcome a router reports (`pin_outcome`), whatever key was sent.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvwatch.collectors.sessionkeys import aiperf, dynamo, kvwatch, litellm, llm_d, olla, sagemaker, smg
from kvwatch.collectors.sessionkeys.base import OTHER_OUTCOME, SessionKey
from kvwatch.core.registry import Registry

SESSION_KEYS: Registry[SessionKey] = Registry(
    "session key",
    (module.KEY for module in (kvwatch, dynamo, litellm, smg, aiperf, llm_d, sagemaker, olla)),
)
DEFAULT = SESSION_KEYS["kvwatch"]
# Every request header some convention names a session by, each once whatever its case (HTTP's header
# names are case-insensitive): the doctor's and the gateway logs' list.
KNOWN_HEADERS = tuple({h.lower(): h for key in SESSION_KEYS.values() for h in key.request_headers}.values())
# Every pin outcome a router may report, for the exporter's labels.
PIN_OUTCOMES = tuple(
    dict.fromkeys((*(o for key in SESSION_KEYS.values() for o in key.pin_outcomes), OTHER_OUTCOME))
)

__all__ = [
    "DEFAULT",
    "KNOWN_HEADERS",
    "PIN_OUTCOMES",
    "SESSION_KEYS",
    "SessionKey",
    "final_header",
    "pin_outcome",
]


def pin_outcome(response_headers: Mapping[str, str]) -> str | None:
    """The pin outcome the first convention whose pin header the response carries reports; None without."""
    for key in SESSION_KEYS.values():
        if (outcome := key.pin_outcome(response_headers)) is not None:
            return outcome
    return None


def final_header(session_header: str | None) -> str | None:
    """The header that marks a session's last request in the convention whose session id travels in
    `session_header` (Dynamo's X-Dynamo-Session-Final, so that its frontend drops the binding at once
    instead of at its TTL); None when that convention has none."""
    lowered = (session_header or "").lower()
    return next(
        (k.final_header for k in SESSION_KEYS.values() if k.final_header and k.header.lower() == lowered),
        None,
    )
