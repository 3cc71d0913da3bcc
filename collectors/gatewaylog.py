"""Follow a gateway's JSON access log: load per upstream, requests without a session key, and sessions
spread over more than one upstream (apart from those a failover moved), in bounded memory.

A scheduler job calls `GatewayLogFollower.poll()`; it reads what the gateway appended since the last call
and publishes an immutable `GatewayLogSnapshot`. What a line means is up to the log's format
(collectors/gatewaylogs/: nginx, Envoy); reading the file and counting are the same for all.
`GatewayLogCollector` turns the latest snapshots into `kvwatch_gateway_*` metrics on every scrape.
Session ids stay inside the follower: only counts leave it.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import BinaryIO

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvwatch.collectors import gatewaylogs
from kvwatch.collectors.gatewaylogs import MALFORMED_REASONS, NO_UPSTREAM, Malformed, json_object

log = logging.getLogger("kvwatch.gatewaylog")

# Why a poll could not read a log: a fixed list, so that a reason can be a label.
UNREADABLE_REASONS = ("not_found", "permission_denied", "is_directory", "not_regular_file", "read_error")
# A gateway's request line limit (nginx: 8 KiB by default) keeps real lines far shorter; a longer one is
# garbage and must not grow memory.
MAX_LINE_BYTES = 64 * 1024
# About 0.7 s of parsing (README, "Gateway access log"), so that a huge or endless log keeps neither
# the other logs nor a shutdown waiting; at one poll per 5 s it still follows ~3 MB/s per log.
MAX_BYTES_PER_POLL = 16 * 1024 * 1024
# A file truncated in place (copytruncate) and written past the offset read up to by the next poll is
# told only by its first bytes, which an appended file keeps: a line or more of them.
HEAD_BYTES = 4096

_LOG_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_BOOLS = ("false", "true")  # label values, indexed by a bool


class _NotARegularFile(OSError):
    """A FIFO, socket or device: opening it may wait for a writer, reading it may never end."""


def unreadable_reason(error: OSError) -> str:
    """The reason of UNREADABLE_REASONS that an error opening or reading a log stands for."""
    for kind, reason in (
        (FileNotFoundError, "not_found"),
        (PermissionError, "permission_denied"),
        (IsADirectoryError, "is_directory"),
        (_NotARegularFile, "not_regular_file"),
    ):
        if isinstance(error, kind):
            return reason
    return "read_error"


def _open_regular_file(path: Path) -> BinaryIO:
    """Open `path` for reading unless it is not a regular file; never blocks, whatever it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(mode):
            raise _NotARegularFile("not a regular file (a FIFO, socket or device)")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


def _by_reason(counts: Counter[str], reasons: tuple[str, ...]) -> Mapping[str, int]:
    return _frozen({reason: counts[reason] for reason in reasons})


class _Session:
    """What the follower remembers of one session: when each upstream last served it, its two latest
    requests, and when it last moved because of a failover."""

    __slots__ = ("upstreams", "last", "previous", "failed_over")

    def __init__(self) -> None:
        self.upstreams: dict[str, float] = {}  # upstream -> when it last served the session
        self.last = self.previous = self.failed_over = -math.inf

    def served(self, upstream: str, at: float, failover: bool) -> None:
        # Back on an upstream it had before its last failover: the failed server recovered, and this move
        # is part of that failover too.
        if failover or self.upstreams.get(upstream, math.inf) < self.failed_over:
            self.failed_over = at
        self.upstreams[upstream] = at
        if at >= self.last:
            self.previous, self.last = self.last, at
        else:  # a gateway logs a request when it ends: a long one can come after a later one
            self.previous = max(self.previous, at)


@dataclass(frozen=True)
class GatewayLogSnapshot:
    """The statistics of one followed log as of one poll; the mappings are read-only copies.

    Per-listener mappings have an entry (possibly 0) for every listener seen in the log.
    """

    log: str
    expect_sticky: bool  # whether the log's listeners are meant to keep a session on one upstream
    taken_at: float  # the clock's time of the poll: active sessions and spread are as of then
    problem: str | None  # a reason of UNREADABLE_REASONS, "not_polled" before the first poll, or None
    unreadable_polls: Mapping[str, int]  # reason -> polls that could not read the log, every reason
    unread_bytes: int  # left for the next polls by the bound on bytes per poll
    lines: int
    malformed: Mapping[str, int]  # reason -> lines, every reason of MALFORMED_REASONS
    requests: Mapping[tuple[str, str], int]  # (listener, last upstream tried or NO_UPSTREAM) -> requests
    responses: Mapping[tuple[str, str], int]  # (listener, status class such as "2xx") -> requests
    failovers: Mapping[str, int]  # listener -> requests that tried more than one upstream or saw one fail
    without_session_key: Mapping[str, int]  # listener -> requests whose session id the gateway assigned
    assigned_session_ids: Mapping[str, int]  # listener -> distinct session ids the gateway assigned
    # (listener, failover) -> sessions on more than one upstream in the window; failover is "true" when
    # the session moved because an upstream failed, "false" when nothing explains the move.
    spread_sessions: Mapping[tuple[str, str], int]
    returning_sessions: Mapping[str, int]  # listener -> sessions with 2+ requests in the window
    active_sessions: Mapping[str, int]  # listener -> sessions seen within the TTL
    tracked_sessions: int
    evicted_sessions: int  # dropped to respect max_sessions while still within the window or TTL

    @property
    def readable(self) -> bool:
        return self.problem is None

    @property
    def info(self) -> Mapping[str, int]:
        return {_BOOLS[self.expect_sticky]: 1}


