"""The history: probe sessions, their rounds, and the alerts kvwatch's webhook received.

Prometheus keeps the aggregates; the per-session, per-round detail the dashboard drills into lives
here, in an SQLite file (one writing process) or a PostgreSQL database (every shard writes it), with the
same schema and the same versioned migrations (store.schema). `kvwatch serve` writes through one
StoreWriter thread, so that a locked or full store never holds up its event loop; others read at the
same time (the dashboard, with `readonly=True`).

A session is written as each of its rounds finishes, marked in flight until it ends, so that a killed
writer loses no finished round: a session still in flight when its writer is gone was cut short by the
writer's death, and reads as interrupted; the next writer marks it so in the store.
Nothing here accepts an API key: the records carry none, and alerts carry only labels and annotations.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.collectors.probe.lifecycle import life_of
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.core.errors import KVWatchError
from kvwatch.store.base import BUSY_TIMEOUT_SECONDS, Database, StoreError, first_line
from kvwatch.store.databases import open_database, transient
from kvwatch.store.schema import LIFE_COLUMNS, MIGRATIONS, SCHEMA, SCHEMA_VERSION

log = logging.getLogger("kvwatch.store")

ALERT_STATUSES = ("firing", "resolved")
MAX_QUOTED_CHARS = 64  # of a rejected value in its message: a warning line stays a line


@dataclass(frozen=True)
class AlertsAdded:
    """What a webhook notification added: `stored` new alerts, and why each malformed one was skipped."""

    stored: int
    rejected: tuple[str, ...] = ()  # e.g. "alerts[1].status: must be firing or resolved, got 'pending'"


# Fields and properties of SessionResult / RoundResult, stored under their own names.
_SESSION_COLUMNS = (
    "target",
    "route_mode",
    "session_id",
    "started_at",
    "finished_at",
    "ok",
    "error_kind",
    "sticky",
    "backend_switches",
    "session_id_echoed",
    "interrupted",
    # What `sticky` was judged by (records.EVIDENCE), and the warm rounds' reuse behind a judgment by reuse.
    "evidence",
    "warm_rounds",
    "warm_rounds_reused",
    "warm_cached_tokens",
    "warm_ideal_cached_tokens",
)
_LIFE_COLUMNS = tuple(column for column, _ in LIFE_COLUMNS)
_ROUND_COLUMNS = tuple(f.name for f in fields(RoundResult))
_ROUND_TABLE_COLUMNS = ("session", *_ROUND_COLUMNS)
ROUND_FIELDS = ("session", "target", "route_mode", *_ROUND_COLUMNS)  # what Store.rounds() can read
_ALERT_COLUMNS = (
    "received_at",
    "status",
    "alertname",
    "severity",
    "target",
    "instance",
    "labels",
    "annotations",
    "starts_at",
    "ends_at",
    "fingerprint",
)
_BOOLEANS = ("ok", "sticky", "session_id_echoed", "interrupted", "in_flight", "closed", "close_gone")
_BOOLEANS += ("idle_cold", "idle_new_replica", "idle_repinned", "idle_as_expected")


class Store:
    """The history in one database (collectors.stores): an SQLite file, or a PostgreSQL database that
    several writers share; thread-safe, with any number of readers."""

    def __init__(
        self,
        location: str | Path,
        retention_days: float = 14.0,
        *,
        readonly: bool = False,
        password: str | None = None,  # of a PostgreSQL user, only to connect; kept nowhere else
    ):
        self.retention_days = retention_days
        self._lock = threading.Lock()
        self._db = open_database(location, readonly, password)
        self.location = self._db.location
        try:
            self._check_schema(readonly)
        except BaseException as error:
            self._db.close()
            if isinstance(error, self._db.errors):
                raise StoreError(f"cannot open the kvwatch store {self.location}: {error}") from None
            raise

    def _check_schema(self, readonly: bool) -> None:
        db = self._db
        with self._transaction(write=not readonly):
            version = db.schema_version()
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.location} has schema {version}, from a newer kvwatch; "
                    f"this one reads {SCHEMA_VERSION}"
                )
            if version == 0 and readonly:
                raise StoreError(f"{self.location} is not a kvwatch store")
            if version < SCHEMA_VERSION and readonly:
                raise StoreError(
                    f"{self.location} has schema {version}, from an older kvwatch: "
                    "`kvwatch serve` upgrades it"
                )
            if version < SCHEMA_VERSION:
                steps = range(version + 1, SCHEMA_VERSION + 1)
                for statement in SCHEMA if version == 0 else [s for n in steps for s in MIGRATIONS[n]]:
                    db.execute(statement.format(serial=db.serial, without_rowid=db.without_rowid))
                db.set_schema_version(SCHEMA_VERSION)
            if not readonly and (cut := db.cut_short()):
                log.warning(
                    "%d sessions were in flight when their writer of %s died: stored as interrupted",
                    cut,
                    self.location,
                )

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[Database]:
        """One transaction under the lock."""
        with self._lock, self._db.transaction(write):
            yield self._db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- probe sessions ----------------------------------------------------------------------------

    def add_session(self, result: SessionResult, uid: str | None = None, in_flight: bool = False) -> int:
        """Store one probe session and its rounds; returns the session's id in the store.

        A session written as its rounds finish passes the same `uid` each time, `in_flight` until its
        last write: each write replaces the one before (rounds only ever grow, and the last write may
        realign their ideal cached tokens to the block size learned at the end of the run).
        """
        columns = (*_SESSION_COLUMNS, *_LIFE_COLUMNS, "uid", "in_flight", "writer")
        with self._transaction(write=True) as db:
            life = life_columns(result) | {"session_losses": json.dumps(result.session_losses)}
            values = [*(getattr(result, c) for c in _SESSION_COLUMNS), *life.values()]
            values += [uid, in_flight, db.writer]
            session = db.execute(
                f"{_insert('sessions', columns)} {_replacing('uid', columns)} RETURNING id", _stored(values)
            ).fetchone()["id"]
            db.executemany(
                f"{_insert('rounds', _ROUND_TABLE_COLUMNS)} {_replacing('session, round', _ROUND_COLUMNS)}",
                [_stored((session, *(getattr(r, c) for c in _ROUND_COLUMNS))) for r in result.rounds],
            )
        return session

    def sessions(
        self, target: str | None = None, since: float | None = None, limit: int | None = None
    ) -> list[dict]:
        """Sessions, newest first: one dict per session, the columns of the sessions table.

        `since` (unix seconds) keeps sessions that started then or later; `ok`, `sticky`,
        `session_id_echoed`, `interrupted` and `in_flight` are booleans (None when unknown). A session
        still `in_flight` when its writer is gone reads as interrupted. `evidence` says what `sticky` was
        judged by (replica, reuse or none); `warm_rounds` counts the warm rounds reuse judges,
        `warm_rounds_reused` those that reused at least half their ideal, `warm_cached_tokens` and
        `warm_ideal_cached_tokens` are their sums (None without warm rounds). Its life
        (collectors.probe.lifecycle): `closed` and `close_gone` (booleans), `session_losses` (a list of
        (round, kind)), and after an idle `idle_after_round`, `idle_seconds`, `idle_expiry` and the booleans
        `idle_cold`, `idle_new_replica`, `idle_repinned`, `idle_as_expected`; None where unknown (the
        sessions stored before schema 8 say none of it).
        """
        where, params = _where({"target = ?": target, "started_at >= ?": since})
        sql = f"SELECT * FROM sessions {where} ORDER BY started_at DESC, id DESC"
        if limit is not None:
            sql, params = f"{sql} LIMIT ?", [*params, limit]
        with self._transaction(write=False) as db:
            gone = db.writer_gone()
            return [_session_row(row, gone) for row in db.execute(sql, params)]

    def rounds(
        self,
        target: str | None = None,
        since: float | None = None,
        session: int | None = None,
        columns: tuple[str, ...] = ROUND_FIELDS,
    ) -> list[dict]:
        """The rounds of the matching sessions, newest session first and each in round order.

        Each dict has `columns` of ROUND_FIELDS: by default the session's store id (`session`),
        `target` and `route_mode`, then the fields of RoundResult; fewer columns read a day faster.
        """
        where, params = _where({"s.target = ?": target, "s.started_at >= ?": since, "r.session = ?": session})
        selected = ", ".join(("s." if c in ("target", "route_mode") else "r.") + c for c in columns)
        sql = (
            f"SELECT {selected} FROM rounds r JOIN sessions s ON s.id = r.session "
            f"{where} ORDER BY s.started_at DESC, s.id DESC, r.round"
        )
        with self._transaction(write=False) as db:
            return [dict(row) for row in db.execute(sql, params)]

    def session(self, session: int) -> SessionResult | None:
        """The session with this store id, as the record that was stored; None when there is none."""
        with self._transaction(write=False) as db:
            gone = db.writer_gone()
            row = db.execute("SELECT * FROM sessions WHERE id = ?", (session,)).fetchone()
            if row is None:
                return None
            rounds = db.execute(
                f"SELECT {', '.join(_ROUND_COLUMNS)} FROM rounds WHERE session = ? ORDER BY round", (session,)
            ).fetchall()
        return SessionResult(
            target=row["target"],
            route_mode=row["route_mode"],
            session_id=row["session_id"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            rounds=tuple(RoundResult(**dict(r)) for r in rounds),
            interrupted=(stored := _session_row(row, gone))["interrupted"],
            closed=stored["closed"],
            session_losses=stored["session_losses"] or (),
            idle=None if row["idle_after_round"] is None else (row["idle_after_round"], row["idle_seconds"]),
            close_gone=stored["close_gone"],
        )

    # --- alerts ------------------------------------------------------------------------------------

    def add_alerts(self, payload: object, received_at: float | None = None) -> AlertsAdded:
        """Store the well-formed alerts of an Alertmanager webhook notification (version 4) and skip the
        malformed ones: Alertmanager does not resend a refused notification, so refusing it whole would
        lose its good alerts too.

        A payload that is not a notification at all raises ValueError naming what is wrong.
        """
        received_at = time.time() if received_at is None else received_at
        rows, rejected = [], []
        for i, alert in enumerate(_alerts_of(payload)):
            try:
                rows.append((received_at, *_alert_row(alert, f"alerts[{i}]")))
            except ValueError as error:
                rejected.append(str(error))
        with self._transaction(write=True) as db:
            stored = db.executemany(f"{_insert('alerts', _ALERT_COLUMNS)} ON CONFLICT DO NOTHING", rows)
            return AlertsAdded(stored, tuple(rejected))

    def alerts(self, since: float | None = None, status: str | None = None) -> list[dict]:
        """Received alerts, newest first; `labels` and `annotations` are dicts, times unix seconds."""
        where, params = _where({"received_at >= ?": since, "status = ?": status})
        with self._transaction(write=False) as db:
            rows = db.execute(f"SELECT * FROM alerts {where} ORDER BY received_at DESC, id DESC", params)
            return [
                {**row, "labels": json.loads(row["labels"]), "annotations": json.loads(row["annotations"])}
                for row in map(dict, rows)
            ]

    # --- retention ---------------------------------------------------------------------------------

    def prune(self, now: float | None = None) -> int:
        """Forget sessions that started, and alerts received, over retention_days ago; returns how many."""
        cutoff = (time.time() if now is None else now) - self.retention_days * 86400
        with self._transaction(write=True) as db:
            sessions = db.execute("DELETE FROM sessions WHERE started_at < ?", (cutoff,)).rowcount
            alerts = db.execute("DELETE FROM alerts WHERE received_at < ?", (cutoff,)).rowcount
        return sessions + alerts


# --- the writer thread -------------------------------------------------------------------------------

# The defaults of the config's store.queue_capacity, retry_seconds and flush_seconds.
QUEUE_CAPACITY = 1000  # writes waiting: a write per round and one at a session's end, an hour of a target
RETRY_SECONDS = 120.0  # how long one write is retried: past the longest lock or disk clean-up worth it
FLUSH_SECONDS = 10.0  # what a stop waits for the queued writes (Kubernetes gives 30 s in all)
FIRST_RETRY_DELAY_SECONDS = 0.1
MAX_RETRY_DELAY_SECONDS = 5.0
DROP_REASONS = ("queue_full", "failed")


class WriteDropped(KVWatchError):
    """A write the StoreWriter lost: its queue was full, or its retries ran out; logged and counted."""


class StoreWriter:
    """The one thread that writes to the store, fed by a bounded queue, so that a locked, slow, full or
    unreachable store never holds up `kvwatch serve`'s event loop (its /metrics answers, its probes' timing).

    A write that fails for a while (a lock, a full disk, an I/O error; a PostgreSQL server down,
    restarting or whose connection broke, connected to again by the next try) is retried with backoff for
    up to `retry_seconds`; one that would fail the same way every time (a constraint) is dropped at once.
    One warning says when writes start failing and why, one line when they succeed again. When `capacity`
    writes are waiting, the newest is dropped and the queued ones kept: they are older measurements the
    writer accepted already, and the newest's caller learns it at once (the webhook answers 503, so that
    Alertmanager sends the alerts again). Every drop is logged and counted in
    kvwatch_store_writes_dropped_total.
    """

    def __init__(
        self,
        capacity: int = QUEUE_CAPACITY,
        retry_seconds: float = RETRY_SECONDS,
        location: str = "the store",
    ) -> None:
        self.capacity = capacity
        self.retry_seconds = retry_seconds
        self.location = location  # of the store, as its log lines name it: a URL without its password
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._counts_lock = threading.Lock()
        self._dropped: Counter[str] = Counter()
        self._retries = 0
        self._failing_since: float | None = None  # monotonic: writes have failed since, none succeeded
        self._give_up_at = float("inf")  # monotonic; set by close()
        self._closing = threading.Event()  # wakes a retry's backoff at close
        self._thread = threading.Thread(target=self._run, name="kvwatch-store-writer", daemon=True)
        self._thread.start()

    def submit(self, write: Callable, *args) -> Future:
        """Queue `write(*args)`, a method of the store; the future holds what it returns, the ValueError
        of a payload it refuses, or WriteDropped."""
        future: Future = Future()
        if self._queue.qsize() >= self.capacity:
            self._drop(future, write, "queue_full", f"{self.capacity} writes are waiting already")
        else:
            self._queue.put((write, args, future))
        return future

    def close(self, timeout: float = FLUSH_SECONDS) -> None:
        """Write what is queued, retrying for `timeout` seconds at most; drop what is left then."""
        self._give_up_at = time.monotonic() + timeout
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout + BUSY_TIMEOUT_SECONDS)  # the write under way may be in its busy wait

    def collect(self) -> Iterator[Metric]:
        """The writer's health on /metrics."""
        with self._counts_lock:
            dropped, retries = dict(self._dropped), self._retries
        lost = CounterMetricFamily(
            "kvwatch_store_writes_dropped",
            "Store writes (sessions, alerts, pruning) lost: the write queue was full, or retries after a "
            "lock, a full disk or a lost database connection ran out.",
            labels=["reason"],
        )
        for reason in DROP_REASONS:
            lost.add_metric([reason], dropped.get(reason, 0))
        yield lost
        yield CounterMetricFamily(
            "kvwatch_store_write_retries",
            "Store writes tried again after a lock, a full disk or a lost database connection.",
            retries,
        )
        yield GaugeMetricFamily(
            "kvwatch_store_writes_queued", "Store writes waiting for the writer thread.", self._queue.qsize()
        )

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._write(*item)

    def _write(self, write: Callable, args: tuple, future: Future) -> None:
        delay, deadline = FIRST_RETRY_DELAY_SECONDS, time.monotonic() + self.retry_seconds
        while True:
            try:
                result = write(*args)
            except (ValueError, TypeError) as refused:  # a malformed webhook payload: its caller says so
                future.set_exception(refused)
                return
            except Exception as error:
                if not transient(error):
                    log.exception("store write %s failed", write.__name__)
                    self._drop(future, write, "failed", f"{type(error).__name__}: {first_line(error)}")
                    return
                self._failing(error)
                give_up_at = min(deadline, self._give_up_at)
                if time.monotonic() >= give_up_at:
                    self._drop(future, write, "failed", first_line(error))
                    return
                with self._counts_lock:
                    self._retries += 1
                self._back_off(min(delay, give_up_at - time.monotonic()))
                delay = min(2 * delay, MAX_RETRY_DELAY_SECONDS)
            else:
                self._succeeded()
                future.set_result(result)
                return

    def _failing(self, error: Exception) -> None:
        """Says once, as writes start failing, why; not at each try of each write while they fail."""
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning(
                "store writes to %s fail (%s): each is tried again for up to %g s",
                self.location,
                first_line(error),
                self.retry_seconds,
            )

    def _succeeded(self) -> None:
        if self._failing_since is not None:
            log.info(
                "store writes to %s succeed again, after %.1f s",
                self.location,
                time.monotonic() - self._failing_since,
            )
            self._failing_since = None

    def _back_off(self, seconds: float) -> None:
        """Waits before the next try; a close cuts the wait short once, to its own deadline."""
        seconds = max(0.0, seconds)
        if self._closing.is_set():  # give_up_at has the close's deadline in it now
            time.sleep(seconds)
        else:
            self._closing.wait(seconds)

    def _drop(self, future: Future, write: Callable, reason: str, why: str) -> None:
        with self._counts_lock:
            self._dropped[reason] += 1
        log.warning("store write %s dropped: %s", write.__name__, why)
        future.set_exception(WriteDropped(why))


