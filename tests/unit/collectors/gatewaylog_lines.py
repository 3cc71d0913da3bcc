"""What the gateway log follower tests share: the lab's access log lines, a clock moved by hand, followers."""

from __future__ import annotations

import json

import pytest

from kvwatch.collectors.gatewaylogs.follower import GatewayLogFollower

T0 = 1_800_000_000.0
R1, R2, R3 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


class Clock:
    """A clock the test moves by hand: TTLs and windows expire without sleeping."""

    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def entry(
    session_id: str = "s1",
    upstream: str = R1,
    *,
    listener: str = "affinity",
    source: str = "client",
    status: int = 200,
    msec: float = T0,
) -> str:
    """One access log line as the lab's `kvwatch_json` log_format writes it."""
    record = {
        "time": "2027-01-15T08:00:00+00:00",
        "msec": msec,
        "listener": listener,
        "request": "POST /v1/chat/completions",
        "status": status,
        "upstream_addr": upstream,
        "upstream_status": str(status),
        "session_id": session_id,
        "session_source": source,
        "request_time": 0.012,
        "upstream_response_time": "0.012",
    }
    return json.dumps(record) + "\n"


@pytest.fixture
def log(tmp_path):
    return tmp_path / "gateway.jsonl"


@pytest.fixture
def follow(log):
    """Make followers of `log` (closed at teardown) with an injected clock."""
    followers: list[GatewayLogFollower] = []

    def make(name: str = "lab", clock: Clock | None = None, **options) -> GatewayLogFollower:
        follower = GatewayLogFollower(log, name, clock=clock or Clock(), **options)
        followers.append(follower)
        return follower

    yield make
    for follower in followers:
        follower.close()


def append(path, *lines: str) -> None:
    with path.open("a") as out:
        out.write("".join(lines))