class GatewayLogFollower:
    """Reads a gateway's JSON access log incrementally and keeps its statistics in bounded memory.

    Owns no thread: one scheduler job at a time calls `poll()`; any thread may read `latest`, an
    immutable snapshot that each poll swaps in whole. The file is followed as `tail -F` does, and no
    line the gateway writes is lost to a rename rotation: the renamed file is read for as long as it may
    still write it (until the new file is there and a whole poll interval brought nothing new), then
    the new one from its start. A truncated file is read again from its start, and a missing file is
    not an error. Anything but a regular file is refused, and a poll reads at most
    `max_bytes_per_poll` of a log, so one log never stalls the others.
    `log_format` names the format of gatewaylogs.FORMATS its lines are in. Event times come from the
    log (nginx's `msec`); `clock` gives "now" for the window and the TTL.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        name: str,
        *,
        spread_window_seconds: float = 600.0,
        session_ttl_seconds: float = 1800.0,
        max_sessions: int = 100_000,
        expect_sticky: bool = True,
        max_bytes_per_poll: int = MAX_BYTES_PER_POLL,
        log_format: str = "nginx",
        clock: Callable[[], float] = time.time,
    ):
        if not _LOG_NAME.fullmatch(name):
            raise ValueError(f"gateway log name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        self.path = Path(path)
        self.name = name
        self._format = gatewaylogs.log_format(log_format)
        self.spread_window_seconds = spread_window_seconds
        self.session_ttl_seconds = session_ttl_seconds
        self.max_sessions = max_sessions
        self.expect_sticky = expect_sticky
        self.max_bytes_per_poll = max_bytes_per_poll
        self._clock = clock
        self._file: BinaryIO | None = None
        self._successor_seen = False  # whether the last poll found another file at the path already
        self._head = b""  # the file's first bytes read, up to HEAD_BYTES: changed, it was truncated
        self._budget = 0  # bytes this poll may still read
        self._unread_bytes = 0
        self._pending = b""  # the start of a line the gateway has not finished writing yet
        self._skipping_long_line = False
        self._problem: str | None = "not_polled"
        self._unreadable_polls: Counter[str] = Counter()
        self._lines = 0
        self._malformed: Counter[str] = Counter()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._responses: Counter[tuple[str, str]] = Counter()
        self._failovers: Counter[str] = Counter()
        self._without_key: Counter[str] = Counter()
        self._assigned_ids: Counter[str] = Counter()
        # (listener, session id) -> its history, least recently seen first.
        self._sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()
        self._evicted = 0
        self.latest = self._snapshot()

    def poll(self) -> GatewayLogSnapshot:
        """Read what was appended since the last poll and publish a new snapshot as `latest`."""
        try:
            self._follow()
        except OSError as error:
            reason = unreadable_reason(error)
            self._unreadable_polls[reason] += 1
            if reason != self._problem:  # logged once per change, not on every poll
                log.warning(
                    "gateway log %s: cannot read %s (%s: %s); kvwatch tries again on every poll",
                    self.name, self.path, reason, error.strerror or error,
                )  # fmt: skip
            self._problem = reason
        else:
            if self._problem not in (None, "not_polled"):
                log.info("gateway log %s: reading %s again", self.name, self.path)
            self._problem = None
        self.latest = self._snapshot()
        return self.latest

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._successor_seen = False

    def __enter__(self) -> GatewayLogFollower:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- reading ----------------------------------------------------------------------------------

    def _follow(self) -> None:
        self._budget, self._unread_bytes = self.max_bytes_per_poll, 0
        if self._file is not None:
            # Checked before reading, so whatever reached the old file until now is read.
            replaced = self._replaced()
            if self._truncated():
                self._take_partial_line()
                self._file.seek(0)
                self._head = b""
            self._read()
            # The gateway writes the renamed file until it reopens its log, which can be after the new file
            # appeared (logrotate's `create`): the old one is done once a whole poll brought nothing.
            if replaced and self._successor_seen and self._budget == self.max_bytes_per_poll:
                self._take_partial_line()
                self.close()
            else:
                self._successor_seen = replaced
        if self._file is None:
            self._file = _open_regular_file(self.path)
            self._head = b""
            self._read()
        fd = self._file.fileno()
        if len(self._head) < HEAD_BYTES:
            self._head = os.pread(fd, min(HEAD_BYTES, self._file.tell()), 0)
        self._unread_bytes = max(0, os.fstat(fd).st_size - self._file.tell())

    def _replaced(self) -> bool:
        """Whether the path names another file; while it names none, the gateway may still write ours."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return False
        ours = os.fstat(self._file.fileno())
        return (current.st_dev, current.st_ino) != (ours.st_dev, ours.st_ino)

    def _truncated(self) -> bool:
        """Shorter than what was read, or (copytruncate, then written again) not the same first bytes."""
        fd = self._file.fileno()
        return os.fstat(fd).st_size < self._file.tell() or os.pread(fd, len(self._head), 0) != self._head

    def _read(self) -> None:
        """Read to the end of the file or of this poll's byte budget."""
        while self._budget > 0:
            chunk = self._file.readline(min(MAX_LINE_BYTES, self._budget))
            if not chunk:
                return
            self._budget -= len(chunk)
            complete = chunk.endswith(b"\n")
            if self._skipping_long_line:
                self._skipping_long_line = not complete
                continue
            self._pending += chunk
            if complete:
                self._take(self._pending)
                self._pending = b""
            elif len(self._pending) >= MAX_LINE_BYTES:
                self._lines += 1
                self._malformed["too_long"] += 1
                self._pending = b""
                self._skipping_long_line = True

    def _take_partial_line(self) -> None:
        """Its file was rotated or truncated, so the partial line will never be completed: take it as is."""
        if self._pending:
            self._take(self._pending)
        self._pending = b""
        self._skipping_long_line = False

    # --- statistics -------------------------------------------------------------------------------

    def _take(self, line: bytes) -> None:
        self._lines += 1
        try:
            request = self._format.parse(json_object(line))
        except Malformed as malformed:
            self._malformed[malformed.reason] += 1
            return
        listener, upstream, failover = request.listener, request.upstream, request.failover
        self._requests[listener, upstream] += 1
        self._responses[listener, f"{request.status // 100}xx"] += 1
        if failover:
            self._failovers[listener] += 1
        key = (listener, request.session_id)
        session = self._sessions.get(key)
        if request.assigned:
            self._without_key[listener] += 1
            if session is None:
                self._assigned_ids[listener] += 1
        if upstream != NO_UPSTREAM:
            if session is None:
                session = self._sessions[key] = _Session()
            session.served(upstream, request.time, failover)
            self._sessions.move_to_end(key)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
                self._evicted += 1

    def _forget_sessions_idle_since(self, horizon: float) -> None:
        """Sessions idle longer than both the window and the TTL count for nothing; they are the oldest."""
        while self._sessions:
            if next(iter(self._sessions.values())).last >= horizon:
                return
            self._sessions.popitem(last=False)

    def _snapshot(self) -> GatewayLogSnapshot:
        now = self._clock()
        self._forget_sessions_idle_since(now - max(self.spread_window_seconds, self.session_ttl_seconds))
        active_since, spread_since = now - self.session_ttl_seconds, now - self.spread_window_seconds
        active: Counter[str] = Counter()
        returning: Counter[str] = Counter()
        spread: Counter[tuple[str, str]] = Counter()
        for (listener, _), session in self._sessions.items():
            active[listener] += session.last >= active_since
            returning[listener] += session.previous >= spread_since
            if sum(seen >= spread_since for seen in session.upstreams.values()) > 1:
                spread[listener, _BOOLS[session.failed_over >= spread_since]] += 1
        listeners = sorted({listener for listener, _ in self._requests})

        def per_listener(counts: Counter[str]) -> Mapping[str, int]:
            return _frozen({listener: counts[listener] for listener in listeners})

        return GatewayLogSnapshot(
            log=self.name,
            expect_sticky=self.expect_sticky,
            taken_at=now,
            problem=self._problem,
            unreadable_polls=_by_reason(self._unreadable_polls, UNREADABLE_REASONS),
            unread_bytes=self._unread_bytes,
            lines=self._lines,
            malformed=_by_reason(self._malformed, MALFORMED_REASONS),
            requests=_frozen(self._requests),
            responses=_frozen(self._responses),
            failovers=per_listener(self._failovers),
            without_session_key=per_listener(self._without_key),
            assigned_session_ids=per_listener(self._assigned_ids),
            spread_sessions=_frozen(
                {(name, moved): spread[name, moved] for name in listeners for moved in _BOOLS}
            ),
            returning_sessions=per_listener(returning),
            active_sessions=per_listener(active),
            tracked_sessions=len(self._sessions),
            evicted_sessions=self._evicted,
        )


