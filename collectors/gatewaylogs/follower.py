"""Follow a gateway's JSON access log: load per upstream, requests without a session key, and sessions
spread over more than one upstream (apart from those a failover moved), in bounded memory.

A scheduler job calls `GatewayLogFollower.poll()`; it reads what the gateway appended since the last call
and publishes an immutable `GatewayLogSnapshot`. What a line means is up to the log's format
(collectors/gatewaylogs/: nginx, Envoy); reading the file and counting are the same for all.
`GatewayLogCollector` turns the latest snapshots into `kvwatch_gateway_*` metrics on every scrape.
Session ids stay inside the follower: only counts leave it, by listener and upstream names bounded per
log by core/labels.py.
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
from kvwatch.collectors.gatewaylogs.creations import Creations
from kvwatch.core.errors import KVWatchError
from kvwatch.core.labels import BoundedLabel

log = logging.getLogger("kvwatch.gatewaylog")

# Why a poll could not read a log: a fixed list, so that a reason can be a label.
UNREADABLE_REASONS = ("not_found", "permission_denied", "is_directory", "not_regular_file", "read_error")
# A gateway's request line limit (nginx: 8 KiB by default) keeps real lines far shorter; a longer one is
# garbage and must not grow memory.
MAX_LINE_BYTES = 64 * 1024
# About 0.7 s of parsing (docs/benchmarks.md), so that a huge or endless log keeps neither
# the other logs nor a shutdown waiting; at one poll per 5 s it still follows ~3 MB/s per log.
MAX_BYTES_PER_POLL = 16 * 1024 * 1024
# A file truncated in place (copytruncate) and written past the offset read up to by the next poll is
# told only by its first bytes, which an appended file keeps: a line or more of them.
HEAD_BYTES = 4096
# The gateway writes the log kvwatch reads on the same host or node, so on about the same clock: a minute
# covers a clock step and a late flush. A later time is no request's, and would keep its session active
# for as long as it is ahead; it is taken as the time of the poll that read it.
MAX_FUTURE_SECONDS = 60.0

_LOG_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_BOOLS = ("false", "true")  # label values, indexed by a bool


class _NotARegularFile(KVWatchError, OSError):
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


class _HeldFile:
    """A file of the log that the follower holds open: the one at the path, and renamed ones that the
    gateway may still write. Each keeps its own unfinished line, so that two files' lines are never joined."""

    __slots__ = ("file", "identity", "head", "pending", "skipping_long_line", "superseded")

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        status = os.fstat(file.fileno())
        self.identity = (status.st_dev, status.st_ino)
        self.head = b""  # the file's first bytes read, up to HEAD_BYTES: changed, it was truncated
        self.pending = b""  # the start of a line the gateway has not finished writing yet
        self.skipping_long_line = False
        self.superseded = False  # whether a newer file was held at the end of the last poll


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
    # reason -> files of the log never read: "rotated_unopened", rotated away before a poll opened them;
    # empty where they cannot be counted (no inotify: not Linux, or the log's directory never existed)
    unread_files: Mapping[str, int]
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
    future_times: int  # requests more than MAX_FUTURE_SECONDS ahead of the clock, taken as of their poll
    folded_labels: Mapping[tuple[str, str], int]  # (label, reason) -> requests shown as labels.OTHER

    @property
    def readable(self) -> bool:
        return self.problem is None

    @property
    def info(self) -> Mapping[str, int]:
        return {_BOOLS[self.expect_sticky]: 1}


