"""Count what a gateway's access log says, whatever delivered it: load per upstream, requests without a
session key, sessions spread over more than one upstream (apart from those a failover moved), and
returning requests served elsewhere than their session's previous one, in bounded memory.

Every source (collectors/gatewaylogs/sources/: a followed file, syslog, OTLP) hands its lines or decoded
records to one `SessionTally`, which parses them with the log's format and counts them; the source then
publishes `snapshot()` as the log's latest `GatewayLogSnapshot`. Session ids stay inside the tally: only
counts leave it, by listener and upstream names bounded per log by core/labels.py.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from operator import floordiv
from types import MappingProxyType

from kvwatch.collectors import gatewaylogs
from kvwatch.collectors.gatewaylogs.base import (
    MALFORMED_REASONS,
    NO_UPSTREAM,
    Malformed,
    Request,
    json_object,
)
from kvwatch.collectors.gatewaylogs.rounds import RoundTimes
from kvwatch.core.labels import BoundedLabel

# Why a poll could not read a followed file: a fixed list, so that a reason can be a label.
UNREADABLE_REASONS = ("not_found", "permission_denied", "is_directory", "not_regular_file", "read_error")
# Why a push source (syslog, OTLP) could not take what it received: a frame or datagram cut short, one
# that is not a message of its protocol, one over the size limit, datagrams the kernel dropped because the
# receive queue was full, messages of a sender over its rate, a request without the right credentials.
# Why a push source could not take what it received: one fixed list for every source, so that a reason
# can be a label (docs/gateway-logs.md says what each means).
REFUSED_REASONS = (
    "truncated",  # cut short: a syslog frame by its connection's end, an HTTP body before its Content-Length
    "malformed",  # no syslog message at all
    "oversize",  # a syslog message or an OTLP request over its bound
    "kernel_drops",  # UDP datagrams the kernel dropped with the receive queue full (Linux)
    "over_rate",  # a sender's lines or records over max_records_per_second
    "unauthenticated",  # an OTLP request without the bearer token of token_file
    "malformed_protobuf",  # bytes that are no OTLP ExportLogsServiceRequest (garbage, or cut short)
    "malformed_json",  # an OTLP/JSON body that is no ExportLogsServiceRequest
    "missing_field",  # an OTLP record without one of the format's fields, in attributes or body
    "busy",  # an OTLP/HTTP request beyond the receiver's bound of requests at once
)
# The OpenAI API's inference paths: the requests that belong to sessions. Others (GET /v1/models, health
# checks through the gateway) are counted apart, never as requests without a session key.
INFERENCE_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
)
# The gateway writes the log kvwatch reads on the same host or node, so on about the same clock: a minute
# covers a clock step and a late flush. A later time is no request's, and would keep its session active
# for as long as it is ahead; it is taken as the time the line was received.
MAX_FUTURE_SECONDS = 60.0

# The upstreams remembered per listener, to tell a replica that joined or left from one still serving: the
# least recently serving ones are forgotten beyond it (and then count as gone).
MAX_UPSTREAMS_PER_LISTENER = 1024

_LOG_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_BOOLS = ("false", "true")  # label values, indexed by a bool
_STATUS_CLASSES = tuple(f"{hundreds}xx" for hundreds in range(6))  # indexed by a status (100-599) // 100


# A batch's requests by field: time, listener, upstream, its label, failover, status, session id, assigned,
# first-byte seconds; each a tuple in the log's order.
_Columns = tuple[tuple, ...]
_ONLY_REQUESTS = {Request}


def frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


def by_reason(counts: Counter[str], reasons: tuple[str, ...]) -> Mapping[str, int]:
    return frozen({reason: counts[reason] for reason in reasons})


class _Session:
    """What the tally remembers of one session: when each upstream last served it, its two latest
    requests, when it last moved because of a failover, how many requests it had (its round), and its
    latest request as logged (its upstream, its number among its listener's requests, whether it failed
    over) with when it last moved for a cause."""

    __slots__ = (
        "upstreams",
        "last",
        "previous",
        "failed_over",
        "upstream",
        "number",
        "failover",
        "excused",
        "rounds",
    )

    def __init__(self, upstream: str, at: float, failover: bool, number: int) -> None:
        """A session that its first request opens: as `served` leaves a session that had none."""
        self.upstreams: dict[str, float] = {upstream: at}  # upstream -> when it last served the session
        self.last, self.previous, self.excused = at, -math.inf, -math.inf
        self.failed_over = at if failover else -math.inf
        self.upstream, self.number, self.failover = upstream, number, failover  # the latest request's
        self.rounds = 1

    def served(self, upstream: str, at: float, failover: bool, number: int) -> None:
        # Back on an upstream it had before its last failover: the failed server recovered, and this move
        # is part of that failover too.
        if failover or self.upstreams.get(upstream, math.inf) < self.failed_over:
            self.failed_over = at
        self.upstreams[upstream] = at
        self.rounds += 1
        if at >= self.last:
            self.previous, self.last = self.last, at
        else:  # a gateway logs a request when it ends: a long one can come after a later one
            self.previous = max(self.previous, at)
        self.upstream, self.number, self.failover = upstream, number, failover


class _Upstreams:
    """Which upstreams serve one listener, by the listener's own count of requests: a replica that joined
    or left the listener since a session's previous request explains the session's move."""

    __slots__ = ("served", "seen")

    def __init__(self) -> None:
        self.served = 0  # requests with an upstream on the listener
        self.seen: OrderedDict[str, list[int]] = OrderedDict()  # upstream -> [first, last] request number

    def serve(self, upstream: str) -> int:
        """Count a request served by `upstream`; its number among the listener's requests."""
        self.served += 1
        if (numbers := self.seen.get(upstream)) is None:
            self.seen[upstream] = [self.served, self.served]
            if len(self.seen) > MAX_UPSTREAMS_PER_LISTENER:
                self.seen.popitem(last=False)
        else:
            numbers[1] = self.served
            self.seen.move_to_end(upstream)
        return self.served

    def changed(self, previous: str, current: str, since: int) -> bool:
        """Whether the replicas changed since request number `since`: `current` served its first request
        after it (a replica joined: a scale-out remaps sessions), or `previous` served none of the
        listener's requests after it while they were more than twice its upstreams (it left: dead or
        scaled in; under any balancing a live one serves some of that many)."""
        joined = self.seen[current][0] > since
        left = self.seen.get(previous, (0, 0))[1] <= since and self.served - since > 2 * len(self.seen)
        return joined or left


