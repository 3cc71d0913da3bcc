"""The lab's simulated users, against real replicas and small in-process fake gateways."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from contextlib import asynccontextmanager
from itertools import pairwise

import httpx
import pytest
from aiohttp import web

from collectors.cli import main
from conftest import REPO, free_port, stop
from lab.tokenizer import split_words
from lab.traffic import TrafficSettings, chat_url, run_conversation, run_users, system_prompt, user_turns

pytestmark = pytest.mark.integration

FAST = ("--time-scale", "0.05", "--answer-tokens", "8")
SYSTEM_TOKENS = 200
TURN_TOKENS = 20
SYSTEM = system_prompt(SYSTEM_TOKENS, seed=0)


async def converse(url: str, rounds: int, session_mode: str, seed: int = 1, **options) -> list:
    async with httpx.AsyncClient(timeout=10) as client:
        turns = user_turns(rounds, TURN_TOKENS, random.Random(seed))
        return await run_conversation(
            client, url, SYSTEM, turns, max_tokens=8, session_mode=session_mode, **options
        )


async def run_for(settings: TrafficSettings, seconds: float) -> float:
    """Run the users for `seconds`; return how long they took to stop once told to."""
    stopping = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, stopping.set)
    task = asyncio.create_task(run_users(settings, stopping))
    await stopping.wait()
    told = time.monotonic()
    await asyncio.wait_for(task, timeout=5)
    return time.monotonic() - told


def test_workload_is_seeded_and_sized_in_lab_tokens():
    assert len(split_words(SYSTEM)) == SYSTEM_TOKENS
    assert system_prompt(SYSTEM_TOKENS, seed=0) == SYSTEM != system_prompt(SYSTEM_TOKENS, seed=1)
    turns = user_turns(5, 7, random.Random(3))
    assert [len(split_words(turn)) for turn in turns] == [7] * 5
    assert turns == user_turns(5, 7, random.Random(3)) != user_turns(5, 7, random.Random(4))
    assert len(set(turns)) == 5
    for base in ("http://gw:1", "http://gw:1/", "http://gw:1/v1", "http://gw:1/v1/"):
        assert chat_url(base) == "http://gw:1/v1/chat/completions"


def test_client_mode_conversation_reuses_its_history_and_agrees_with_ground_truth(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    first = asyncio.run(converse(replica.url, 4, "client"))
    second = asyncio.run(converse(replica.url, 2, "client", seed=2))

    assert [r.round for r in first] == [1, 2, 3, 4]
    assert all(r.status == 200 and r.error is None for r in first + second)
    assert all(r.worker == "r1" and r.upstream is None for r in first)
    assert all(0 < r.ttft_seconds <= r.total_seconds for r in first)
    # Each round adds the 8-token answer actually received and a 20-token turn, plus 4 template markers.
    prompts = [r.prompt_tokens for r in first]
    assert [b - a for a, b in pairwise(prompts)] == [8 + TURN_TOKENS + 4] * 3
    cached = [r.cached_tokens for r in first]
    assert cached[0] == 0
    assert all(cached[n] > prompts[n - 1] - 16 for n in (1, 2, 3)), (prompts, cached)
    # A new conversation shares the static system prompt with the first one.
    assert second[0].cached_tokens >= SYSTEM_TOKENS - 16

    ids = {r.session_id_sent for r in first}
    assert len(ids) == 1 and uuid.UUID(ids.pop())
    assert first[0].session_id_sent != second[0].session_id_sent == second[1].session_id_sent

    truth = replica.ground_truth()
    records = first + second
    assert [(t["prompt_tokens"], t["cached_tokens"], t["session_id"]) for t in truth] == [
        (r.prompt_tokens, r.cached_tokens, r.session_id_sent) for r in records
    ]
    assert all(r.ttft_seconds >= t["ttft_seconds"] for r, t in zip(records, truth, strict=True))


def test_server_mode_sends_no_header_when_no_gateway_assigns_one(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    records = asyncio.run(converse(f"{replica.url}/v1", 3, "server"))
    assert [r.status for r in records] == [200, 200, 200]
    assert all(r.session_id_sent is None and r.session_id_returned is None for r in records)
    assert [t["session_id"] for t in replica.ground_truth()] == [None, None, None]


async def sse(request: web.Request, lines: list[str], headers: dict | None = None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
    await response.prepare(request)
    for line in lines:
        await response.write(f"data: {line}\n\n".encode())
    return response


ANSWER = [
    '{"choices": [{"delta": {"role": "assistant", "content": ""}}]}',
    '{"choices": [{"delta": {"content": "hello"}}]}',
    '{"choices": [{"delta": {"content": " world"}}]}',
    '{"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}',
    "[DONE]",
]


@asynccontextmanager
async def fake_gateway(handler):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # do not wait for a hanging handler
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_server_mode_adopts_the_session_id_the_gateway_assigns():
    seen: list[tuple[str | None, list[dict]]] = []

    async def gateway(request: web.Request) -> web.StreamResponse:
        session = request.headers.get("X-Session-Id")
        seen.append((session, (await request.json())["messages"]))
        return await sse(request, ANSWER, {"X-Session-Id": session or "gw-1", "X-Upstream": "10.0.0.7:8000"})

    async def scenario():
        async with fake_gateway(gateway) as url:
            return await converse(url, 3, "server")

    records = asyncio.run(scenario())
    assert [(r.session_id_sent, r.session_id_returned) for r in records] == [
        (None, "gw-1"),
        ("gw-1", "gw-1"),
        ("gw-1", "gw-1"),
    ]
    assert [s for s, _ in seen] == [None, "gw-1", "gw-1"]
    assert {(r.upstream, r.prompt_tokens, r.cached_tokens) for r in records} == {("10.0.0.7:8000", 40, 32)}
    turns = user_turns(3, TURN_TOKENS, random.Random(1))
    assert seen[2][1] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": turns[1]},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": turns[2]},
    ]


async def refuse(request: web.Request) -> web.Response:
    error = {"message": "Incorrect API key provided: sk-secret-123", "code": "invalid_api_key"}
    return web.json_response({"error": error}, status=401)


async def garble(request: web.Request) -> web.StreamResponse:
    return await sse(request, [ANSWER[1], "{not json"])


async def bad_usage(request: web.Request) -> web.StreamResponse:
    return await sse(request, [ANSWER[1], '{"choices": [], "usage": 5}', "[DONE]"])


async def cut_short(request: web.Request) -> web.StreamResponse:
    return await sse(request, ANSWER[:2])


async def hang(request: web.Request) -> web.Response:
    await asyncio.sleep(30)
    return web.Response()


@pytest.mark.parametrize(
    "handler, status, error",
    [
        (None, 0, "ConnectError"),
        (refuse, 401, "HTTP 401 invalid_api_key"),
        (garble, 200, "malformed stream"),
        (bad_usage, 200, "malformed stream"),
        (cut_short, 200, "stream ended before [DONE]"),
        (hang, 0, "no complete answer within 0.3 s"),
    ],
    ids=["nothing-listening", "http-401", "malformed", "bad-usage", "truncated", "timeout"],
)
def test_a_failed_round_is_recorded_and_ends_the_conversation(handler, status, error):
    async def scenario():
        if handler is None:
            return await converse(f"http://127.0.0.1:{free_port()}", 3, "client")
        async with fake_gateway(handler) as url:
            return await converse(url, 3, "client", timeout_seconds=0.3)

    started = time.monotonic()
    records = asyncio.run(scenario())
    assert time.monotonic() - started < 3
    assert len(records) == 1
    assert (records[0].status, records[0].error, records[0].ttft_seconds) == (status, error, None)


def round_ones(truth: list[dict]) -> list[dict]:
    """The first completed request of each conversation (client mode: one session id each)."""
    firsts: dict[str, dict] = {}
    for record in sorted(truth, key=lambda t: t["time"]):
        if record.get("finished_reason") != "abort":
            firsts.setdefault(record["session_id"], record)
    return list(firsts.values())


def test_dynamic_prefix_in_the_control_file_defeats_system_prompt_reuse(start_replica, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvwatch.lab.traffic")
    replica = start_replica("r1", "vllm", *FAST)
    control = tmp_path / "control.json"
    settings = TrafficSettings(
        url=replica.url,
        users=2,
        rounds=2,
        think_seconds=0.02,
        system_tokens=SYSTEM_TOKENS,
        turn_tokens=TURN_TOKENS,
        max_tokens=8,
        session_mode="client",
        control_path=control,
    )

    asyncio.run(run_for(settings, 1.2))  # no control file yet: the defaults
    healthy = round_ones(replica.ground_truth())
    assert len(healthy) >= 3
    # Only the very first conversation finds the shared system prompt cold.
    cached = sorted(t["cached_tokens"] for t in healthy)
    assert all(c >= SYSTEM_TOKENS - 16 for c in cached[1:]), cached

    httpx.post(f"{replica.url}/lab/reset-cache", timeout=5)
    seen = len(replica.ground_truth())
    control.write_text('{"dynamic_prefix": true}')
    asyncio.run(run_for(settings, 1.2))
    faulty = replica.ground_truth()[seen:]
    assert len(round_ones(faulty)) >= 3
    assert all(t["cached_tokens"] == 0 for t in round_ones(faulty))
    # Each conversation still reuses its own history: the timestamp is fixed per conversation.
    later = [t for t in faulty if t not in round_ones(faulty) and t["finished_reason"] != "abort"]
    assert later and all(t["cached_tokens"] > SYSTEM_TOKENS for t in later)

    finished = [r.getMessage() for r in caplog.records if "conversation" in r.getMessage()]
    assert len(finished) >= 6 and all("0 errors" in line and "workers r1" in line for line in finished)


def test_bad_control_file_is_logged_once_and_never_fatal(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvwatch.lab.traffic")
    control = tmp_path / "control.json"
    control.write_text("{not json")
    settings = TrafficSettings(
        url=f"http://127.0.0.1:{free_port()}", users=2, think_seconds=0, control_path=control
    )
    asyncio.run(run_for(settings, 1.0))
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if "control file" in line]) == 1
    failed = [line for line in lines if "conversation" in line]
    assert len(failed) >= 4 and all("0/6 rounds, 1 errors (ConnectError)" in line for line in failed)


def test_users_stop_promptly_even_mid_request():
    async def scenario():
        async with fake_gateway(hang) as url:
            return await run_for(TrafficSettings(url=url, users=3, think_seconds=0), 0.5)

    assert asyncio.run(scenario()) < 1.0


def test_cli_sends_traffic_and_exits_0_on_sigterm(start_replica, tmp_path):
    replica = start_replica("r1", "vllm", *FAST)
    log = tmp_path / "traffic.log"
    command = [sys.executable, "-m", "collectors.cli", "lab", "traffic", "--url", replica.url]
    command += ["--users", "2", "--rounds", "2", "--think", "0.05", "--system-tokens", "50"]
    command += ["--turn-tokens", "10", "--max-tokens", "8", "--session-mode", "client"]
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while "2/2 rounds, 0 errors" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.1)
        assert len(replica.ground_truth()) >= 2, log.read_text()
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=5) == 0, log.read_text()
    finally:
        stop(process)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--users", "0"], "--users must be positive"),
        (["--rounds", "-1"], "--rounds must be positive"),
        (["--think", "-0.5"], "--think must not be negative"),
        (["--max-tokens", "0"], "--max-tokens must be positive"),
        (["--url", "127.0.0.1:18000"], "--url must start with http:// or https://"),
    ],
)
def test_cli_rejects_bad_numbers_naming_the_flag(flags, message, capsys):
    assert main(["lab", "traffic", "--url", "http://127.0.0.1:1", *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"kvwatch lab traffic: {message}\n"
