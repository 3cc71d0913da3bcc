"""The lab's background users: concurrent multi-turn conversations through a gateway.

Each round resends the static system prompt and the whole history, as a chat client does, so a
replica that still holds the conversation's KV cache only prefills the new turn. What every round
saw (TTFT, cached tokens, the upstream that served it, the session ids) is kept as a RoundRecord.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import signal
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path

import httpx

log = logging.getLogger("kvwatch.lab.traffic")

SESSION_MODES = ("server", "client", "none")

_WORDS = (
    "account answer archive balance batch budget cache channel check client cluster config context "
    "customer data deploy detail document engine error event field file format gateway history index "
    "invoice issue latency limit log memory message metric model network node order owner policy "
    "prompt queue quota record region replica report request result review route rule schedule "
    "service session shipment status storage summary support system table team ticket token trace "
    "update usage user value version warning window worker"
).split()


@dataclass(frozen=True)
class RoundRecord:
    round: int
    status: int
    ttft_seconds: float | None
    total_seconds: float
    prompt_tokens: int | None
    cached_tokens: int | None
    upstream: str | None
    worker: str | None
    session_id_sent: str | None
    session_id_returned: str | None
    error: str | None


@dataclass(frozen=True)
class TrafficSettings:
    url: str
    users: int = 4
    rounds: int = 6
    think_seconds: float = 1.0
    system_tokens: int = 800
    turn_tokens: int = 60
    max_tokens: int = 48
    session_mode: str = "server"
    seed: int = 0
    control_path: Path | None = None
    timeout_seconds: float = 30.0


def chat_url(url: str) -> str:
    """The chat endpoint of an OpenAI-compatible base URL, given with or without its /v1."""
    base = url.rstrip("/")
    return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


def _text(tokens: int, rng: random.Random) -> str:
    """Sentences of exactly `tokens` lab tokens (each word and each full stop is one)."""
    parts: list[str] = []
    while len(parts) < tokens:
        words = min(rng.randint(5, 13), tokens - len(parts) - 1)
        if words < 1:
            parts.append(rng.choice(_WORDS))
            break
        parts += [rng.choice(_WORDS) for _ in range(words)] + ["."]
    return " ".join(parts).replace(" .", ".")


def system_prompt(tokens: int, seed: int) -> str:
    """The static system prompt all users share: the prefix a healthy cluster reuses across users."""
    return _text(tokens, random.Random(f"system-{seed}"))


def user_turns(rounds: int, tokens: int, rng: random.Random) -> list[str]:
    return [_text(tokens, rng) for _ in range(rounds)]


class _RoundFailed(Exception):
    """A round without a usable answer; the message is short and holds no secrets."""


@dataclass
class _Reply:
    """What one round got so far, kept when it fails halfway (status and headers still tell a story)."""

    status: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)
    answer: str = ""
    ttft_seconds: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


def _error_code(body: bytes | str) -> str:
    """The OpenAI error code or type, never the message: it may echo a key or the prompt."""
    try:
        error = json.loads(body)["error"]
        code = error.get("code") or error.get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""
    return f" {str(code)[:40]}" if code else ""


async def _stream(client: httpx.AsyncClient, endpoint: str, body: dict, headers: dict, reply: _Reply) -> None:
    """Stream one answer into `reply`, timing the first content token as a user would see it."""
    started = time.monotonic()
    async with client.stream("POST", endpoint, json=body, headers=headers) as response:
        reply.status, reply.headers = response.status_code, response.headers
        if response.status_code != 200:
            raise _RoundFailed(f"HTTP {response.status_code}{_error_code(await response.aread())}")
        answer = []
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                reply.answer = "".join(answer)
                return
            try:
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _RoundFailed(f"error in stream{_error_code(data)}")
                for choice in chunk.get("choices") or []:
                    content = choice["delta"].get("content")
                    if content and reply.ttft_seconds is None:
                        reply.ttft_seconds = time.monotonic() - started
                    answer.append(content or "")
                usage = chunk.get("usage")
                if usage:
                    reply.prompt_tokens = usage["prompt_tokens"]
                    # None when the engine does not report it (vLLM without --enable-prompt-tokens-details).
                    reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise _RoundFailed("malformed stream") from error
        raise _RoundFailed("stream ended before [DONE]")


async def run_conversation(
    client: httpx.AsyncClient,
    url: str,
    system_prompt: str,
    user_turns: list[str],
    *,
    max_tokens: int,
    session_mode: str,
    session_header: str = "X-Session-Id",
    think_seconds: float = 0.0,
    timeout_seconds: float = 30.0,
) -> list[RoundRecord]:
    """One conversation, round after round, until the turns run out or a round fails (never raises)."""
    if session_mode not in SESSION_MODES:
        raise ValueError(f"session_mode must be one of {', '.join(SESSION_MODES)}")
    endpoint = chat_url(url)
    messages = [{"role": "system", "content": system_prompt}]
    # Client mode: the application names the conversation. Server mode: the gateway does, on round 1.
    session = str(uuid.uuid4()) if session_mode == "client" else None
    records: list[RoundRecord] = []
    for number, turn in enumerate(user_turns, start=1):
        if number > 1 and think_seconds > 0:
            await asyncio.sleep(think_seconds)
        messages.append({"role": "user", "content": turn})
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        reply, error = _Reply(), None
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_seconds):
                await _stream(client, endpoint, body, {session_header: session} if session else {}, reply)
        except _RoundFailed as failure:
            error = str(failure)
        except TimeoutError:
            error = f"no complete answer within {timeout_seconds:g} s"
        except httpx.HTTPError as failure:
            error = type(failure).__name__
        returned = reply.headers.get("X-Session-Id")
        records.append(
            RoundRecord(
                round=number,
                status=reply.status,
                ttft_seconds=None if error else reply.ttft_seconds,
                total_seconds=time.monotonic() - started,
                prompt_tokens=reply.prompt_tokens,
                cached_tokens=reply.cached_tokens,
                upstream=reply.headers.get("X-Upstream"),
                worker=reply.headers.get("X-Worker-Id"),
                session_id_sent=session,
                session_id_returned=returned,
                error=error,
            )
        )
        if error:
            break
        messages.append({"role": "assistant", "content": reply.answer})
        if session_mode == "server" and returned:
            session = returned
    return records


class _Control:
    """The control file through which the lab switches traffic faults while users keep talking."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._problem: str | None = None

    def read(self) -> dict:
        """The current settings; a missing or broken file means defaults, logged once per change."""
        if self.path is None:
            return {}
        control, problem = {}, None
        try:
            control = json.loads(self.path.read_text())
            if not isinstance(control, dict):
                control, problem = {}, "does not hold a JSON object"
        except FileNotFoundError:
            problem = "does not exist"
        except (OSError, ValueError) as error:
            problem = f"is unreadable ({error})"
        if problem and problem != self._problem:
            log.info("control file %s %s: using the defaults", self.path, problem)
        self._problem = problem
        return control


