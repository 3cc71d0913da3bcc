"""One probe conversation, round after round, through an Exchange: the loop every target kind shares
(collectors.probe.targets), whatever carries its rounds (HTTP to an OpenAI-compatible route, SageMaker's
runtime API). A conversation never raises: a failed round is a RoundResult with an error kind, and the
conversation stops there."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Protocol

from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.workload import Conversation, text

# How many lab tokens a session marker has after its "Session": words of the workload's vocabulary and a
# full stop, each one token in the lab's tokenizers; 100^5 choices.
MARKER_TOKENS = 6


class Settings(Protocol):
    """What the loop needs of a kind's settings (session.ProbeSettings)."""

    target: str
    route_mode: str
    idle_after_round: int | None  # idle `idle_seconds` after this round (past the route's session TTL)
    idle_seconds: float


class Exchange(Protocol):
    """How one conversation's rounds reach a route of one target kind (collectors.probe.targets): its
    session id, as a chat client would hold it, each round's request, and its end."""

    session_id: str | None
    # What the conversation's prompt starts with, before its system prompt: "" or a session_marker().
    opening: str

    async def round(
        self, number: int, messages: list[dict], previous: RoundResult | None, last: bool = False
    ) -> tuple[RoundResult, str]:
        """One round: its result (never raising) and the answer text; `last`: the conversation's last
        turn, which a route may be told of (Dynamo's X-Dynamo-Session-Final)."""

    async def close(self) -> SessionClose:
        """The conversation is over: what ending it on the route did."""


@dataclass(frozen=True)
class SessionClose:
    """What a conversation's end did on the route: `closed` None when there was nothing to close, and
    the session losses (round, kind) met on the way, each followed by a new session; `gone`, when the
    close was checked, whether the closed session was gone afterwards."""

    closed: bool | None = None
    losses: tuple[tuple[int, str], ...] = ()
    gone: bool | None = None


async def run_conversation(
    exchange: Exchange,
    settings: Settings,
    conversation: Conversation,
    think_seconds: float = 0.0,
    render_system_prompt: Callable[[str], str] | None = None,
    on_request: Callable[[list[dict]], None] | None = None,
    stop: asyncio.Event | None = None,
    on_round: Callable[[SessionResult], None] | None = None,
    on_result: Callable[[RoundResult], None] | None = None,
) -> SessionResult:
    """One conversation through the route, round after round, until its turns run out or a round fails.

    `render_system_prompt`, when given, rewrites the system prompt before every round, as an application
    that templates the current time into it does (the lab's dynamic-prefix fault). `stop`, once set,
    abandons the round in flight: the session ends with its finished rounds, marked interrupted.
    `on_round`, when given, gets the session so far after each round that lets it go on (`kvwatch serve`
    stores it, so that no finished round depends on the process living to the session's end).
    `on_result`, when given, gets every round's result as it ends, a failed one too (`kvwatch serve`
    counts the tokens the engine counted for it at that moment).
    """
    opening = exchange.opening
    messages = [{"role": "system", "content": opening + conversation.system_prompt}]
    rounds: list[RoundResult] = []
    started_at, interrupted, ended = time.time(), False, SessionClose()
    idle = (settings.idle_after_round, settings.idle_seconds) if settings.idle_after_round else None

    def so_far() -> SessionResult:
        return SessionResult(
            target=settings.target,
            route_mode=settings.route_mode,
            session_id=exchange.session_id,
            started_at=started_at,
            finished_at=time.time(),
            rounds=tuple(rounds),
            interrupted=interrupted,
            closed=ended.closed,
            session_losses=ended.losses,
            idle=idle if idle and len(rounds) > idle[0] else None,
            close_gone=ended.gone,
        )

    for number, turn in enumerate(conversation.user_turns, start=1):
        if idle and number == idle[0] + 1:
            if await _idle(idle[1], stop):
                interrupted = True
                break
        elif number > 1 and think_seconds > 0:
            await asyncio.sleep(think_seconds)
        messages.append({"role": "user", "content": turn})
        if render_system_prompt is not None:
            rendered = render_system_prompt(conversation.system_prompt)
            messages[0] = {"role": "system", "content": opening + rendered}
        if on_request is not None:
            on_request([dict(m) for m in messages])
        previous = rounds[-1] if rounds else None
        last = number == len(conversation.user_turns)
        answered = await _unless_stopped(stop, exchange.round(number, messages, previous, last))
        if answered is None:
            interrupted = True
            break
        result, answer = answered
        rounds.append(result)
        if on_result is not None:
            on_result(result)
        if not result.ok:
            break
        messages.append({"role": "assistant", "content": answer})
        if on_round is not None:
            on_round(so_far())
    if not interrupted:  # a stop does not wait for a close: the route lets the session expire
        ended = await exchange.close()
    return so_far()


def session_marker() -> str:
    """A short opening no other conversation shares ("Session cache quota route token window. "), for a
    route judged by reuse: before the system prompt all sessions share, it keeps every other session's
    cached prefix from serving this one, so that a warm round's cached tokens are its own history and
    nothing else. Without it, a round landing on the wrong replica still finds the shared system prompt
    there, and a lost pin hides behind that reuse. The same length in every conversation, so that an
    A/B's prompts still match in size."""
    return f"Session {text(MARKER_TOKENS, random.SystemRandom())} "


async def _idle(seconds: float, stop: asyncio.Event | None) -> bool:
    """Wait `seconds` (past the route's session TTL); True when `stop` was set first."""
    if stop is None:
        await asyncio.sleep(seconds)
        return False
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def _unless_stopped(
    stop: asyncio.Event | None, work: Coroutine[object, object, tuple[RoundResult, str]]
) -> tuple[RoundResult, str] | None:
    """What `work` returns, or None when `stop` is set first; `work` is then cancelled."""
    if stop is None:
        return await work
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        task.cancel()  # nothing when it is done
        await asyncio.wait((task,))
    return None if task.cancelled() else task.result()
