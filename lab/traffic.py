"""The lab's background users: concurrent multi-turn conversations through a gateway.

Each user holds one probe session (collectors.probe.run_session) after another: the lab's shared static
system prompt, then the user's own turns, each round resending the whole history, so a replica that
still holds the conversation's KV cache only prefills the new turn. Each conversation is logged.
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
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

from kvwatch.collectors.probe.session import SESSION_MODES, ProbeSettings, api_url, run_session
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.workload import Conversation, system_prompt, user_turns
from kvwatch.lab.engine import ReplicaSettings

log = logging.getLogger("kvwatch.lab.traffic")


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
    requests_sample: Path | None = None  # JSONL: every request's {"messages": [...]}

    def probe(self) -> ProbeSettings:
        """How each user's sessions are run: the probe's, against the lab's one model."""
        return ProbeSettings(
            base_url=self.url,
            model=ReplicaSettings.model,
            target="lab-traffic",
            session_mode=self.session_mode,
            max_tokens=self.max_tokens,
            timeout_seconds=self.timeout_seconds,
        )


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
    """The fault: the current time at the very front, rendered on every request, so no request shares a
    cached block with any other, not even the previous round of its own conversation."""
    return f"Current time: {datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%S.%fZ')}\n{prompt}"


def _sampler(settings: TrafficSettings):
    if settings.requests_sample is None:
        return None

    def write(messages: list[dict]) -> None:
        with settings.requests_sample.open("a") as out:
            out.write(json.dumps({"messages": messages}) + "\n")

    return write


async def _user(
    number: int, settings: TrafficSettings, client: StreamClient, system: str, control: _Control
) -> None:
    rng = random.Random(f"user-{settings.seed}-{number}")
    probe = settings.probe()
    for conversation in itertools.count(1):
        # Randomised pauses keep users out of lockstep and a dead gateway from being hammered.
        await asyncio.sleep(rng.uniform(0.5, 1.5) * max(settings.think_seconds, 0.2))
        render = _dynamic_prefix if control.read().get("dynamic_prefix") is True else None
        turns = user_turns(settings.rounds, settings.turn_tokens, rng)
        session = await run_session(
            client, probe, Conversation(system, turns), settings.think_seconds, render, _sampler(settings)
        )
        failed = next((r for r in session.rounds if not r.ok), None)
        log.info(
            "user %d conversation %d: %d/%d rounds ok, %s, backends %s",
            number,
            conversation,
            sum(r.ok for r in session.rounds),
            settings.rounds,
            f"{failed.error_kind} ({failed.error_detail})" if failed else "no errors",
            ",".join(dict.fromkeys(session.backends)) or "-",
        )


async def run_users(settings: TrafficSettings, stop: asyncio.Event) -> None:
    """Keep `users` users talking until `stop` is set; conversations in flight are abandoned."""
    system = system_prompt(settings.system_tokens, settings.seed)
    control = _Control(settings.control_path)
    async with StreamClient() as client, asyncio.TaskGroup() as group:
        users = [
            group.create_task(_user(number, settings, client, system, control))
            for number in range(1, settings.users + 1)
        ]
        await stop.wait()
        for task in users:
            task.cancel()


def add_arguments(traffic: argparse.ArgumentParser) -> None:
    """`kvwatch lab traffic`'s options, beside what runs them."""
    defaults = TrafficSettings(url="")
    traffic.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:18000")
    for flag, dest, kind, text in (
        ("--users", "users", int, "concurrent users"),
        ("--rounds", "rounds", int, "rounds per conversation"),
        ("--think", "think_seconds", float, "seconds a user thinks between rounds"),
        ("--system-tokens", "system_tokens", int, "tokens of the shared system prompt"),
        ("--turn-tokens", "turn_tokens", int, "tokens of each user turn"),
        ("--max-tokens", "max_tokens", int, "max_tokens of each request"),
        ("--seed", "seed", int, "seed of the prompts and pauses"),
        ("--timeout", "timeout_seconds", float, "seconds before a round counts as failed"),
    ):
        traffic.add_argument(
            flag,
            type=kind,
            dest=dest,
            default=getattr(defaults, dest),
            metavar="N" if kind is int else "SECONDS",
            help=f"{text} (default %(default)s)",
        )
    traffic.add_argument(
        "--session-mode",
        choices=SESSION_MODES,
        default=defaults.session_mode,
        help="server: adopt the X-Session-Id the gateway returns; client: one new id per conversation; "
        "none: send no session header (default %(default)s)",
    )
    traffic.add_argument(
        "--control",
        type=Path,
        dest="control_path",
        metavar="FILE",
        help='JSON file read before each conversation, e.g. {"dynamic_prefix": true}',
    )
    traffic.add_argument(
        "--requests-sample",
        type=Path,
        dest="requests_sample",
        metavar="FILE",
        help='append every request\'s {"messages": [...]} to this JSONL file',
    )


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
        api_url(settings.url, "chat/completions"),
    )
    await run_users(settings, stop)
    log.info("stopped")
