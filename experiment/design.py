"""What an A/B run is (see experiment.runner): the conversations both routes get, how they arrive, and
the sessions that came back.

Both routes usually reach the same replicas, so the first user turn of every session carries a short
tag naming the run and the route ("Run 3f9c0a1e, group A."): without it, B's session would find A's copy
of the same history in the replicas' caches, and a second run the first run's. The tag has the same
length in A and B, so the prompts still match token for token in size.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kvwatch.collectors.probe.blocksize import BlockSize
from kvwatch.collectors.probe.records import SessionResult
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.workload import Conversation, load_sharegpt, synthetic

GROUPS = ("A", "B")


@dataclass(frozen=True)
class Workload:
    """The conversations both routes get: synthetic, or from a ShareGPT-style file, seeded either way."""

    sessions: int = 20
    rounds: int = 6
    system_tokens: int = 1000
    turn_tokens: int = 300
    seed: int = 0
    sharegpt: Path | None = None

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError("sessions must be positive")
        if self.rounds < 2:
            raise ValueError("rounds must be at least 2: warm rounds are what the experiment compares")

    def conversations(self) -> list[Conversation]:
        if self.sharegpt is None:
            return synthetic(self.rounds, self.system_tokens, self.turn_tokens, self.seed, self.sessions)
        return [
            Conversation(c.system_prompt, c.user_turns[: self.rounds])
            for c in load_sharegpt(self.sharegpt, limit=self.sessions, seed=self.seed)
        ]

    def describe(self) -> str:
        if self.sharegpt is None:
            return (
                f"Synthetic conversations (seed {self.seed}): a system prompt of {self.system_tokens} "
                f"tokens, user turns of {self.turn_tokens} tokens."
            )
        return f"Conversations from {self.sharegpt} (seed {self.seed})."


@dataclass(frozen=True)
class Load:
    """How the sessions arrive, the same for both routes.

    With neither setting, one session at a time over both routes, in `interleave` order: no request
    ever waits behind the other route's, as the source article's comparison of prefill times needs.
    With `concurrency` alone, every session arrives at the start and each route runs that many at a
    time (a closed loop). With `request_rate`, sessions arrive at that rate per route with exponential
    gaps (a Poisson process, as vLLM's benchmark_serving sends requests), seeded, at most `concurrency`
    in flight per route when it is given.
    """

    concurrency: int | None = None
    request_rate: float | None = None  # sessions per second per route
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be positive")
        if self.request_rate is not None and not 0 < self.request_rate < math.inf:
            raise ValueError("request rate must be a positive number of sessions per second")

    @property
    def one_at_a_time(self) -> bool:
        """One session in flight over both routes together (neither setting given)."""
        return self.concurrency is None and self.request_rate is None

    def in_flight(self, sessions: int) -> int:
        """The most sessions one route runs at a time."""
        if self.concurrency is not None:
            return min(self.concurrency, sessions)
        return sessions if self.request_rate is not None else 1

    def arrivals(self, sessions: int) -> tuple[float, ...]:
        """When each conversation arrives, in seconds from the start: the first at 0."""
        if self.request_rate is None:
            return (0.0,) * sessions
        rng = random.Random(f"arrivals-{self.seed}")
        gaps = [0.0, *(rng.expovariate(self.request_rate) for _ in range(sessions - 1))]
        return tuple(itertools.accumulate(gaps))

    def describe(self) -> str:
        cap = "no cap" if self.concurrency is None else f"at most {self.concurrency} in flight per route"
        if self.one_at_a_time:
            return "interleaved session by session, one at a time over both routes"
        if self.request_rate is None:
            return f"all arriving at the start, {self.concurrency} at a time per route"
        return f"arriving at {self.request_rate:g} per second per route (Poisson, seed {self.seed}), {cap}"


ONE_AT_A_TIME = Load()  # the default: one session in flight over both routes, interleaved


@dataclass(frozen=True)
class Experiment:
    """One A/B run: each route's sessions in conversation order (they arrived in `interleave` order)."""

    a: ProbeSettings
    b: ProbeSettings
    rounds: int  # planned rounds per session
    load: Load
    arrivals: tuple[float, ...]  # each conversation's arrival, seconds from the start, for both routes
    sessions: tuple[tuple[SessionResult, ...], tuple[SessionResult, ...]]  # A's, B's
    block_size: BlockSize  # one for both routes, so that their cached / ideal compare

    @property
    def labels(self) -> tuple[str, str]:
        return self.a.target, self.b.target

    @property
    def all_sessions(self) -> list[SessionResult]:
        return [*self.sessions[0], *self.sessions[1]]


def interleave(sessions: int) -> list[tuple[int, int]]:
    """The arrival order as (conversation, route) pairs, route 0 = A and 1 = B.

    Conversation by conversation, both routes at the same moment; which route is handed its session
    first alternates (A B, B A, A B, ...), so neither is always the one that starts first.
    """
    return [(n, route) for n in range(sessions) for route in ((0, 1), (1, 0))[n % 2]]


def tag(conversation: Conversation, run_id: str, route: int) -> Conversation:
    """The conversation with the run's and the route's tag before its first user turn (see the docstring
    of this module: it keeps one route's cached history from serving the other)."""
    first, *rest = conversation.user_turns
    return Conversation(conversation.system_prompt, (f"Run {run_id}, group {GROUPS[route]}. {first}", *rest))
