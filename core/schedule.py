"""A target's cron schedule (`schedule:` in the config), read alike by the config check and by serve.

Five fields as in crontab (minute hour day month weekday), or six with seconds first. Weekdays are
named (mon-fri): crontab counts 0 as Sunday and APScheduler 3 as Monday, so a number would be ambiguous.
"""

from __future__ import annotations

import functools
import re
from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.cron import CronTrigger

FIELDS = ("minute", "hour", "day", "month", "day_of_week")
# How far the longest gap between two fires is looked for: a year and more, or that many fires.
GAP_HORIZON_SECONDS = 400 * 86400
GAP_MAX_FIRES = 2_000


def time_zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`; ValueError when there is none."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f'unknown time zone "{name}"; use an IANA name such as UTC or Europe/Paris'
        ) from None


def cron_trigger(expression: str, timezone: str) -> CronTrigger:
    """The trigger of `expression` in `timezone`; ValueError says what is wrong with either."""
    zone = time_zone(timezone)
    values = expression.split()
    if len(values) not in (5, 6):
        raise ValueError(
            f'"{expression}" has {len(values)} fields; a schedule has 5 (minute hour day month weekday) '
            "or 6 with seconds first"
        )
    fields = dict(zip(("second", *FIELDS) if len(values) == 6 else FIELDS, values, strict=True))
    if re.search(r"\d", fields["day_of_week"]):
        raise ValueError(f'"{expression}": name the weekdays (mon-sun), numbers differ between cron dialects')
    fields.setdefault("second", "0")
    try:
        return CronTrigger(**fields, timezone=zone)
    except ValueError as error:
        raise ValueError(f'"{expression}" is not a cron schedule: {error}') from None


@functools.cache
def longest_gap(expression: str, timezone: str) -> float:
    """Seconds of the longest wait between two fires of the schedule over its next year (or its next
    GAP_MAX_FIRES fires), for what assumes an interval: the exporter's kvwatch_probe_interval_seconds and
    the stale-probe alert built on it. 0 when it never fires."""
    trigger = cron_trigger(expression, timezone)
    # Fixed, so that a schedule has one interval; a Friday, so that a weekday schedule meets a weekend.
    start = previous = datetime(2027, 1, 1, tzinfo=UTC)
    longest = 0.0
    for _ in range(GAP_MAX_FIRES):
        fire = trigger.get_next_fire_time(previous, previous)
        if fire is None:
            break
        longest, previous = max(longest, (fire - previous).total_seconds()), fire
        if (previous - start).total_seconds() > GAP_HORIZON_SECONDS:
            break
    return longest
