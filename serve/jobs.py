"""`kvwatch serve`'s jobs on APScheduler, kept on time when the wall clock steps.

APScheduler places every run by the wall clock, so a step back of an hour (NTP, a resumed VM) would pause
every job for that hour, and a step forward would run them early. A guard compares the wall clock with
the event loop's monotonic one on a short tick and, when the wall clock stepped, places every job's next
run anew by the new wall clock: none then waits more than one interval (one tick more at most).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.interval import IntervalTrigger

from kvwatch.core.naming import plural

log = logging.getLogger("kvwatch.serve")

GUARD_TICK_SECONDS = 0.25
STEP_TOLERANCE_SECONDS = 0.1  # far above NTP's slewing over a tick, far below any interval
RUNS_FINISH_SECONDS = 10.0  # at a stop, for the runs in flight to learn their block size and store
# One run at a time, a run that outlasts its interval skips the runs it missed, and a late run still runs.
JOB_DEFAULTS = {"max_instances": 1, "coalesce": True, "misfire_grace_time": None}


class ClockStepGuard:
    """Tells how far the wall clock stepped since it last looked, measured against a monotonic clock."""

    def __init__(self, wall: Callable[[], float], monotonic: Callable[[], float]) -> None:
        self._wall, self._monotonic = wall, monotonic
        self._last = (wall(), monotonic())

    def step(self) -> float:
        """Seconds the wall clock jumped (negative: back) since the last call; 0 when it just ran."""
        now = (self._wall(), self._monotonic())
        (wall, monotonic), self._last = self._last, now
        jump = (now[0] - wall) - (now[1] - monotonic)
        return jump if abs(jump) > STEP_TOLERANCE_SECONDS else 0.0


def wall_now() -> datetime:
    return datetime.fromtimestamp(time.time(), UTC)


class Jobs:
    """The jobs of one serve: each one run at a time, a run that raises logged and the next one going on."""

    def __init__(self) -> None:
        self.scheduler = AsyncIOScheduler(timezone=UTC, job_defaults=JOB_DEFAULTS)
        # Not a line per run, nor per run skipped while the one before still runs (as meant): errors only.
        logging.getLogger("apscheduler").setLevel(logging.ERROR)
        self._running: set[asyncio.Task] = set()

    def every(
        self, name: str, job: Callable[[], Awaitable[object]], interval: float, phase: float | None
    ) -> None:
        """Run `job` every `interval` seconds `phase` seconds into each interval of the wall clock, or
        from now on without a phase."""
        start = datetime.fromtimestamp(phase or 0.0, UTC)
        trigger = IntervalTrigger(seconds=interval, start_date=start, timezone=UTC)
        self.add(name, job, trigger, f"every {interval:g} s", wall_now() if phase is None else None)

    def add(
        self,
        name: str,
        job: Callable[[], Awaitable[object]],
        trigger: BaseTrigger,
        schedule: str,
        first: datetime | None = None,
    ) -> None:
        """Run `job` on `trigger`, the first time at `first` if given; logged with its `schedule` in words
        and its first run, so that a serve that says nothing for an interval is not taken for stuck."""

        async def run() -> None:
            self._running.add(asyncio.current_task())
            try:
                await job()
            except Exception:
                log.exception("%s failed", name)
            except asyncio.CancelledError:  # by _finish_runs, which has said so: not an error of the job
                pass
            finally:
                self._running.discard(asyncio.current_task())

        first = first or trigger.get_next_fire_time(None, wall_now())
        self.scheduler.add_job(run, trigger, name=name, next_run_time=first)
        at = "never" if first is None else f"at {first.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
        log.info("%s: %s, first run %s", name, schedule, at)

    def replace_all(self) -> None:
        """Every job's next run placed by the wall clock as it reads now."""
        now = wall_now()
        for job in self.scheduler.get_jobs():
            job.modify(next_run_time=job.trigger.get_next_fire_time(None, now))

    async def run(self, stop: asyncio.Event) -> None:
        """Run the jobs until `stop` is set, guarding them against steps of the wall clock; then let the
        runs in flight store what they have and shut the scheduler down."""
        guard = ClockStepGuard(lambda: time.time(), asyncio.get_running_loop().time)
        self.scheduler.start()
        try:
            while not await _set_within(stop, GUARD_TICK_SECONDS):
                if jump := guard.step():
                    log.warning("the wall clock stepped %+.1f s: every job placed anew", jump)
                    self.replace_all()
            self.scheduler.pause()
            await self._finish_runs()
        finally:
            self.scheduler.shutdown(wait=False)

    async def _finish_runs(self) -> None:
        """The runs in flight, given RUNS_FINISH_SECONDS to store what they have, then cancelled."""
        if not self._running:
            return
        _, late = await asyncio.wait(set(self._running), timeout=RUNS_FINISH_SECONDS)
        if late:
            log.warning(
                "%s still ran %g s after the stop: cancelled", plural(len(late), "job"), RUNS_FINISH_SECONDS
            )
            for task in late:
                task.cancel()
            await asyncio.wait(late)


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True