def _insert(table: str, columns: tuple[str, ...]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def _replacing(key: str, columns: tuple[str, ...]) -> str:
    """An insert's clause that makes it replace the row of the same `key` (SQLite and PostgreSQL)."""
    return f"ON CONFLICT ({key}) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in columns)}"


def _stored(values) -> list:
    """Booleans as the 0 and 1 of the schema's INTEGER columns (PostgreSQL takes no bool there)."""
    return [int(value) if isinstance(value, bool) else value for value in values]


def life_columns(result: SessionResult) -> dict:
    """The session's LIFE_COLUMNS, as sessions() reads them back: its close, its losses, and its idle and
    what followed it (None where it did not idle, or ended before the round after)."""
    idle, life = result.idle or (None, None), life_of(result)
    followed = (None,) * 5
    if life is not None:
        followed = (life.expiry, life.cold, life.new_replica, life.repinned, life.as_expected)
    values = (result.closed, result.close_gone, result.session_losses, *idle, *followed)
    return dict(zip(_LIFE_COLUMNS, values, strict=True))


def _where(conditions: dict[str, object]) -> tuple[str, list]:
    """A WHERE clause of the conditions whose value is given, e.g. {"target = ?": "chat", ...}."""
    given = {condition: value for condition, value in conditions.items() if value is not None}
    return (f"WHERE {' AND '.join(given)}" if given else ""), list(given.values())


def _session_row(row, writer_gone: Callable[[int | None], bool]) -> dict:
    values = dict(row)
    writer = values.pop("writer")  # whose it is, not what it is
    for column in _BOOLEANS:
        if values[column] is not None:
            values[column] = bool(values[column])
    losses = values["session_losses"]
    values["session_losses"] = None if losses is None else tuple(map(tuple, json.loads(losses)))
    if values["in_flight"] and writer_gone(writer):
        values.update(in_flight=False, interrupted=True)
    return values


def _alerts_of(payload: object) -> list:
    if not isinstance(payload, dict):
        raise ValueError(f"the payload must be a JSON object, got {type(payload).__name__}")
    if payload.get("version") != "4":
        raise ValueError(
            f'version must be "4" (Alertmanager\'s webhook format), got {_quoted(payload.get("version"))}'
        )
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise ValueError("alerts: must be a list")
    return alerts


def _alert_row(alert: object, where: str) -> tuple:
    if not isinstance(alert, dict):
        raise ValueError(f"{where}: must be an object")
    status = alert.get("status")
    if status not in ALERT_STATUSES:
        raise ValueError(f"{where}.status: must be firing or resolved, got {_quoted(status)}")
    labels = _strings(alert.get("labels"), f"{where}.labels")
    annotations = _strings(alert.get("annotations", {}), f"{where}.annotations")
    if "alertname" not in labels:
        raise ValueError(f"{where}.labels: no alertname")
    fingerprint = alert.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"{where}.fingerprint: must be a non-empty string")
    return (
        status,
        labels["alertname"],
        labels.get("severity"),
        labels.get("target"),
        labels.get("instance"),
        json.dumps(labels, sort_keys=True),
        json.dumps(annotations, sort_keys=True),
        _time(alert.get("startsAt"), f"{where}.startsAt"),
        _time(alert.get("endsAt"), f"{where}.endsAt", optional=True),
        fingerprint,
    )


def _strings(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{where}: must be an object of strings")
    return value


def _time(value: object, where: str, optional: bool = False) -> float | None:
    """An RFC 3339 time as unix seconds; Go's zero time (year 1) means unset, as for a firing alert's end."""
    if optional and value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: must be an RFC 3339 time, got {_quoted(value)}") from None
    if parsed.tzinfo is None:
        raise ValueError(f"{where}: must be an RFC 3339 time with a zone, got {_quoted(value)}")
    if parsed.year == 1:
        if not optional:
            raise ValueError(f"{where}: must be set, got the zero time {_quoted(value)}")
        return None
    return parsed.timestamp()


def _quoted(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= MAX_QUOTED_CHARS else shown[: MAX_QUOTED_CHARS - 3] + "..."
