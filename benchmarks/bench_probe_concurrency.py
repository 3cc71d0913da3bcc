"""How far the probe's client-side TTFT is from the engine's, at 1 to 64 concurrent sessions from one process.

One process runs N sessions at once against a lab replica with room for all of them (time scale 0.05);
each round's client-side TTFT is compared with the TTFT the replica itself recorded for that request.
Each session streams its answer at 100 tokens/s, faster than an engine decodes for one sequence (10 ms
between tokens); a last row streams at 1,000 tokens/s per session (1 ms between tokens, the replica's
default decode rate at this time scale), which keeps both processes' event loops saturated at 64
sessions and so shows where the floor goes under a storm of events no engine sends.
The skew is what the client adds: the loopback hops, the replica's HTTP layer between its clock and
the socket (it dates a request when its loop first reads it, so a loop busy with other sessions still
delays that read), and the client's time. A raw asyncio socket client, which writes prepared bytes and
finds the first token by a byte search in what arrives, runs the same sessions in the same run, batch
for batch alternating with kvwatch's probe: its skew is the floor, and kvwatch's is given as a multiple
of it.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from kvwatch.collectors.probe.session import ProbeSettings, run_session
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.workload import Conversation, synthetic
from kvwatch.core.stats import median_and_p90

REPO = Path(__file__).resolve().parent.parent
PORT = 28390
TIME_SCALE = 0.05
# (tokens/s each session's answer streams at, the concurrent sessions measured at it)
RUNS = ((100, (1, 4, 16, 64)), (1000, (64,)))
ROUNDS = 4
ROUNDS_PER_LEVEL = 256  # per client: batches of `level` sessions until there are this many rounds,
MIN_BATCHES = 4  # and at least this many batches, so a p90 at 64 sessions is not one batch's
MAX_TOKENS = 16
FIRST_TOKEN = re.compile(rb'"content": "[^"]')  # the lab replica's first non-empty content delta
CHUNKED_END = b"0\r\n\r\n"

# Per client, one batch: the sessions' client-side TTFTs by session id, one per round.
Batch = Callable[[str, list[Conversation]], Awaitable[dict[str, list[float]]]]


async def _kvwatch(url: str, conversations: list[Conversation]) -> dict[str, list[float]]:
    settings = ProbeSettings(base_url=url, model="lab-model", max_tokens=MAX_TOKENS, timeout_seconds=60)
    async with StreamClient() as client:
        sessions = await asyncio.gather(*(run_session(client, settings, c) for c in conversations))
    return {s.session_id: [r.ttft_seconds for r in s.rounds if r.ok] for s in sessions}


async def _reference(url: str, conversations: list[Conversation]) -> dict[str, list[float]]:
    return dict(await asyncio.gather(*(_reference_session(url, c) for c in conversations)))


async def _reference_session(url: str, conversation: Conversation) -> tuple[str, list[float]]:
    """One session over one socket: the same requests as the probe's, timed from the write to the read
    that brought the first token."""
    address = httpx.URL(url)
    session_id, ttfts = str(uuid.uuid4()), []
    messages = [{"role": "system", "content": conversation.system_prompt}]
    reader, writer = await asyncio.open_connection(address.host, address.port)
    try:
        for turn in conversation.user_turns:
            messages.append({"role": "user", "content": turn})
            body = json.dumps(
                {"model": "lab-model", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
                 "stream_options": {"include_usage": True}}
            ).encode()  # fmt: skip
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address.host}:{address.port}\r\n"
                f"Content-Type: application/json\r\nX-Session-Id: {session_id}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            async with asyncio.timeout(60):
                start = time.perf_counter()
                writer.write(head + body)
                received, ttft = b"", None
                while not received.endswith(CHUNKED_END):
                    data = await reader.read(1 << 16)
                    arrived_at = time.perf_counter()
                    if not data:
                        raise ConnectionError("the replica closed the connection mid-answer")
                    searched_from = max(0, len(received) - 16)
                    received += data
                    if ttft is None and FIRST_TOKEN.search(received, searched_from):
                        ttft = arrived_at - start
            ttfts.append(ttft)
            messages.append({"role": "assistant", "content": _answer(received)})
    finally:
        writer.close()
    return session_id, ttfts


def _answer(received: bytes) -> str:
    """The answer text of a whole chunked event stream (each event is one chunk of the lab replica's)."""
    events = [json.loads(line[6:]) for line in received.split(b"\n") if line.startswith(b"data: {")]
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


def _skews(url: str, batch: Batch, conversations: list[Conversation]) -> list[float]:
    """Client-side minus engine TTFT for every round of one batch of concurrent sessions."""
    seen = len(httpx.get(f"{url}/lab/ground-truth", timeout=10).json()["records"])
    client = asyncio.run(batch(url, conversations))
    engine: dict[str, list[float]] = {}
    for record in httpx.get(f"{url}/lab/ground-truth", timeout=10).json()["records"][seen:]:
        engine.setdefault(record["session_id"], []).append(record["ttft_seconds"])
    return [
        ttft - truth
        for session_id, ttfts in client.items()
        for ttft, truth in zip(ttfts, engine.get(session_id, []), strict=False)
    ]


def _started(replica: subprocess.Popen, url: str, log: Path) -> None:
    for _ in range(100):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            if replica.poll() is not None:
                break
            time.sleep(0.1)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise RuntimeError(f"the lab replica did not start on {url}:\n{tail}")


def _row(level: int, decode: int, name: str, skews: list[float], floor: tuple[float, float] | None) -> str:
    median, p90 = median_and_p90(skews)
    times = f" | {median / floor[0]:.2f}x | {p90 / floor[1]:.2f}x" if floor else " | 1x | 1x"
    skew = f"{median * 1000:.2f} ms | {p90 * 1000:.2f} ms"
    return f"| {level} | {decode} | {name} | {len(skews)} | {skew}{times} |"


def _level(url: str, level: int, decode: int) -> list[str]:
    """Both clients' rows at one level, batch for batch alternating between them."""
    skews: dict[str, list[float]] = {"reference": [], "kvwatch": []}
    for seed in range(max(MIN_BATCHES, ROUNDS_PER_LEVEL // (ROUNDS * level))):
        conversations = synthetic(ROUNDS, 300, 100, seed=seed, sessions=level)
        for name, batch in (("reference", _reference), ("kvwatch", _kvwatch)):
            skews[name] += _skews(url, batch, conversations)
    ref = skews["reference"]
    floor = median_and_p90(ref)
    return [
        _row(level, decode, "raw socket", ref, None),
        _row(level, decode, "kvwatch", skews["kvwatch"], floor),
    ]


def _replica(decode: int, log: Path) -> subprocess.Popen:
    with log.open("w") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "kvwatch.cli.main", "lab", "replica", "--port", str(PORT),
             "--id", "r1", "--time-scale", str(TIME_SCALE), "--max-num-seqs", "256",
             "--decode-rate", str(decode * TIME_SCALE)],
            cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip


def run() -> str:
    url = f"http://127.0.0.1:{PORT}"
    rows = [
        "| concurrent sessions | tokens/s per session | client | rounds | median skew | p90 skew "
        "| median / reference | p90 / reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        for decode, levels in RUNS:
            log = Path(scratch) / f"replica-{decode}.log"
            replica = _replica(decode, log)
            try:
                _started(replica, url, log)
                for level in levels:
                    rows += _level(url, level, decode)
            finally:
                replica.terminate()
                replica.wait(timeout=10)
    return "\n".join(rows)