class GatewayLogFollower:
    """Reads a gateway's JSON access log incrementally and keeps its statistics in bounded memory.

    Owns no thread: one scheduler job at a time calls `poll()`; any thread may read `latest`, an
    immutable snapshot that each poll swaps in whole. The file is followed as `tail -F` does: a new file
    at the path is opened by the poll that sees it and read from its start, and a renamed one is held
    open and read to its end for as long as the gateway may still write it (until a whole poll interval
    after the new file appeared brought nothing new), even once it is renamed over or deleted. A file
    created and rotated away between two polls is never seen: `Creations` counts it. A truncated file
    is read again from its start, and a missing file is not an error. Anything but a regular file is
    refused, and a poll reads at most `max_bytes_per_poll` of a log, so one log never stalls the others.
    `log_format` names the format of gatewaylogs.LOG_FORMATS its lines are in. Event times come from the
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
        self._format = gatewaylogs.LOG_FORMATS.lookup(log_format)
        self.spread_window_seconds = spread_window_seconds
        self.session_ttl_seconds = session_ttl_seconds
        self.max_sessions = max_sessions
        self.expect_sticky = expect_sticky
        self.max_bytes_per_poll = max_bytes_per_poll
        self._clock = clock
        self._held: list[_HeldFile] = []  # oldest first; the last one is the file at the path
        self._creations = Creations(self.path)
        self._unopened = 0  # files created at the path that no poll opened (one too few, for a while)
        self._rotated_unopened = 0  # the most `_unopened` was: a count that never goes down
        self._budget = 0  # bytes this poll may still read
        self._unread_bytes = 0
        self._problem: str | None = "not_polled"
        self._unreadable_polls: Counter[str] = Counter()
        self._lines = 0
        self._malformed: Counter[str] = Counter()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._responses: Counter[tuple[str, str]] = Counter()
        self._failovers: Counter[str] = Counter()
        self._without_key: Counter[str] = Counter()
        self._assigned_ids: Counter[str] = Counter()
        self._labels = {"listener": BoundedLabel(), "upstream": BoundedLabel(always=(NO_UPSTREAM,))}
        # (listener, session id) -> its history, least recently seen first.
        self._sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()
        self._evicted = 0
        self._future_times = 0
        self._polled_at = -math.inf  # the clock's time when the current poll started
        self.latest = self._snapshot()

    def poll(self) -> GatewayLogSnapshot:
        """Read what was appended since the last poll and publish a new snapshot as `latest`."""
        self._polled_at = self._clock()
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
        for held in self._held:
            held.file.close()
        self._held = []
        self._creations.close()

    def __enter__(self) -> GatewayLogFollower:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- reading ----------------------------------------------------------------------------------

    def _follow(self) -> None:
        self._budget, self._unread_bytes = self.max_bytes_per_poll, 0
        try:
            self._count_created_files()  # before the path is opened: a file created since is counted later
            self._hold_new_file()
        finally:  # a path that cannot be opened (now) keeps no held file from being read
            self._read_held_files()

    def _count_created_files(self) -> None:
        """Files created at the path that no poll opened were rotated away unread: count them. A file
        created between this count and the open below is opened before it is counted, so the count lags
        by at most one file until the next poll, and never counts a file that was read."""
        created = self._creations.take()
        if created is None:
            return
        if self._creations.started:  # the file already there is opened like a new one, and counted so
            self._unopened = self._rotated_unopened + self._new_file_at_path()
        self._unopened += created

    def _new_file_at_path(self) -> bool:
        """Whether the path names a file none of the held ones is: the log was rotated."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:  # while it names none, the gateway may still write the renamed file
            return False
        return (current.st_dev, current.st_ino) not in {held.identity for held in self._held}

    def _hold_new_file(self) -> None:
        """Open the file at the path as soon as a poll sees it, so that it stays readable (and is read to
        its end) whatever happens to the path before the next poll."""
        if not self._held or self._new_file_at_path():  # nothing held: a missing file is not_found
            self._held.append(_HeldFile(_open_regular_file(self.path)))
            self._unopened -= 1
        self._rotated_unopened = max(self._rotated_unopened, self._unopened)

    def _read_held_files(self) -> None:
        """Read the held files, oldest first. The gateway writes a renamed file until it reopens its log,
        which can be after the new file appeared (logrotate's `create`): a renamed one is let go once a
        whole poll brought nothing new to it."""
        still_held = []
        for held in self._held:
            quiet = self._read(held)
            if quiet and held.superseded:
                self._take_partial_line(held)
                held.file.close()
            else:
                held.superseded = held is not self._held[-1]
                still_held.append(held)
        self._held = still_held

    def _read(self, held: _HeldFile) -> bool:
        """Read to the end of the file or of this poll's byte budget; whether it had nothing new."""
        if self._truncated(held):
            self._take_partial_line(held)
            held.file.seek(0)
            held.head = b""
        start = held.file.tell()
        at_end = self._read_lines(held)
        fd = held.file.fileno()
        if len(held.head) < HEAD_BYTES:
            held.head = os.pread(fd, min(HEAD_BYTES, held.file.tell()), 0)
        self._unread_bytes += max(0, os.fstat(fd).st_size - held.file.tell())
        return at_end and held.file.tell() == start

    @staticmethod
    def _truncated(held: _HeldFile) -> bool:
        """Shorter than what was read, or (copytruncate, then written again) not the same first bytes."""
        fd = held.file.fileno()
        return os.fstat(fd).st_size < held.file.tell() or os.pread(fd, len(held.head), 0) != held.head

    def _read_lines(self, held: _HeldFile) -> bool:
        """Take the lines from where `held` was read up to; whether its end came before the budget's."""
        while self._budget > 0:
            chunk = held.file.readline(min(MAX_LINE_BYTES, self._budget))
            if not chunk:
                return True
            self._budget -= len(chunk)
            complete = chunk.endswith(b"\n")
            if held.skipping_long_line:
                held.skipping_long_line = not complete
                continue
            held.pending += chunk
            if complete:
                self._take(held.pending)
                held.pending = b""
            elif len(held.pending) >= MAX_LINE_BYTES:
                self._lines += 1
                self._malformed["too_long"] += 1
                held.pending = b""
                held.skipping_long_line = True
        return False

    def _take_partial_line(self, held: _HeldFile) -> None:
        """Its file was rotated or truncated, so the partial line will never be completed: take it as is."""
        if held.pending:
            self._take(held.pending)
        held.pending = b""
        held.skipping_long_line = False

    # --- statistics -------------------------------------------------------------------------------

    def _take(self, line: bytes) -> None:
        self._lines += 1
        try:
            request = self._format.parse(json_object(line))
        except Malformed as malformed:
            self._malformed[malformed.reason] += 1
            return
        if request.time > self._polled_at + MAX_FUTURE_SECONDS:
            self._future_times += 1
            request = request._replace(time=self._polled_at)
        listener, failover = self._labels["listener"](request.listener), request.failover
        # Sessions keep the upstream itself: a move between two upstreams shown as "other" is a move too.
        self._requests[listener, self._labels["upstream"](request.upstream)] += 1
        self._responses[listener, f"{request.status // 100}xx"] += 1
        if failover:
            self._failovers[listener] += 1
        key = (listener, request.session_id)
        session = self._sessions.get(key)
        if request.assigned:
            self._without_key[listener] += 1
            if session is None:
                self._assigned_ids[listener] += 1
        if request.upstream != NO_UPSTREAM:
            if session is None:
                session = self._sessions[key] = _Session()
            session.served(request.upstream, request.time, failover)
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
            unread_files=_frozen(
                {"rotated_unopened": self._rotated_unopened} if self._creations.watched else {}
            ),
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
            future_times=self._future_times,
            folded_labels=_frozen(
                {
                    (label, reason): n
                    for label, bound in self._labels.items()
                    for reason, n in bound.folded.items()
                }
            ),
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
    ("kvwatch_gateway_label_values_folded", CounterMetricFamily, "folded_labels", ("label", "reason"),
     'Requests whose listener or upstream was shown as "other": beyond 32 values per log, or too long.'),
    ("kvwatch_gateway_evicted_sessions", CounterMetricFamily, "evicted_sessions", (),
     "Sessions forgotten early to keep memory bounded; when rising, raise max_sessions."),
    ("kvwatch_gateway_future_timestamps", CounterMetricFamily, "future_times", (),
     "Requests logged more than 60 s ahead of kvwatch's clock, counted as of the poll that read them."),
    ("kvwatch_gateway_log_readable", GaugeMetricFamily, "readable", (),
     "Whether the last poll could read the access log (0: missing or unreadable)."),
    ("kvwatch_gateway_log_unreadable_polls", CounterMetricFamily, "unreadable_polls", ("reason",),
     "Polls that could not read the access log, by reason."),
    ("kvwatch_gateway_log_unread_bytes", GaugeMetricFamily, "unread_bytes", (),
     "Bytes of the access log left for later polls by the bound on bytes read per poll, as of the last "
     "poll; when rising, kvwatch falls behind the log."),
    ("kvwatch_gateway_log_unread_files", CounterMetricFamily, "unread_files", ("reason",),
     "Files of the access log that were never read, by reason: rotated_unopened, rotated away before a "
     "poll opened them (the log rotates more than once per poll). Linux only."),
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