# --- metrics --------------------------------------------------------------------------------------

# name, family, snapshot attribute, labels after `log`, HELP
_FAMILIES = (
    ("kvwatch_gateway_requests", CounterMetricFamily, "requests", ("listener", "upstream"),
     "Requests in the gateway access log, by the upstream that served them (the last one tried)."),
    ("kvwatch_gateway_responses", CounterMetricFamily, "responses", ("listener", "status_class"),
     "Requests in the gateway access log, by HTTP status class."),
    ("kvwatch_gateway_requests_without_session_key", CounterMetricFamily, "without_session_key",
     ("listener",), "Requests that arrived without a client session key, so the gateway assigned one."),
    ("kvwatch_gateway_assigned_session_ids", CounterMetricFamily, "assigned_session_ids", ("listener",),
     "Distinct session ids the gateway assigned to requests without a session key."),
    ("kvwatch_gateway_failovers", CounterMetricFamily, "failovers", ("listener",),
     "Requests the gateway sent to more than one upstream, or whose upstream failed (Envoy: UF, URX)."),
    ("kvwatch_gateway_session_spread_sessions", GaugeMetricFamily, "spread_sessions",
     ("listener", "failover"), "Sessions served by more than one upstream within the spread window, as of "
     "the last log poll; failover=\"true\": moved because an upstream failed."),
    ("kvwatch_gateway_returning_sessions", GaugeMetricFamily, "returning_sessions", ("listener",),
     "Sessions with two or more requests within the spread window (the ones that could spread), as of the "
     "last log poll."),
    ("kvwatch_gateway_active_sessions", GaugeMetricFamily, "active_sessions", ("listener",),
     "Sessions seen within the session TTL, as of the last log poll."),
    ("kvwatch_gateway_malformed_lines", CounterMetricFamily, "malformed", ("reason",),
     "Access log lines that were skipped because they could not be read as a request."),
    ("kvwatch_gateway_lines", CounterMetricFamily, "lines", (),
     "Access log lines read, malformed ones included."),
    ("kvwatch_gateway_evicted_sessions", CounterMetricFamily, "evicted_sessions", (),
     "Sessions forgotten early to keep memory bounded; when rising, raise max_sessions."),
    ("kvwatch_gateway_log_readable", GaugeMetricFamily, "readable", (),
     "Whether the last poll could read the access log (0: missing or unreadable)."),
    ("kvwatch_gateway_log_unreadable_polls", CounterMetricFamily, "unreadable_polls", ("reason",),
     "Polls that could not read the access log, by reason."),
    ("kvwatch_gateway_log_unread_bytes", GaugeMetricFamily, "unread_bytes", (),
     "Bytes of the access log left for later polls by the bound on bytes read per poll, as of the last "
     "poll; when rising, kvwatch falls behind the log."),
    ("kvwatch_gateway_log_last_poll_timestamp_seconds", GaugeMetricFamily, "taken_at", (),
     "Unix time of the last poll of the access log by the scheduler."),
    ("kvwatch_gateway_log_info", GaugeMetricFamily, "info", ("expect_sticky",),
     "The followed log's settings: whether its listeners are meant to keep each session on one upstream."),
)  # fmt: skip
LABEL_NAMES = frozenset({"log", *(label for _, _, _, labels, _ in _FAMILIES for label in labels)})