@dataclass(frozen=True)
class SourceState:
    """What the source of a log says of its reading, beside the counts: a followed file's problems, a push
    source's refusals. A push source has no unreadable polls and leaves nothing unread."""

    problem: str | None = None  # a reason of UNREADABLE_REASONS, "not_polled" before the first poll, or None
    unreadable_polls: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(UNREADABLE_REASONS, 0))
    unread_bytes: int = 0
    unread_files: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GatewayLogSnapshot:
    """The statistics of one gateway log as of one poll; the mappings are read-only copies.

    Per-listener mappings have an entry (possibly 0) for every listener seen in the log.
    """

    log: str
    source: str  # the kind of source that delivers it: file, syslog, otlp
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
    refused: Mapping[str, int]  # reason -> what a push source could not take, every reason of REFUSED_REASONS
    last_record_at: float  # when the source last delivered a line or record (0: never)
    requests: Mapping[tuple[str, str], int]  # (listener, last upstream tried or NO_UPSTREAM) -> requests
    other_requests: Mapping[str, int]  # listener -> requests to other than the inference paths
    responses: Mapping[tuple[str, str], int]  # (listener, status class such as "2xx") -> requests
    failovers: Mapping[str, int]  # listener -> requests that tried more than one upstream or saw one fail
    without_session_key: Mapping[str, int]  # listener -> requests whose session id the gateway assigned
    assigned_session_ids: Mapping[str, int]  # listener -> distinct session ids the gateway assigned
    # (listener, failover) -> sessions on more than one upstream in the window; failover is "true" when
    # the session moved because an upstream failed, "false" when nothing explains the move.
    spread_sessions: Mapping[tuple[str, str], int]
    returning_sessions: Mapping[str, int]  # listener -> sessions with 2+ requests in the window
    # listener -> requests of a session seen before within the TTL, on an upstream (see SessionTally)
    returning_requests: Mapping[str, int]
    # (listener, failover) -> returning requests served by another upstream than their session's previous
    # request; failover is "true" when a failover or a change of the listener's upstreams explains it
    moved_requests: Mapping[tuple[str, str], int]
    active_sessions: Mapping[str, int]  # listener -> sessions seen within the TTL
    tracked_sessions: int
    evicted_sessions: int  # dropped to respect max_sessions while still within the window or TTL
    future_times: int  # requests more than MAX_FUTURE_SECONDS ahead of the clock, taken as received
    folded_labels: Mapping[tuple[str, str], int]  # (label, reason) -> requests shown as labels.OTHER
    # (listener, round label) -> (cumulative (le, count) buckets, sum): the upstream's time to first byte
    # of the successful requests with a client session key, by their round in the session (rounds.py)
    first_byte_seconds: Mapping[tuple[str, str], tuple[tuple[tuple[str, float], ...], float]] = field(
        default_factory=dict
    )
    # (listener, round label) -> the median first-byte time of its latest rounds.RECENT requests
    first_byte_median_seconds: Mapping[tuple[str, str], float] = field(default_factory=dict)

    @property
    def readable(self) -> bool:
        return self.problem is None

    @property
    def info(self) -> Mapping[tuple[str, str], int]:
        return {(_BOOLS[self.expect_sticky], self.source): 1}


