"""Which instance of the lab's SageMaker endpoint serves a request: the one holding its session, else
the endpoint's routing strategy (`RANDOM`, `LEAST_OUTSTANDING_REQUESTS`, `PREFIX_AWARE`)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwatch.core.registry import Registry

DEFAULT_ROUTING = "LEAST_OUTSTANDING_REQUESTS"
DEFAULT_PREFIX_LENGTH = 1024  # bytes of the body PREFIX_AWARE hashes (1,024-65,536 on SageMaker)
DEFAULT_CONCURRENCY_THRESHOLD = 8  # in-flight requests before PREFIX_AWARE overflows (1-1,024)


@dataclass(frozen=True)
class Instance:
    id: str
    url: str  # the container's base URL


@dataclass
class Load:
    """In-flight requests per instance, and the strategy's random source."""

    outstanding: dict[str, int] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def least_loaded(self, candidates: list[Instance]) -> Instance:
        fewest = min(self.outstanding.get(i.id, 0) for i in candidates)
        return self.rng.choice([i for i in candidates if self.outstanding.get(i.id, 0) == fewest])


@dataclass(frozen=True)
class Strategy:
    name: str
    help: str
    # (candidates, load, prefix key or None, concurrency threshold) -> the instance
    choose: Callable[[list[Instance], Load, bytes | None, int], Instance]


def _random(candidates: list[Instance], load: Load, key: bytes | None, threshold: int) -> Instance:
    return load.rng.choice(candidates)


def _least_outstanding(candidates: list[Instance], load: Load, key: bytes | None, threshold: int) -> Instance:
    return load.least_loaded(candidates)


def _prefix_aware(candidates: list[Instance], load: Load, key: bytes | None, threshold: int) -> Instance:
    """The instance the prefix hashes to (highest random weight, stable as instances come and go),
    unless it has `threshold` requests in flight: then the least loaded one."""
    if key is None:
        return load.least_loaded(candidates)
    chosen = max(candidates, key=lambda i: hashlib.sha256(i.id.encode() + b"\0" + key).digest())
    if load.outstanding.get(chosen.id, 0) >= threshold:
        return load.least_loaded(candidates)
    return chosen


STRATEGIES = Registry(
    "routing strategy",
    (
        Strategy("RANDOM", "a random instance", _random),
        Strategy(
            "LEAST_OUTSTANDING_REQUESTS",
            "the instance with the fewest requests in flight",
            _least_outstanding,
        ),
        Strategy(
            "PREFIX_AWARE",
            "the instance the request's prefix hashes to, overflowing to the least loaded at the "
            "concurrency threshold",
            _prefix_aware,
        ),
    ),
)