def _samples(value: Mapping | float) -> Iterator[tuple[tuple[str, ...], float]]:
    """(label values after `log`, value) pairs of a number, or of a mapping keyed by label values."""
    if not isinstance(value, Mapping):
        yield (), float(value)
        return
    for key, count in value.items():
        yield (key if isinstance(key, tuple) else (key,)), count


def _metric_families(snapshots: list[GatewayLogSnapshot]) -> Iterator[Metric]:
    for name, family_type, attribute, labels, documentation in _FAMILIES:
        family = family_type(name, documentation, labels=["log", *labels])
        for snapshot in snapshots:
            for label_values, value in _samples(getattr(snapshot, attribute)):
                family.add_metric([snapshot.log, *label_values], value)
        yield family


class GatewayLogCollector(Collector):
    """The followers' latest snapshots as metrics: `REGISTRY.register(GatewayLogCollector(followers))`."""

    def __init__(self, followers: Iterable[GatewayLogFollower]):
        self._followers = tuple(followers)
        names = [follower.name for follower in self._followers]
        if len(set(names)) != len(names):
            raise ValueError(f"gateway log names must be unique, got {names}")

    def collect(self) -> Iterator[Metric]:
        # Fresh families from the latest snapshots: a scrape never sees a half-updated follower.
        yield from _metric_families([follower.latest for follower in self._followers])