def _dynamic_prefix(prompt: str) -> str:
    """The fault: a timestamp at the very front, so no two conversations share a cached block."""
    return f"Current time: {datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%S.%fZ')}\n{prompt}"


async def _user(
    number: int, settings: TrafficSettings, client: httpx.AsyncClient, system: str, control: _Control
) -> None:
    rng = random.Random(f"user-{settings.seed}-{number}")
    for conversation in itertools.count(1):
        # Randomised pauses keep users out of lockstep and a dead gateway from being hammered.
        await asyncio.sleep(rng.uniform(0.5, 1.5) * max(settings.think_seconds, 0.2))
        prompt = _dynamic_prefix(system) if control.read().get("dynamic_prefix") is True else system
        records = await run_conversation(
            client,
            settings.url,
            prompt,
            user_turns(settings.rounds, settings.turn_tokens, rng),
            max_tokens=settings.max_tokens,
            session_mode=settings.session_mode,
            think_seconds=settings.think_seconds,
            timeout_seconds=settings.timeout_seconds,
        )
        errors = [r.error for r in records if r.error]
        log.info(
            "user %d conversation %d: %d/%d rounds, %d errors%s, upstreams %s, workers %s",
            number,
            conversation,
            len(records) - len(errors),
            settings.rounds,
            len(errors),
            f" ({errors[0]})" if errors else "",
            ",".join(dict.fromkeys(r.upstream for r in records if r.upstream)) or "-",
            ",".join(dict.fromkeys(r.worker for r in records if r.worker)) or "-",
        )


async def run_users(settings: TrafficSettings, stop: asyncio.Event) -> None:
    """Keep `users` users talking until `stop` is set; conversations in flight are abandoned."""
    system = system_prompt(settings.system_tokens, settings.seed)
    control = _Control(settings.control_path)
    limits = httpx.Limits(max_connections=settings.users, max_keepalive_connections=settings.users)
    async with (
        httpx.AsyncClient(timeout=settings.timeout_seconds, limits=limits) as client,
        asyncio.TaskGroup() as group,
    ):
        users = [
            group.create_task(_user(number, settings, client, system, control))
            for number in range(1, settings.users + 1)
        ]
        await stop.wait()
        for task in users:
            task.cancel()


def run_cli(args: argparse.Namespace) -> int:
    """`kvwatch lab traffic`: run the users until SIGINT or SIGTERM."""
    settings = TrafficSettings(**{f.name: getattr(args, f.name) for f in fields(TrafficSettings)})
    problems = [
        f"{flag} must be positive"
        for flag, value in (
            ("--users", settings.users),
            ("--rounds", settings.rounds),
            ("--system-tokens", settings.system_tokens),
            ("--turn-tokens", settings.turn_tokens),
            ("--max-tokens", settings.max_tokens),
            ("--timeout", settings.timeout_seconds),
        )
        if value <= 0
    ]
    if settings.think_seconds < 0:
        problems.append("--think must not be negative")
    if not settings.url.startswith(("http://", "https://")):
        problems.append("--url must start with http:// or https://")
    if problems:
        print("kvwatch lab traffic: " + "; ".join(problems), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the summaries
    asyncio.run(_serve(settings))
    return 0


async def _serve(settings: TrafficSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.info(
        "%d users, %d rounds each, session mode %s -> %s",
        settings.users,
        settings.rounds,
        settings.session_mode,
        chat_url(settings.url),
    )
    await run_users(settings, stop)
    log.info("stopped")
