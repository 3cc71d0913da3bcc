"""Gateway access-log lines per second, and the follower's peak memory with ~90,000 sessions tracked.

300,000 lab-format lines (sessions drawn from 100,000 over 8 upstreams, 5 % without a session key, 1 %
failovers) are written to a temp file and read by a `GatewayLogFollower`, polled until it has read the
whole file (a poll reads at most MAX_BYTES_PER_POLL): once timed, once again under tracemalloc for the
peak memory (tracing slows it, so it is not timed).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

from kvwatch.collectors.gatewaylogs.follower import GatewayLogFollower
from kvwatch.collectors.gatewaylogs.tally import GatewayLogSnapshot

LINES = 300_000
SESSIONS = 100_000


def entries(count: int = LINES) -> Iterator[dict[str, object]]:
    """The lab's nginx log lines, decoded: sessions drawn from SESSIONS over 8 upstreams, 5 % without a
    session key, 1 % failovers."""
    rng = random.Random(0)
    upstreams = [f"127.0.0.1:{18010 + i}" for i in range(8)]
    for i in range(count):
        session = f"{rng.randrange(SESSIONS):032x}"
        client = rng.random() > 0.05
        upstream = rng.choice(upstreams)
        if rng.random() < 0.01:
            upstream = f"{rng.choice(upstreams)}, {upstream}"
        yield {
            "time": "2026-11-29T18:00:00+00:00", "msec": 1795975200.0 + i / 100, "listener": "affinity",
            "request": "POST /v1/chat/completions", "status": 200, "upstream_addr": upstream,
            "upstream_status": "200", "session_id": session if client else f"{i:032x}",
            "session_source": "client" if client else "assigned", "request_time": 0.412,
            "upstream_response_time": "0.412",
        }  # fmt: skip


def lines(count: int = LINES) -> list[bytes]:
    """The same lines as nginx writes them, without their newline."""
    return [json.dumps(entry, separators=(",", ":")).encode() for entry in entries(count)]


def _write_log(path: Path) -> None:
    with path.open("wb") as out:
        for line in lines():
            out.write(line + b"\n")


def run() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "access.jsonl"
        _write_log(path)
        size_mb = path.stat().st_size / 1e6

        def read_all() -> GatewayLogSnapshot:
            follower = GatewayLogFollower(path, "bench", clock=lambda: 1795975200.0 + LINES / 100)
            for _ in range(100):  # bounded: ~100 MB at 16 MiB a poll takes 6 polls
                snapshot = follower.poll()
                if snapshot.lines == LINES:
                    break
            return snapshot

        started = time.perf_counter()
        snapshot = read_all()
        seconds = time.perf_counter() - started
        tracemalloc.start()
        read_all()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert snapshot.lines == LINES
    return "\n".join(
        [
            "| lines | file | seconds | lines/s | sessions tracked | peak memory |",
            "|---|---|---|---|---|---|",
            f"| {LINES:,} | {size_mb:.0f} MB | {seconds:.2f} | {LINES / seconds:,.0f} | "
            f"{snapshot.tracked_sessions:,} | {peak / 1e6:.0f} MB |",
        ]
    )
