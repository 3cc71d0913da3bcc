"""`kvwatch serve`'s schedule on a virtual clock: the runs of many targets spread over their interval,
each target keeps its phase across a restart, a run that outlasts its interval skips the runs it missed,
a cron target runs at its fires, and a step of the wall clock either way delays no probe or log poll by
more than one interval (and the guard's tick)."""

from __future__ import annotations

import asyncio
import logging
import selectors
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path

import pytest

from conftest import set_wall_clock
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.targets.sagemaker import SageMakerEndpoint
from kvwatch.config.settings import Config, ExporterSettings, GatewayLog, StoreSettings, Target
from kvwatch.serve.jobs import GUARD_TICK_SECONDS, STEP_TOLERANCE_SECONDS, ClockStepGuard, Jobs
from kvwatch.serve.scheduler import GATEWAY_POLL_SECONDS, Service, phase, run_summary

INTERVAL = 30.0
POLL = "gateway-log poll"


class VirtualClock(selectors.DefaultSelector):
    """Instead of waiting for the next timer, move the clock on to it: hours of schedule in milliseconds."""

    now = 0.0

    def select(self, timeout: float | None = None):
        self.now += timeout or 0.0
        return super().select(0)


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.clock = VirtualClock()
        super().__init__(self.clock)

    def time(self) -> float:
        return self.clock.now


def run_jobs(loop: VirtualLoop, jobs: Callable[[], Jobs], seconds: float, at: float = 0.0, then=None) -> None:
    """Run the `jobs` made on `loop` for `seconds` of virtual time, calling `then` `at` seconds in."""

    async def scenario() -> None:
        stop = asyncio.Event()
        running = asyncio.ensure_future(jobs().run(stop))
        await asyncio.sleep(at)
        if then:
            then()
        await asyncio.sleep(seconds - at)
        stop.set()
        await running

    loop.run_until_complete(scenario())


