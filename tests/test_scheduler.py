"""`kvwatch serve`'s schedule on a virtual clock: the runs of many targets spread over their interval,
each target keeps its phase across a restart, and a run that outlasts its interval skips the ticks
it missed."""

from __future__ import annotations

import asyncio
import selectors
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

from kvwatch.core.config import Config, ExporterSettings, StoreSettings, Target
from kvwatch.serve.scheduler import Service, every

INTERVAL = 30.0


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


def scheduled_runs(tmp_path: Path, monkeypatch, names: list[str], wall_start: float, seconds: float):
    """The wall-clock start times of every target's runs while `kvwatch serve`'s jobs run for `seconds`
    of virtual time, the wall clock reading `wall_start` when they start."""
    tmp_path.mkdir(exist_ok=True)
    loop = VirtualLoop()
    monkeypatch.setattr(time, "time", lambda: wall_start + loop.time())
    config = Config(
        targets=tuple(Target(n, "http://127.0.0.1:9", "m", interval_seconds=INTERVAL) for n in names),
        exporter=ExporterSettings("127.0.0.1:9"),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    service, runs = Service(config), defaultdict(list)

    async def probe(target: Target) -> None:
        runs[target.name].append(time.time())

    async def prune() -> None:
        pass

    monkeypatch.setattr(service, "probe", probe)
    monkeypatch.setattr(service, "prune", prune)

    async def scenario() -> None:
        stop = asyncio.Event()
        jobs = service._start_jobs(stop)
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*jobs)

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
        service.writer.close(1)
        service.store.close()
    return runs


def test_the_runs_of_many_targets_spread_over_the_interval_and_keep_their_period(tmp_path, monkeypatch):
    names = [f"replica-{i}" for i in range(200)]
    runs = scheduled_runs(tmp_path, monkeypatch, names, wall_start=1e9, seconds=3 * INTERVAL)
    first = [(times[0] - 1e9) for times in runs.values()]
    assert len(first) == len(names) and all(0 <= t < INTERVAL for t in first)
    per_tenth = [sum(int(t // (INTERVAL / 10)) == tenth for t in first) for tenth in range(10)]
    assert all(10 <= count <= 30 for count in per_tenth), per_tenth  # 20 each if evenly spread
    periods = {round(later - earlier, 6) for times in runs.values() for earlier, later in pairwise(times)}
    assert periods == {INTERVAL}


def test_a_restarted_serve_runs_each_target_at_the_same_second_of_its_interval(tmp_path, monkeypatch):
    names = [f"route-{i}" for i in range(20)]
    before = scheduled_runs(tmp_path / "a", monkeypatch, names, wall_start=1e9, seconds=2 * INTERVAL)
    after = scheduled_runs(tmp_path / "b", monkeypatch, names, wall_start=1e9 + 4321.7, seconds=2 * INTERVAL)
    for name in names:
        assert round(before[name][0] % INTERVAL, 6) == round(after[name][0] % INTERVAL, 6), name


def test_a_run_that_outlasts_its_interval_skips_the_ticks_it_missed(monkeypatch):
    loop, starts = VirtualLoop(), []

    async def slow_run() -> None:
        starts.append(loop.time())
        await asyncio.sleep(2.5 * INTERVAL if len(starts) == 1 else 1)

    async def scenario() -> None:
        stop = asyncio.Event()
        job = asyncio.ensure_future(every("slow", INTERVAL, slow_run, stop))
        await asyncio.sleep(4.5 * INTERVAL)
        stop.set()
        await job

    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert starts == [0.0, 3 * INTERVAL, 4 * INTERVAL]  # ticks 1 and 2 passed during the first run
