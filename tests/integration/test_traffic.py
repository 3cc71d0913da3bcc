"""The lab's simulated users: probe sessions one after another, steered by the lab's control file.

How a single conversation is run, timed and checked is the probe's
(tests/unit/collectors/test_probe_rounds.py, tests/unit/collectors/test_probe.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from kvwatch.lab.traffic import TrafficSettings, run_users
from paths import REPO
from processes import free_port, http_post, stop

pytestmark = pytest.mark.integration

FAST = ("--time-scale", "0.05", "--answer-tokens", "8")
SYSTEM_TOKENS = 200
TURN_TOKENS = 20


async def run_until(settings: TrafficSettings, done: Callable[[], bool], timeout: float = 30) -> float:
    """Run the users until `done()` (checked in a thread: it may ask a replica); return how long they
    took to stop once told to."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    stopping = asyncio.Event()
    task = asyncio.create_task(run_users(settings, stopping))
    try:
        while not await asyncio.to_thread(done):
            assert loop.time() < deadline, f"not done within {timeout} s"
            await asyncio.sleep(0.05)
    finally:
        stopping.set()
        told = time.monotonic()
        await asyncio.wait_for(task, timeout=5)
    return time.monotonic() - told


def conversations(caplog) -> list[str]:
    """The users' log lines, one per finished conversation."""
    return [r.getMessage() for r in caplog.records if "conversation" in r.getMessage()]


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

    asyncio.run(run_until(settings, lambda: len(conversations(caplog)) >= 3))  # no control file: defaults
    healthy = round_ones(replica.ground_truth())
    assert len(healthy) >= 3
    # Only the very first conversation finds the shared system prompt cold.
    cached = sorted(t["cached_tokens"] for t in healthy)
    assert all(c >= SYSTEM_TOKENS - 16 for c in cached[1:]), cached

    http_post(f"{replica.url}/lab/reset-cache", timeout=5)
    since = time.time()  # the first users are gone: everything that arrives later reads the control file
    control.write_text('{"dynamic_prefix": true}')
    finished = len(conversations(caplog))
    asyncio.run(run_until(settings, lambda: len(conversations(caplog)) >= finished + 3))
    faulty = [t for t in replica.ground_truth() if t["time"] > since]
    assert len(round_ones(faulty)) >= 3
    # The time is rendered into every request: not even a conversation's own history is reused.
    later = [t for t in faulty if t not in round_ones(faulty) and t["finished_reason"] != "abort"]
    assert later and all(t["cached_tokens"] == 0 for t in round_ones(faulty) + later)

    finished = conversations(caplog)
    assert len(finished) >= 6 and all("no errors, backends r1" in line for line in finished)


def test_bad_control_file_is_logged_once_and_never_fatal(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvwatch.lab.traffic")
    control = tmp_path / "control.json"
    control.write_text("{not json")
    settings = TrafficSettings(
        url=f"http://127.0.0.1:{free_port()}", users=2, think_seconds=0, control_path=control
    )
    asyncio.run(run_until(settings, lambda: len(conversations(caplog)) >= 4))
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if "control file" in line]) == 1
    failed = conversations(caplog)
    assert len(failed) >= 4 and all(
        "0/6 rounds ok, connection_refused (cannot connect" in line for line in failed
    )


def test_users_stop_promptly_even_mid_request():
    async def scenario():
        requests = []

        async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                requests.append(await reader.readuntil(b"\r\n\r\n"))
                await asyncio.sleep(30)  # takes the request and never answers
            finally:
                writer.close()

        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            settings = TrafficSettings(url=url, users=3, think_seconds=0)
            return await run_until(settings, lambda: len(requests) == 3)  # every user waits on an answer

    assert asyncio.run(scenario()) < 1.0


def test_cli_sends_traffic_and_exits_0_on_sigterm(start_replica, tmp_path):
    replica = start_replica("r1", "vllm", *FAST)
    log = tmp_path / "traffic.log"
    command = [sys.executable, "-m", "kvwatch.cli.main", "lab", "traffic", "--url", replica.url]
    command += ["--users", "2", "--rounds", "2", "--think", "0.05", "--system-tokens", "50"]
    command += ["--turn-tokens", "10", "--max-tokens", "8", "--session-mode", "client"]
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while "2/2 rounds ok, no errors" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.1)
        assert len(replica.ground_truth()) >= 2, log.read_text()
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=5) == 0, log.read_text()
    finally:
        stop(process)
