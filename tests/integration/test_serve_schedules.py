"""`kvwatch serve` keeps its schedules: runs and gateway-log polls come on their intervals through a step
of the wall clock and a failing run, a cron target runs on its schedule, the log says each schedule and
sums up each run, an unforeseen failure is recorded, and a gateway's non-ASCII headers are probed."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest
from loopback import answering_bytes, loopback_http
from serve_runs import ANSWER, probed_targets, sample, samples, start_serve, terminate

from conftest import set_wall_clock
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe import session as probe_module
from kvwatch.collectors.probe.targets import ProbeClients
from kvwatch.config.settings import (
    Config,
    ExporterSettings,
    GatewayLog,
    StoreSettings,
    Target,
    Workload,
)
from kvwatch.serve.scheduler import GATEWAY_POLL_SECONDS, Service
from kvwatch.store.history import Store
from processes import free_port, stop

pytestmark = pytest.mark.integration


def step_wall_clock(monkeypatch, seconds: float) -> None:
    """Step the wall clock as every Python reader sees it (conftest.set_wall_clock); the monotonic clock,
    which no step moves, is left alone."""
    wall = time.time
    set_wall_clock(monkeypatch, lambda: wall() + seconds)


@pytest.mark.parametrize("step", [-3600, 3600])
def test_a_step_of_the_wall_clock_or_a_failing_run_does_not_delay_the_next_run_or_log_poll(
    tmp_path, monkeypatch, step
):
    """The wall clock steps an hour back, or forward, in the first run: the next run and the next
    gateway-log poll come on their intervals, not an hour later."""
    target = Target("direct", "http://127.0.0.1:9", "m", interval_seconds=1)
    config = Config(
        targets=(target,),
        gateway_logs=(GatewayLog("gateway", tmp_path / "access.log"),),
        exporter=ExporterSettings(f"127.0.0.1:{free_port()}"),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    service, runs, polls, stepped = Service(config), [], [], []

    async def scenario():
        stop = asyncio.Event()

        def stop_once_both_came_after_the_step() -> None:
            if stepped and runs[-1] > stepped[0] and polls and polls[-1] > stepped[0]:
                stop.set()

        async def probe(target: Target) -> None:
            runs.append(time.monotonic())
            if len(runs) == 1:
                step_wall_clock(monkeypatch, step)
                stepped.append(time.monotonic())
            stop_once_both_came_after_the_step()
            raise RuntimeError("a bug in a run")

        def poll() -> None:
            polls.append(time.monotonic())
            stop_once_both_came_after_the_step()

        monkeypatch.setattr(service, "probe", probe)
        monkeypatch.setattr(service, "poll_gateway_logs", poll)
        polls.append(time.monotonic())  # as if one came at the start: the first is due at once
        await asyncio.wait_for(service.run(stop), timeout=30)  # a guard against a hang, not a timing

    asyncio.run(scenario())
    assert runs[1] - runs[0] < 2  # the interval and its jitter, not the hour of the step
    last_poll_before, first_poll_after = max(p for p in polls if p <= stepped[0]), polls[-1]
    assert first_poll_after - last_poll_before < GATEWAY_POLL_SECONDS + 1


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
STREAM_BODY = b"".join(b"data: %s\n\n" % event.encode() for event in [*map(json.dumps, ANSWER), "[DONE]"])


def probed_once(tmp_path: Path, target: dict) -> tuple[dict[tuple, float], Path]:
    """The samples of a `kvwatch serve` of `target` once it has probed it, and its log; stopped cleanly."""
    process, url, log = start_serve(tmp_path, target)
    try:
        assert probed_targets(url) == {target["name"]}, log.read_text()
        found = samples(url)
        terminate(process, log)
    finally:
        stop(process)
    return found, log


def test_a_gateway_sending_non_ascii_headers_is_probed_stored_and_exported(tmp_path: Path):
    head = STREAM_HEAD + b"Server: caf\xc3\xa9-gateway\r\nX-Upstream: r\xff1\r\n\r\n"
    target = {"name": "direct", "base_url": "", "model": "m", "interval_seconds": 1, "sessions_per_run": 1,
              "rounds": 2, "workload": {"system_tokens": 20, "turn_tokens": 5, "max_tokens": 1}}  # fmt: skip
    with loopback_http(answering_bytes(head + STREAM_BODY)) as engine:
        found, _ = probed_once(tmp_path, {**target, "base_url": engine})
    route = {"target": "direct", "route_mode": "affinity"}
    assert sample(found, "kvwatch_probe_sessions_total", outcome="success", **route) >= 1
    assert sample(found, "kvwatch_probe_last_run_timestamp_seconds", **route) > time.time() - 60
    assert sample(found, "kvwatch_probe_backend_rounds_total", backend="r\xff1", **route) >= 2
    with Store(tmp_path / "kvwatch.db", readonly=True) as store:
        rounds = store.rounds(target="direct")
    assert rounds and {(r["error_kind"], r["backend"]) for r in rounds} == {(None, "r\xff1")}


def test_a_cron_target_runs_on_its_schedule(tmp_path: Path):
    """`schedule` instead of `interval_seconds`: every second by its seconds field, and exported with its
    longest gap as its interval, which the stale-probe alert reads."""
    target = {"name": "cron", "base_url": "", "model": "m", "schedule": "* * * * * *", "sessions_per_run": 1,
              "rounds": 2, "workload": {"system_tokens": 20, "turn_tokens": 5, "max_tokens": 1}}  # fmt: skip
    with loopback_http(answering_bytes(STREAM_HEAD + b"\r\n" + STREAM_BODY)) as engine:
        found, log = probed_once(tmp_path, {**target, "base_url": engine})
    route = {"target": "cron", "route_mode": "affinity"}
    assert sample(found, "kvwatch_probe_interval_seconds", **route) == 1.0
    assert sample(found, "kvwatch_probe_sessions_total", outcome="success", **route) >= 1
    assert "Traceback" not in log.read_text()


RUN_LINES = {
    "steady": r"steady: 1 session in \d+\.\d s, 100% on one replica, 0 failed; ",
    "cron": r"cron: 1 session in \d+\.\d s, 100% on one replica, 0 failed; ",
    "down": r"down: 1 session in \d+\.\d s, stickiness not judged, 1 failed \(http_error 1\); ",
}


def test_serve_says_each_schedule_at_start_and_sums_up_each_run(tmp_path: Path):
    """A real `kvwatch serve` of an interval target through a sticky engine, a cron target and a target
    whose engine answers 503: each schedule and first run logged as it starts, before any run, and one
    line per run with its sessions, time, stickiness and failures by kind."""
    workload = {"system_tokens": 20, "turn_tokens": 5, "max_tokens": 1}
    one = {"model": "m", "sessions_per_run": 1, "rounds": 2, "workload": workload}
    failing = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
    sticky = STREAM_HEAD + b"X-Upstream: 127.0.0.1:9001\r\n\r\n" + STREAM_BODY
    with loopback_http(answering_bytes(sticky)) as engine, loopback_http(answering_bytes(failing)) as down:
        targets = [
            {"name": "steady", "base_url": engine, "interval_seconds": 1, **one},
            {"name": "cron", "base_url": engine, "schedule": "* * * * * *", **one},
            {"name": "down", "base_url": down, "interval_seconds": 1, **one},
        ]
        process, _, log = start_serve(tmp_path, targets)
        try:
            deadline = time.monotonic() + 30
            while not all(re.search(p, log.read_text()) for p in RUN_LINES.values()):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            terminate(process, log)
        finally:
            stop(process)
    lines = log.read_text().splitlines()
    at = r"first run at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"
    schedules = [
        rf"probe run of steady: every 1 s, {at}",
        rf'probe run of cron: on "\* \* \* \* \* \*" \(UTC\), {at}',
        rf"probe run of down: every 1 s, {at}",
    ]

    def first(pattern: str) -> int:
        found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        assert found, (pattern, lines)
        return found[0]

    first_run = min(first(pattern) for pattern in RUN_LINES.values())
    assert all(first(pattern) < first_run for pattern in schedules), lines


def broken_read_chunk(*args) -> None:
    raise RuntimeError("a bug in reading a chunk")


def broken_next_run() -> None:
    raise RuntimeError("a bug in building the workload")


async def broken_learn(*args) -> None:
    raise RuntimeError("a bug in learning the block size")


@pytest.mark.parametrize(
    "module, name, broken, kinds",
    [
        pytest.param(probe_module, "_read_chunk", broken_read_chunk, ["internal_error"], id="in-a-round"),
        pytest.param(None, "next_run", broken_next_run, ["internal_error"], id="building-the-workload"),
        pytest.param(blocksize, "learn", broken_learn, [None, None], id="learning-the-block-size"),
    ],
)
def test_a_run_failing_unforeseen_is_recorded_counted_stored_and_dated(
    tmp_path, monkeypatch, module, name, broken, kinds
):
    workload = Workload(system_tokens=20, turn_tokens=5, max_tokens=1)
    with loopback_http(answering_bytes(STREAM_HEAD + b"\r\n" + STREAM_BODY)) as engine:
        target = Target(
            "direct", engine, "m", interval_seconds=60, sessions_per_run=1, rounds=2, workload=workload
        )
        config = Config(targets=(target,), exporter=ExporterSettings(f"127.0.0.1:{free_port()}"),
                        store=StoreSettings(tmp_path / "kvwatch.db"))  # fmt: skip
        service = Service(config)
        monkeypatch.setattr(module or service.conversations["direct"], name, broken)

        async def one_run() -> None:
            service._gate, service._stop = asyncio.Semaphore(1), asyncio.Event()
            async with ProbeClients() as service._clients:
                await service.probe(target)

        before = time.time()
        asyncio.run(asyncio.wait_for(one_run(), timeout=30))  # a guard against a hang, not a timing
    service.writer.close(5)
    route = {"target": "direct", "route_mode": "affinity"}
    registry = service.registry
    assert registry.get_sample_value("kvwatch_probe_last_run_timestamp_seconds", route) >= before
    errors = registry.get_sample_value("kvwatch_probe_errors_total", {**route, "kind": "internal_error"})
    assert errors == kinds.count("internal_error")
    (stored,) = service.store.sessions(target="direct")
    rounds = service.store.rounds(target="direct")
    assert [r["error_kind"] for r in rounds] == kinds and stored["ok"] == (None in kinds)
    assert all("RuntimeError at" in r["error_detail"] for r in rounds if r["error_kind"])
    service.store.close()


def test_the_store_settings_reach_the_writer(tmp_path, monkeypatch):
    settings = StoreSettings(tmp_path / "kvwatch.db", queue_capacity=3, retry_seconds=7.0, flush_seconds=2.5)
    target = Target("direct", "http://127.0.0.1:9", "m", interval_seconds=60)
    config = Config(targets=(target,), exporter=ExporterSettings(f"127.0.0.1:{free_port()}"), store=settings)
    service, flushed = Service(config), []
    assert (service.writer.capacity, service.writer.retry_seconds) == (3, 7.0)
    close = service.writer.close
    monkeypatch.setattr(service.writer, "close", lambda timeout: flushed.append(timeout) or close(timeout))
    stop = asyncio.Event()
    stop.set()
    asyncio.run(asyncio.wait_for(service.run(stop), timeout=30))
    assert flushed == [2.5]


def test_building_a_large_workload_leaves_the_event_loop_serving(tmp_path, monkeypatch):
    """The build is held until the event loop has run a step after it began: off the loop it goes on at
    once; on the loop's own thread it would wait out the 30 s, and the exporter, the webhook and a stop
    with it. (Counting loop steps in a window of building instead failed on a busy machine.)"""
    workload = Workload(system_tokens=100_000, turn_tokens=1000)  # about half a second of text to build
    target = Target("direct", "http://127.0.0.1:9", "m", interval_seconds=1, workload=workload)
    config = Config(
        targets=(target,),
        exporter=ExporterSettings(f"127.0.0.1:{free_port()}"),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    service = Service(config)
    conversations = service.conversations["direct"]
    build = conversations.next_run
    building, loop_ran, served_while_building = threading.Event(), threading.Event(), []

    def build_once_the_loop_ran():
        building.set()
        served_while_building.append(loop_ran.wait(timeout=30))
        return build()

    monkeypatch.setattr(conversations, "next_run", build_once_the_loop_ran)

    async def scenario():
        stop = asyncio.Event()

        async def heartbeat():
            for _ in range(4000):  # 40 s at most
                if building.is_set():
                    loop_ran.set()
                if served_while_building:
                    stop.set()
                    return
                await asyncio.sleep(0.01)

        await asyncio.wait_for(asyncio.gather(service.run(stop), heartbeat()), timeout=60)

    asyncio.run(scenario())
    assert served_while_building[:1] == [True], "the event loop did not run while the workload was built"
