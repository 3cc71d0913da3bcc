"""A probe session over its whole life, as the source article advises running one: left idle past the
route's session TTL mid-conversation, the first round after the expiry pays a full prefill (cold, maybe on
another replica), then the session sticks again (re-pinned); a conversation that ends is closed, and the
closed session is gone. What a session idled and closed that way showed, against that expectation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwatch.collectors.probe.records import REUSED_SHARE, RoundResult

if TYPE_CHECKING:
    from kvwatch.collectors.probe.records import SessionResult


# What the exporter counts of idled sessions (kvwatch_probe_idle_sessions{outcome}).
IDLE_OUTCOMES = ("idled", "expired", "cold", "new_replica", "repinned")


@dataclass(frozen=True)
class SessionLife:
    """What followed a session's idle past its TTL after round `idled_after_round`.

    `expiry`: how the route said the session was gone at the next round (records.SESSION_LOSS_KINDS:
    SageMaker refuses it), None when it said nothing (an OpenAI route's router forgets silently).
    `cold`: that round cached less than REUSED_SHARE of the history the session held: a full prefill.
    `new_replica`: it landed on another replica than the round before the idle (None: not named).
    `repinned`: the rounds after it stayed with it (its replica, else their reuse); None without any.
    """

    idled_after_round: int
    idle_seconds: float
    expiry: str | None
    cold: bool | None
    new_replica: bool | None
    repinned: bool | None

    @property
    def as_expected(self) -> bool | None:
        """The article's expectation held: a cold round after the idle, then the session stuck again."""
        if self.cold is None or self.repinned is None:
            return None
        return self.cold and self.repinned


def life_of(session: SessionResult) -> SessionLife | None:
    """The session's life after its idle; None when it did not idle or ended before the round after."""
    if session.idle is None:
        return None
    after, seconds = session.idle
    if len(session.rounds) <= after or not session.rounds[after].ok:
        return None
    before, woken, later = session.rounds[after - 1], session.rounds[after], session.rounds[after + 1 :]
    expiry = next((kind for number, kind in session.session_losses if number == after + 1), None)
    new_replica = None if not (before.backend and woken.backend) else before.backend != woken.backend
    return SessionLife(after, seconds, expiry, _cold(before, woken), new_replica, _repinned(woken, later))


def _cold(before: RoundResult, woken: RoundResult) -> bool | None:
    """Did the round after the idle reuse less than REUSED_SHARE of the history the session held?"""
    if None in (woken.cached_tokens, woken.prompt_tokens, before.prompt_tokens):
        return None
    held = min(before.prompt_tokens + (before.completion_tokens or 0), woken.prompt_tokens - 1)
    return held > 0 and woken.cached_tokens < REUSED_SHARE * held


def _repinned(woken: RoundResult, later: tuple[RoundResult, ...]) -> bool | None:
    """Did the rounds after the woken one stay with it: on its replica when named, else reusing?"""
    answered = [r for r in later if r.ok]
    if not answered:
        return None
    if woken.backend and all(r.backend for r in answered):
        return all(r.backend == woken.backend for r in answered)
    judged = [r for r in answered if r.cached_tokens is not None and r.ideal_cached_tokens]
    return all(r.cached_tokens >= REUSED_SHARE * r.ideal_cached_tokens for r in judged) if judged else None