def scheduled_runs(
    tmp_path: Path, monkeypatch, targets: list[Target], wall_start: float, seconds: float, step: float = 0.0
) -> dict[str, list[tuple[float, float]]]:
    """The (wall clock, monotonic clock) start times of every target's runs and of the gateway-log polls
    while `kvwatch serve`'s jobs run for `seconds` of virtual time, the wall clock reading `wall_start`
    when they start and stepping by `step` half way."""
    tmp_path.mkdir(exist_ok=True)
    loop, offset = VirtualLoop(), [wall_start]
    set_wall_clock(monkeypatch, lambda: offset[0] + loop.time())
    config = Config(
        targets=tuple(targets),
        gateway_logs=(GatewayLog("gateway", tmp_path / "access.log"),),
        exporter=ExporterSettings("127.0.0.1:9"),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    service, runs = Service(config), defaultdict(list)

    async def probe(target: Target) -> None:
        runs[target.name].append((offset[0] + loop.time(), loop.time()))

    async def prune() -> None:
        pass

    monkeypatch.setattr(service, "probe", probe)
    monkeypatch.setattr(service, "prune", prune)
    monkeypatch.setattr(service, "poll_gateway_logs", lambda: runs[POLL].append((0, loop.time())))
    monkeypatch.setattr(asyncio, "to_thread", inline)  # a thread's real time would run the virtual clock on

    def step_the_wall_clock() -> None:
        offset[0] += step

    try:
        run_jobs(loop, service.jobs, seconds, at=seconds / 2, then=step_the_wall_clock if step else None)
    finally:
        loop.close()
        service.writer.close(1)
        service.store.close()
    return runs


async def inline(function: Callable[[], object]) -> object:
    return function()


def interval_targets(names: list[str]) -> list[Target]:
    return [Target(n, "http://127.0.0.1:9", "m", interval_seconds=INTERVAL) for n in names]


def test_the_runs_of_many_targets_spread_over_the_interval_and_keep_their_period(tmp_path, monkeypatch):
    names = [f"replica-{i}" for i in range(200)]
    runs = scheduled_runs(
        tmp_path, monkeypatch, interval_targets(names), wall_start=1e9, seconds=3 * INTERVAL
    )
    first = [(times[0][0] - 1e9) for name, times in runs.items() if name != POLL]
    assert len(first) == len(names) and all(0 <= t < INTERVAL for t in first)
    per_tenth = [sum(int(t // (INTERVAL / 10)) == tenth for t in first) for tenth in range(10)]
    assert all(10 <= count <= 30 for count in per_tenth), per_tenth  # 20 each if evenly spread
    periods = {
        round(later - earlier, 6)
        for name, times in runs.items()
        if name != POLL
        for (earlier, _), (later, _) in pairwise(times)
    }
    assert periods == {INTERVAL}


def test_a_restarted_serve_runs_each_target_at_the_same_second_of_its_interval(tmp_path, monkeypatch):
    targets = interval_targets([f"route-{i}" for i in range(20)])
    before = scheduled_runs(tmp_path / "a", monkeypatch, targets, wall_start=1e9, seconds=2 * INTERVAL)
    after = scheduled_runs(
        tmp_path / "b", monkeypatch, targets, wall_start=1e9 + 4321.7, seconds=2 * INTERVAL
    )
    for target in targets:
        first_before, first_after = before[target.name][0][0], after[target.name][0][0]
        assert round(first_before % INTERVAL, 6) == round(first_after % INTERVAL, 6), target.name


def test_a_run_that_outlasts_its_interval_skips_the_runs_it_missed(monkeypatch):
    loop, starts = VirtualLoop(), []
    set_wall_clock(monkeypatch, loop.time)

    async def slow_run() -> None:
        starts.append(loop.time())
        await asyncio.sleep(2.5 * INTERVAL if len(starts) == 1 else 1)

    def jobs() -> Jobs:
        made = Jobs()
        made.every("slow", slow_run, INTERVAL, phase=None)
        return made

    try:
        run_jobs(loop, jobs, 4.5 * INTERVAL)
    finally:
        loop.close()
    assert starts == [0.0, 3 * INTERVAL, 4 * INTERVAL]  # runs 1 and 2 were due during the first run


def test_a_cron_target_runs_at_its_fires(tmp_path, monkeypatch):
    cron = Target("nightly", "http://127.0.0.1:9", "m", schedule="*/15 * * * * *")
    runs = scheduled_runs(
        tmp_path, monkeypatch, [cron, *interval_targets(["steady"])], wall_start=1e9 - 9, seconds=61
    )
    assert [round(wall - 1e9, 6) for wall, _ in runs["nightly"]] == [5.0, 20.0, 35.0, 50.0]  # 1e9 % 15 == 10
    assert cron.interval_seconds == 15.0


@pytest.mark.parametrize("step", [-3600.0, 3600.0])
def test_a_step_of_the_wall_clock_delays_no_probe_or_log_poll_by_more_than_an_interval(
    tmp_path, monkeypatch, step
):
    """Half way, the wall clock steps an hour back or forward; every run of a probe (every interval) and
    of the log poll comes on, none more than its interval and the guard's tick after the one before."""
    targets = interval_targets([f"route-{i}" for i in range(5)])
    nightly = Target("nightly", "http://127.0.0.1:9", "m", schedule="*/20 * * * * *")
    runs = scheduled_runs(tmp_path, monkeypatch, [*targets, nightly], 1e9, 10 * INTERVAL, step=step)
    intervals = {t.name: t.interval_seconds for t in [*targets, nightly]} | {POLL: GATEWAY_POLL_SECONDS}
    for name, interval in intervals.items():
        monotonic = [0.0] + [at for _, at in runs[name]] + [10 * INTERVAL]
        longest = max(later - earlier for earlier, later in pairwise(monotonic))
        assert longest <= interval + GUARD_TICK_SECONDS, (name, longest)
        assert len(runs[name]) >= 10 * INTERVAL // interval - 1, name


def test_the_guard_tells_a_step_of_the_wall_clock_from_its_running():
    wall, monotonic = [1000.0], [5.0]
    guard = ClockStepGuard(lambda: wall[0], lambda: monotonic[0])

    def after(wall_seconds: float, monotonic_seconds: float) -> float:
        wall[0] += wall_seconds
        monotonic[0] += monotonic_seconds
        return guard.step()

    assert after(0.25, 0.25) == 0.0
    assert after(0.25 + STEP_TOLERANCE_SECONDS / 2, 0.25) == 0.0  # NTP's slewing, not a step
    assert after(-3600 + 0.25, 0.25) == pytest.approx(-3600)
    assert after(0.25, 0.25) == 0.0  # the step is told once
    assert after(3600.5, 0.5) == pytest.approx(3600)
    assert after(10.0, 10.0) == 0.0  # a tick late (a busy loop) is no step


def test_a_sagemaker_target_is_probed_through_its_endpoint_and_learns_no_block_size_from_it(tmp_path):
    """Its probe settings carry the kind and the endpoint, its URL is the endpoint's, and the runtime API
    serves no /metrics to learn the block size from (the sessions' cached tokens tell it)."""
    endpoint = SageMakerEndpoint("chat", "eu-west-1", endpoint_url="http://127.0.0.1:9")
    targets = (
        Target("sm", model="m", kind="sagemaker", sagemaker=endpoint, interval_seconds=INTERVAL),
        Target("gw", "http://127.0.0.1:8", "m", interval_seconds=INTERVAL),
    )
    service = Service(Config(targets=targets, store=StoreSettings(tmp_path / "kvwatch.db")))
    probe = service.probes["sm"]
    assert (probe.kind, probe.sagemaker, probe.base_url) == ("sagemaker", endpoint, "http://127.0.0.1:9")
    assert service.block_sources["sm"].metrics_urls == ()
    assert service.block_sources["gw"].metrics_urls == ("http://127.0.0.1:8/metrics",)
    service.store.close()


def test_serve_says_each_jobs_schedule_and_first_run_as_it_starts(tmp_path, monkeypatch, caplog):
    """Nothing else is logged until a target's first run, up to an interval later: without these lines a
    serve that just started reads as stuck. 1e9 is 01:46:40 UTC, 03:46:40 in Paris."""
    set_wall_clock(monkeypatch, lambda: 1e9 + 0.5)
    steady = Target("chat-affinity", "http://127.0.0.1:9", "m", interval_seconds=INTERVAL)
    nightly = Target("nightly", "http://127.0.0.1:9", "m", schedule="0 3 * * *", timezone="Europe/Paris")
    config = Config(
        targets=(steady, nightly),
        gateway_logs=(GatewayLog("gateway", tmp_path / "access.log"),),
        exporter=ExporterSettings("127.0.0.1:9"),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    service = Service(config)
    try:
        with caplog.at_level(logging.INFO, "kvwatch.serve"):
            service.jobs()
    finally:
        service.writer.close(1)
        service.store.close()
    offset = phase("chat-affinity", INTERVAL)  # seconds into each interval of the wall clock
    due = 1e9 - 1e9 % INTERVAL + offset
    first = datetime.fromtimestamp(due if due >= 1e9 + 0.5 else due + INTERVAL, UTC)
    assert caplog.messages == [
        f"probe run of chat-affinity: every 30 s, first run at {first:%Y-%m-%d %H:%M:%S} UTC",
        'probe run of nightly: on "0 3 * * *" (Europe/Paris), first run at 2001-09-10 01:00:00 UTC',
        "gateway-log poll: every 5 s, first run at 2001-09-09 01:46:40 UTC",
        "store pruning: every 3600 s, first run at 2001-09-09 01:46:40 UTC",
    ]


def probe_session(backends: list[str], error_kind: str | None = None, interrupted: bool = False):
    """A session whose rounds landed on `backends`, the last one failing with `error_kind` if given."""
    rounds = tuple(
        RoundResult(i, 1e9 + i, None if error_kind and i == len(backends) else 200,
                    error_kind if i == len(backends) else None, None, 0.1, 0.2, 100, 0, 0, 4, backend,
                    "sid", "sid")
        for i, backend in enumerate(backends, start=1)
    )  # fmt: skip
    return SessionResult("chat", "affinity", "sid", 1e9, 1e9 + 10, rounds, interrupted)


def test_each_run_is_summed_up_in_one_line():
    sessions = [
        probe_session(["r1", "r1", "r1"]),
        probe_session(["r1", "r2", "r2"]),
        probe_session(["r2", "r2", "r2"]),
        probe_session(["r2", "r2", "r2"]),
        probe_session(["r1", "r1", "r1"], error_kind="timeout"),  # its two good rounds stayed
        probe_session(["r1"], error_kind="timeout"),  # no evidence either way
        probe_session(["r3", "r3"], error_kind="http_5xx", interrupted=True),  # one good round: none
    ]
    assert run_summary(sessions, 12.345) == (
        "7 sessions in 12.3 s, 80% on one replica, 3 failed (http_5xx 1, timeout 2), 1 cut short by the stop"
    )
    assert run_summary(sessions[:1], 0.5) == "1 session in 0.5 s, 100% on one replica, 0 failed"
    assert run_summary(sessions[5:6], 2) == "1 session in 2.0 s, stickiness not judged, 1 failed (timeout 1)"