class SessionTally:
    """The counts of one gateway log, fed by its source from any thread.

    `take_line` and `take_record` (`take_lines`, `take_records`: a batch) parse with the log's format
    (`log_format`, one of gatewaylogs.LOG_FORMATS) and count; `refuse` counts what the source could not read,
    by a reason of REFUSED_REASONS. A returning request is one on an upstream whose session's previous request
    (in the log's order) came within the session TTL; it moved when another upstream served it. A move is
    explained (a failover) when this request failed over, when the previous one did (its upstream failed),
    when it goes back to an upstream the session left in an explained move, or when the listener's upstreams
    changed since the previous request (`_Upstreams.changed`: one joined or left). A lock makes every call
    atomic, so that a receiver thread and the poll that publishes `snapshot()` never see half a request. Event
    times come from the log (nginx's `msec`); `clock` gives "now" for the window and the TTL.
    """

    def __init__(
        self,
        name: str,
        *,
        source: str = "file",
        spread_window_seconds: float = 600.0,
        session_ttl_seconds: float = 1800.0,
        max_sessions: int = 100_000,
        expect_sticky: bool = True,
        log_format: str = "nginx",
        inference_paths: tuple[str, ...] = INFERENCE_PATHS,
        clock: Callable[[], float] = time.time,
        session_keys: tuple[str, ...] = (),
    ):
        if not _LOG_NAME.fullmatch(name):
            raise ValueError(f"gateway log name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        self.name = name
        self.source = source
        # With session keys (collectors.sessionkeys), a line's session id is the first of their headers
        # it carries; their fields are resolved here, once.
        keyed = gatewaylogs.session_fields(session_keys)
        self._format = gatewaylogs.LOG_FORMATS.lookup(log_format).keyed(keyed)
        self.spread_window_seconds = spread_window_seconds
        self.session_ttl_seconds = session_ttl_seconds
        self.max_sessions = max_sessions
        self.expect_sticky = expect_sticky
        self._inference_paths = frozenset(inference_paths)
        self._counted_paths = self._inference_paths | {None}  # a request without a path is counted
        self.clock = clock
        self._lock = threading.Lock()
        self._lines = 0
        self._malformed: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()
        self._last_record_at = 0.0
        # (listener, upstream label, status // 100, failover, assigned) -> requests: one count a request,
        # split by a snapshot into requests, responses, failovers and requests without a session key.
        self._kinds: Counter[tuple[str, str, int, bool, bool]] = Counter()
        self._other_requests: Counter[str] = Counter()
        self._assigned_ids: Counter[str] = Counter()
        self._returning: Counter[str] = Counter()
        self._moved: Counter[tuple[str, str]] = Counter()
        self._upstreams: dict[str, _Upstreams] = {}  # listener -> its upstreams
        self._labels = {"listener": BoundedLabel(), "upstream": BoundedLabel(always=(NO_UPSTREAM,))}
        self._listener_label, self._upstream_label = self._labels["listener"], self._labels["upstream"]
        # (listener, session id) -> its history, least recently seen first.
        self._sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()
        self._evicted = 0
        self._future_times = 0
        self._round_times = RoundTimes()

    def take_line(self, line: bytes, received_at: float) -> None:
        """One access-log line as the gateway wrote it (a JSON object)."""
        self.take_lines((line,), received_at)

    def take_lines(self, lines: Iterable[bytes], received_at: float) -> None:
        """Lines received together (a burst of datagrams, a TCP read): each parsed as `take_line` does,
        then all counted under one hold of the lock."""
        self._count_all([self._parsed_line(line) for line in lines], received_at)

    def take_record(self, record: Mapping[str, object], received_at: float) -> None:
        """One decoded access-log record (a JSON object's fields), checked by the log's format."""
        self.take_records((record,), received_at)

    def take_records(self, records: Iterable[Mapping[str, object]], received_at: float) -> None:
        """Records received together (an OTLP request's), each checked as `take_record` does, then all
        counted under one hold of the lock."""
        self._count_all([self._parsed_record(record) for record in records], received_at)

    def _parsed_line(self, line: bytes) -> Request | str:
        """The request a line stands for, or the reason (of MALFORMED_REASONS) it stands for none."""
        try:
            return self._format.parse(json_object(line))
        except Malformed as malformed:
            return malformed.reason
        except OverflowError:  # an integer past a float's range where the format needs a float
            return "bad_value"

    def _parsed_record(self, record: Mapping[str, object]) -> Request | str:
        try:
            return self._format.parse(record)
        except Malformed as malformed:
            return malformed.reason
        except OverflowError:
            return "bad_value"

    def _count_all(self, parsed: list[Request | str], received_at: float) -> None:
        if not parsed:
            return
        with self._lock:
            self._lines += len(parsed)
            self._last_record_at = max(self._last_record_at, received_at)
            columns = self._as_they_are(parsed, received_at)
            if columns is None:
                columns = self._prepared(parsed, received_at)
            if columns:
                self._count(*columns)

    def _as_they_are(self, parsed: list[Request | str], received_at: float) -> _Columns | None:
        """The batch's requests by field, when each counts as it is: no malformed line, every path an
        inference path, no time ahead of the clock, every listener and upstream a label already shown.
        Then `_prepared` would change none of them: checked by C builtins, once for the batch."""
        if set(map(type, parsed)) != _ONLY_REQUESTS:
            return None
        at, listeners, upstreams, failovers, statuses, session_ids, assigned, paths, first_bytes = zip(
            *parsed, strict=True
        )
        if not (
            self._counted_paths.issuperset(paths)
            and max(at) <= received_at + MAX_FUTURE_SECONDS
            and self._listener_label.shows(listeners)
            and self._upstream_label.shows(upstreams)
        ):
            return None
        return at, listeners, upstreams, upstreams, failovers, statuses, session_ids, assigned, first_bytes

    def _prepared(self, parsed: list[Request | str], received_at: float) -> _Columns | None:
        """The batch's requests by field, one by one: malformed lines and requests to other paths counted
        apart, listeners and upstreams as their labels show them, a time ahead of the clock as
        `received_at`. None when no request is left to count."""
        kept = []
        for request in parsed:
            if request.__class__ is str:
                self._malformed[request] += 1
                continue
            at, listener, upstream, failover, status, session_id, assigned, path, first_byte = request
            listener = self._listener_label(listener)
            if path is not None and path not in self._inference_paths:
                self._other_requests[listener] += 1
                continue
            if at > received_at + MAX_FUTURE_SECONDS:
                self._future_times += 1
                at = received_at
            label = self._upstream_label(upstream)
            kept.append((at, listener, upstream, label, failover, status, session_id, assigned, first_byte))
        return tuple(zip(*kept, strict=True)) or None

    def _count(
        self,
        times,
        listeners,
        upstreams,
        upstream_labels,
        failovers,
        statuses,
        session_ids,
        assigned,
        first_bytes,
    ) -> None:
        """Count requests given by field (`_Columns`), in the log's order: their kinds in one call, then
        each in its session."""
        self._kinds.update(
            zip(
                listeners,
                upstream_labels,
                map(floordiv, statuses, repeat(100)),
                failovers,
                assigned,
                strict=True,
            )
        )
        sessions, ttl = self._sessions, self.session_ttl_seconds
        for listener, session_id, at, upstream, failover, status, assigned_, first_byte in zip(
            listeners, session_ids, times, upstreams, failovers, statuses, assigned, first_bytes, strict=True
        ):
            key = (listener, session_id)
            session = sessions.get(key)
            if session is None and assigned_:
                self._assigned_ids[listener] += 1
            if upstream == NO_UPSTREAM:
                continue
            upstreams = self._upstreams.get(listener)
            if upstreams is None:
                upstreams = self._upstreams[listener] = _Upstreams()
            number = upstreams.serve(upstream)
            # Sessions keep the upstream itself: a move between two upstreams shown as "other" is a move too.
            if session is None:
                session = sessions[key] = _Session(upstream, at, failover, number)
                if len(sessions) > self.max_sessions:
                    sessions.popitem(last=False)
                    self._evicted += 1
            else:
                sessions.move_to_end(key)
                if at - session.last <= ttl:
                    self._count_return(listener, session, upstream, failover, at)
                session.served(upstream, at, failover, number)
            # Timed by its round: a request without a client session key has no round (the id is the
            # gateway's), a failed one no answer to time.
            if first_byte is not None and not assigned_ and 200 <= status < 300:
                self._round_times.observe(listener, session.rounds, first_byte)

    @property
    def received(self) -> int:
        """Lines and records taken (malformed ones too) and those refused: what the source has handed over,
        for whoever waits for it to catch up, without a snapshot's cost."""
        with self._lock:
            return self._lines + self._refused.total()

    def line_too_long(self, received_at: float) -> None:
        """A line over the source's length limit, skipped unread."""
        with self._lock:
            self._count_malformed("too_long", received_at)

    def refuse(self, reason: str, count: int = 1) -> None:
        """What a push source received and could not take, by a reason of REFUSED_REASONS."""
        if reason not in REFUSED_REASONS:
            raise ValueError(f"refused for {reason!r}, none of {', '.join(REFUSED_REASONS)}")
        with self._lock:
            self._refused[reason] += count

    def _count_malformed(self, reason: str, received_at: float) -> None:
        self._lines += 1
        self._last_record_at = max(self._last_record_at, received_at)
        self._malformed[reason] += 1

    def _count_return(
        self, listener: str, session: _Session, upstream: str, failover: bool, at: float
    ) -> None:
        """A returning request to `upstream` at `at`, and whether it moved, explained or not (see the
        class)."""
        self._returning[listener] += 1
        if upstream == session.upstream:
            return
        explained = (
            failover
            or session.failover
            or session.upstreams.get(upstream, math.inf) < session.excused
            or self._upstreams[listener].changed(session.upstream, upstream, session.number)
        )
        if explained:
            session.excused = at
        self._moved[listener, _BOOLS[explained]] += 1

    def _forget_sessions_idle_since(self, horizon: float) -> None:
        """Sessions idle longer than both the window and the TTL count for nothing; they are the oldest."""
        while self._sessions:
            if next(iter(self._sessions.values())).last >= horizon:
                return
            self._sessions.popitem(last=False)

    def _split_kinds(self) -> tuple[Counter, Counter, Counter, Counter]:
        """Requests by (listener, upstream), responses by (listener, status class), failovers and requests
        without a session key by listener, each in the order first counted."""
        requests: Counter[tuple[str, str]] = Counter()
        responses: Counter[tuple[str, str]] = Counter()
        failovers: Counter[str] = Counter()
        without_key: Counter[str] = Counter()
        for (listener, upstream, hundreds, failover, assigned), count in self._kinds.items():
            requests[listener, upstream] += count
            responses[listener, _STATUS_CLASSES[hundreds]] += count
            failovers[listener] += count if failover else 0
            without_key[listener] += count if assigned else 0
        return requests, responses, failovers, without_key

    def snapshot(self, state: SourceState) -> GatewayLogSnapshot:
        """The counts as of now, with what the source says of its reading."""
        with self._lock:
            return self._snapshot(state)

    def _snapshot(self, state: SourceState) -> GatewayLogSnapshot:
        now = self.clock()
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
        requests, responses, failovers, without_key = self._split_kinds()
        listeners = sorted({listener for listener, _ in requests} | set(self._other_requests))

        def per_listener(counts: Counter[str]) -> Mapping[str, int]:
            return frozen({listener: counts[listener] for listener in listeners})

        return GatewayLogSnapshot(
            log=self.name,
            source=self.source,
            expect_sticky=self.expect_sticky,
            taken_at=now,
            problem=state.problem,
            unreadable_polls=frozen(state.unreadable_polls),
            unread_bytes=state.unread_bytes,
            unread_files=frozen(state.unread_files),
            lines=self._lines,
            malformed=by_reason(self._malformed, MALFORMED_REASONS),
            refused=by_reason(self._refused, REFUSED_REASONS),
            last_record_at=self._last_record_at,
            requests=frozen(requests),
            other_requests=per_listener(self._other_requests),
            responses=frozen(responses),
            failovers=per_listener(failovers),
            without_session_key=per_listener(without_key),
            assigned_session_ids=per_listener(self._assigned_ids),
            spread_sessions=frozen(
                {(name, moved): spread[name, moved] for name in listeners for moved in _BOOLS}
            ),
            returning_sessions=per_listener(returning),
            returning_requests=per_listener(self._returning),
            moved_requests=frozen(
                {(name, moved): self._moved[name, moved] for name in listeners for moved in _BOOLS}
            ),
            active_sessions=per_listener(active),
            tracked_sessions=len(self._sessions),
            evicted_sessions=self._evicted,
            future_times=self._future_times,
            folded_labels=frozen(
                {
                    (label, reason): n
                    for label, bound in self._labels.items()
                    for reason, n in bound.folded.items()
                }
            ),
            first_byte_seconds=frozen(self._round_times.histograms()),
            first_byte_median_seconds=frozen(self._round_times.medians()),
        )
