"""The history gives back exactly what was stored, survives restarts and is readable while written: each
test with a `location` runs against SQLite and against a real PostgreSQL server (tests/postgres.py)."""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import inspect
import logging
import os
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import psycopg
import pytest
from postgres import (  # noqa: F401 (the session's PostgreSQL server, and a test's own to stop)
    PASSWORD,
    USER,
    own_postgres_server,
    postgres_server,
)
from prometheus_client import CollectorRegistry

from conftest import free_port
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.store.history import SCHEMA_VERSION, AlertsAdded, Store, StoreError, StoreWriter, WriteDropped
from kvwatch.store.postgres import LOCK_SPACE
from kvwatch.store.schema import LIFE_COLUMNS

REPO = Path(__file__).resolve().parent.parent
DAY = 86400.0


def round_result(n: int, backend: str | None = "r1", **overrides) -> RoundResult:
    values = dict(
        round=n, started_at=1000.0 + n, status=200, error_kind=None, error_detail=None,
        ttft_seconds=0.412 if n == 1 else 0.031, total_seconds=0.9, prompt_tokens=1200 * n,
        cached_tokens=0 if n == 1 else 1184 * (n - 1), ideal_cached_tokens=0 if n == 1 else 1184 * (n - 1),
        completion_tokens=32, backend=backend, session_id_sent="5f0c-session",
        session_id_returned="5f0c-session",
    )  # fmt: skip
    values.update(overrides)
    return RoundResult(**values)


def session(
    target: str = "lab-affinity",
    started_at: float = 1000.0,
    *rounds: RoundResult,
    route_mode: str = "affinity",
) -> SessionResult:
    rounds = rounds or (round_result(1), round_result(2), round_result(3))
    return SessionResult(target, route_mode, "5f0c-session", started_at, started_at + 3.5, rounds)


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request, tmp_path: Path) -> Path | str:
    """A new store's location: a file that does not exist yet, or an empty PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "history" / "kvwatch.db"
    return request.getfixturevalue("postgres").new_database()


def open_store(location: Path | str, retention_days: float = 14.0, readonly: bool = False) -> Store:
    return Store(location, retention_days, readonly=readonly, password=PASSWORD)


def is_postgres(location: Path | str) -> bool:
    return str(location).startswith("postgresql://")


def write(location: Path | str, *statements: str) -> None:
    """Statements another client of the database commits, past the store."""
    if is_postgres(location):
        with psycopg.connect(str(location), password=PASSWORD) as db:
            for statement in statements:
                db.execute(statement)
        return
    db = sqlite3.connect(location)
    try:
        for statement in statements:
            db.execute(statement)
        db.commit()
    finally:
        db.close()


def query(location: Path | str, sql: str) -> list[tuple]:
    """What another client of the database reads (the sqlite3 module or psycopg), past the store."""
    if is_postgres(location):
        with psycopg.connect(str(location), password=PASSWORD) as db:
            return db.execute(sql).fetchall()
    db = sqlite3.connect(location)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


@pytest.fixture
def store(location):
    with open_store(location) as store:
        yield store


# What a session that neither idled nor closed a route session says of its life.
NO_LIFE = {column: None for column, _ in LIFE_COLUMNS} | {"session_losses": ()}
DROP_LIFE = tuple(f"ALTER TABLE sessions DROP COLUMN {column}" for column, _ in LIFE_COLUMNS)  # schema 8's


def test_session_round_trip_gives_back_the_record(store):
    failed = session(
        "lab-round-robin",
        2000.0,
        round_result(1, backend="r1"),
        round_result(2, backend="r2", session_id_returned=None),
        round_result(
            3,
            backend=None,
            status=401,
            error_kind="unauthorized",
            error_detail="401: missing Bearer",
            ttft_seconds=None,
            total_seconds=0.01,
            prompt_tokens=None,
            cached_tokens=None,
            completion_tokens=None,
            session_id_returned=None,
        ),
        route_mode="round_robin",
    )
    sticky = session()
    ids = [store.add_session(sticky), store.add_session(failed)]
    assert store.session(ids[0]) == sticky
    assert store.session(ids[1]) == failed
    assert store.session(999) is None

    rows = store.sessions()
    assert [row["id"] for row in rows] == ids[::-1]
    assert rows[1] == {
        "id": ids[0], "target": "lab-affinity", "route_mode": "affinity", "session_id": "5f0c-session",
        "started_at": 1000.0, "finished_at": 1003.5, "ok": True, "error_kind": None, "sticky": True,
        "backend_switches": 0, "session_id_echoed": True, "interrupted": False, "uid": None,
        "in_flight": False, "evidence": "replica", "warm_rounds": 2, "warm_rounds_reused": 2,
        "warm_cached_tokens": 1184 + 2368, "warm_ideal_cached_tokens": 1184 + 2368, **NO_LIFE,
    }  # fmt: skip
    assert rows[0] == {
        "id": ids[1], "target": "lab-round-robin", "route_mode": "round_robin", "session_id": "5f0c-session",
        "started_at": 2000.0, "finished_at": 2003.5, "ok": False, "error_kind": "unauthorized",
        "sticky": False, "backend_switches": 1, "session_id_echoed": False, "interrupted": False,
        "uid": None, "in_flight": False, "evidence": "replica", "warm_rounds": 1, "warm_rounds_reused": 1,
        "warm_cached_tokens": 1184, "warm_ideal_cached_tokens": 1184, **NO_LIFE,
    }  # fmt: skip


def test_an_interrupted_session_keeps_its_finished_rounds_and_says_so(store):
    cut = replace(session("t", 1000.0, round_result(1), round_result(2)), interrupted=True)
    assert store.session(store.add_session(cut)) == cut
    assert [row["interrupted"] for row in store.sessions()] == [True]


def test_a_session_written_round_by_round_is_in_flight_until_its_last_write(store):
    one, two = session("t", 1000.0, round_result(1)), session("t", 1000.0, round_result(1), round_result(2))
    first = store.add_session(one, "uid-1", in_flight=True)
    (row,) = store.sessions()
    assert (row["id"], row["in_flight"], row["interrupted"]) == (first, True, False)
    assert store.add_session(two, "uid-1", in_flight=True) == first
    aligned = replace(two, rounds=(round_result(1), round_result(2, ideal_cached_tokens=1168)))
    assert store.add_session(aligned, "uid-1") == first
    assert store.session(first) == aligned
    assert [(s["id"], s["in_flight"]) for s in store.sessions()] == [(first, False)]
    assert [r["ideal_cached_tokens"] for r in store.rounds()] == [0, 1168]


def test_a_session_left_in_flight_by_a_dead_writer_reads_as_interrupted(location):
    """While its writer lives a reader sees the session in flight; once it is gone (here: closed, as the
    kernel closes a killed process's files and connections), as interrupted; the next writer marks it so
    in the store."""
    left = session("t", 1000.0, round_result(1))
    writer = open_store(location)
    stored = writer.add_session(left, "uid-1", in_flight=True)
    with open_store(location, readonly=True) as reader:
        assert [(s["in_flight"], s["interrupted"]) for s in reader.sessions()] == [(True, False)]
        assert reader.session(stored) == left
        writer.close()
        assert [(s["in_flight"], s["interrupted"]) for s in reader.sessions()] == [(False, True)]
        assert reader.session(stored) == replace(left, interrupted=True)
    with open_store(location) as restarted:
        assert restarted.session(stored) == replace(left, interrupted=True)
    assert query(location, "SELECT in_flight, interrupted FROM sessions") == [(0, 1)]


def test_a_second_writer_of_an_sqlite_store_is_refused(tmp_path):
    path = tmp_path / "kvwatch.db"
    with Store(path), pytest.raises(StoreError, match="another process writes the kvwatch store .*db"):
        Store(path)
    Store(path).close()  # the first one is gone


def test_writers_share_a_postgresql_store_and_each_ones_sessions_live_with_it(postgres):
    """Every shard writes one history: a writer's death cuts short its own sessions in flight, not those
    of the writers still running, in what readers see and in what the next writer marks."""
    url = postgres.new_database()
    first, second = open_store(url), open_store(url)
    dying = first.add_session(session("a", 1000.0, round_result(1)), "uid-a", in_flight=True)
    living = second.add_session(session("b", 2000.0, round_result(1)), "uid-b", in_flight=True)
    first.close()
    with open_store(url, readonly=True) as reader:
        states = {s["id"]: (s["in_flight"], s["interrupted"]) for s in reader.sessions()}
    assert states == {dying: (False, True), living: (True, False)}
    with open_store(url) as third:
        assert third.sessions(target="b")[0]["in_flight"]
    assert sorted(query(url, "SELECT target, in_flight, interrupted FROM sessions")) == [
        ("a", 0, 1),
        ("b", 1, 0),
    ]
    second.close()


def test_unknown_stickiness_is_null_not_false(store):
    unknown = session("t", 1000.0, round_result(1, backend=None, cached_tokens=None, session_id_sent=None))
    store.add_session(unknown)
    (row,) = store.sessions()
    assert (row["sticky"], row["backend_switches"], row["session_id_echoed"]) == (None, None, None)
    assert (row["evidence"], row["warm_rounds"], row["warm_cached_tokens"]) == ("none", 0, None)


# Sessions through a route that names no replica (SageMaker), judged by their warm rounds' reuse: one
# whose warm rounds cached all a pinned replica would have, one whose third round cached under half.
BY_REUSE = (
    session("sagemaker", 3000.0, *(round_result(n, backend=None) for n in (1, 2, 3))),
    session("sagemaker", 4000.0, round_result(1, backend=None), round_result(2, backend=None),
            round_result(3, backend=None, cached_tokens=1100)),
)  # fmt: skip
EVIDENCE = ("evidence", "warm_rounds", "warm_rounds_reused", "warm_cached_tokens", "warm_ideal_cached_tokens")


def test_a_session_judged_by_reuse_keeps_its_warm_rounds_cached_and_ideal_tokens(store):
    for judged in BY_REUSE:
        store.add_session(judged)
    rows = store.sessions(target="sagemaker")
    assert [(row["sticky"], *(row[c] for c in EVIDENCE)) for row in rows] == [
        (False, "reuse", 2, 1, 1184 + 1100, 1184 + 2368),
        (True, "reuse", 2, 2, 1184 + 2368, 1184 + 2368),
    ]


DROP_PIN_OUTCOME = "ALTER TABLE rounds DROP COLUMN pin_outcome"  # schema 7's


def test_a_store_of_schema_6_keeps_its_rounds_and_records_the_routers_pin_outcome(location):
    """Schema 7 keeps the pin outcome a router reported per round: the rounds stored before it read None."""
    with open_store(location) as store:
        old = store.add_session(session())
    version = "UPDATE kvwatch_schema SET version = 6" if is_postgres(location) else "PRAGMA user_version = 6"
    write(location, DROP_PIN_OUTCOME, *DROP_LIFE, version)
    with pytest.raises(StoreError, match="has schema 6, from an older kvwatch: `kvwatch serve` upgrades it"):
        open_store(location, readonly=True)
    pinned = session("olla", 2000.0, round_result(1, pin_outcome="miss"), round_result(2, pin_outcome="hit"))
    with open_store(location) as store:
        assert store.session(old) == session()
        assert store.session(store.add_session(pinned)) == pinned
        assert [r["pin_outcome"] for r in store.rounds("olla")] == ["miss", "hit"]
        assert {r["pin_outcome"] for r in store.rounds("lab-affinity")} == {None}


# A SageMaker session idled 3.5 s after round 1: round 2's session had expired (a new one opened, cold on
# another replica), round 3 stayed with it; closed at the end, and a second CLOSE found it gone.
IDLED = replace(
    session("sagemaker-life", 5000.0, round_result(1, backend="r1"),
            round_result(2, backend="r2", cached_tokens=0, ideal_cached_tokens=0),
            round_result(3, backend="r2")),
    closed=True, session_losses=((2, "expired"),), idle=(1, 3.5), close_gone=True,
)  # fmt: skip


def test_a_sessions_life_is_stored_and_read_back(store):
    """Its losses, its idle and what followed (lifecycle.SessionLife), its close: in the session's row and
    in the record read back."""
    unclosed = replace(session("sagemaker-life", 6000.0), closed=False, idle=(2, 4.0))
    ids = [store.add_session(IDLED), store.add_session(unclosed)]
    assert [store.session(i) for i in ids] == [IDLED, unclosed]
    stored = {row["id"]: {column: row[column] for column in NO_LIFE} for row in store.sessions()}
    assert stored[ids[0]] == {
        "closed": True, "close_gone": True, "session_losses": ((2, "expired"),), "idle_after_round": 1,
        "idle_seconds": 3.5, "idle_expiry": "expired", "idle_cold": True, "idle_new_replica": True,
        "idle_repinned": True, "idle_as_expected": True,
    }  # fmt: skip
    # Idled after round 2, said nothing of it, stayed warm on its replica, no round after: not judged.
    assert stored[ids[1]] == NO_LIFE | {
        "closed": False, "idle_after_round": 2, "idle_seconds": 4.0, "idle_cold": False,
        "idle_new_replica": False,
    }  # fmt: skip


def test_a_store_of_schema_7_keeps_its_sessions_and_records_their_lives(location):
    """Schema 8 keeps each session's life: the sessions stored before it say nothing of theirs."""
    with open_store(location) as store:
        old = store.add_session(session())
    version = "UPDATE kvwatch_schema SET version = 7" if is_postgres(location) else "PRAGMA user_version = 7"
    write(location, *DROP_LIFE, version)
    with pytest.raises(StoreError, match="has schema 7, from an older kvwatch: `kvwatch serve` upgrades it"):
        open_store(location, readonly=True)
    with open_store(location) as store:
        assert store.session(store.add_session(IDLED)) == IDLED
        assert store.session(old) == session()
        rows = {row["id"]: row for row in store.sessions()}
    assert {column: rows[old][column] for column in NO_LIFE} == NO_LIFE | {"session_losses": None}
    assert rows[old + 1]["idle_as_expected"] is True


def test_a_store_of_schema_5_learns_each_stored_sessions_evidence_from_its_rounds(location):
    """Schema 6 keeps what each session's stickiness was judged by and its warm rounds' reuse: a store
    written before it gets them for the sessions it holds, as the records judge them (in SQLite and
    PostgreSQL alike)."""
    unknown = session("t", 900.0, round_result(1, backend=None, cached_tokens=None))
    failed = session("t", 950.0, round_result(1, backend=None), round_result(2, backend=None, status=500,
                     error_kind="http_error", ttft_seconds=None))  # fmt: skip
    stored = (session(), *BY_REUSE, unknown, failed)
    with open_store(location) as store:
        for one in stored:
            store.add_session(one)
    version = "UPDATE kvwatch_schema SET version = 5" if is_postgres(location) else "PRAGMA user_version = 5"
    dropped = (*(f"ALTER TABLE sessions DROP COLUMN {column}" for column in EVIDENCE), DROP_PIN_OUTCOME)
    dropped += DROP_LIFE
    write(location, *dropped, version)
    with pytest.raises(StoreError, match="has schema 5, from an older kvwatch: `kvwatch serve` upgrades it"):
        open_store(location, readonly=True)

    with open_store(location) as store:
        rows = sorted(store.sessions(), key=lambda row: row["started_at"])
        assert [store.session(row["id"]) for row in rows] == sorted(stored, key=lambda s: s.started_at)
    expected = [tuple(getattr(s, c) for c in EVIDENCE) for s in sorted(stored, key=lambda s: s.started_at)]
    assert [tuple(row[c] for c in EVIDENCE) for row in rows] == expected
    assert {row[0] for row in expected} == {"replica", "reuse", "none"}
    assert ("none", 0, 0, None, None) in expected  # a failed warm round is no evidence


def test_rounds_rows_carry_their_session_and_route(store):
    first = store.add_session(session("lab-affinity", 1000.0))
    second = store.add_session(session("lab-round-robin", 2000.0, route_mode="round_robin"))
    rows = store.rounds()
    assert [(row["session"], row["round"]) for row in rows] == [
        (s, n) for s in (second, first) for n in (1, 2, 3)
    ]
    route = {"session": second, "target": "lab-round-robin", "route_mode": "round_robin"}
    assert rows[0] == route | asdict(round_result(1))
    assert [row["ttft_seconds"] for row in store.rounds(target="lab-affinity")] == [0.412, 0.031, 0.031]
    assert {row["session"] for row in store.rounds(since=1500.0)} == {second}


def test_rounds_of_one_session_and_only_the_columns_asked_for(store):
    first = store.add_session(session("lab-affinity", 1000.0))
    store.add_session(session("lab-affinity", 2000.0))
    assert [row["round"] for row in store.rounds(session=first)] == [1, 2, 3]
    ttft = store.rounds(target="lab-affinity", since=1500.0, columns=("target", "round", "ttft_seconds"))
    assert ttft == [
        {"target": "lab-affinity", "round": n, "ttft_seconds": s}
        for n, s in ((1, 0.412), (2, 0.031), (3, 0.031))
    ]


def test_sessions_filter_and_order(store):
    for started_at, target in [(100.0, "a"), (300.0, "b"), (200.0, "a"), (400.0, "a")]:
        store.add_session(session(target, started_at))
    started = [row["started_at"] for row in store.sessions()]
    assert started == [400.0, 300.0, 200.0, 100.0]
    assert [row["started_at"] for row in store.sessions(target="a")] == [400.0, 200.0, 100.0]
    assert [row["started_at"] for row in store.sessions(since=200.0)] == [400.0, 300.0, 200.0]
    assert [row["started_at"] for row in store.sessions(target="a", since=150.0, limit=1)] == [400.0]
    assert store.sessions(target="nobody") == []


def test_reopened_store_reads_back_what_was_written(location):
    with open_store(location) as store:
        stored = store.add_session(session())
        store.add_alerts(webhook(), received_at=1000.0)
    with open_store(location) as store:
        assert store.session(stored) == session()
        assert len(store.alerts()) == 2
        assert store.add_session(session("again", 2000.0)) == stored + 1
    version = "SELECT version FROM kvwatch_schema" if is_postgres(location) else "PRAGMA user_version"
    assert query(location, version) == [(SCHEMA_VERSION,)]


def test_an_sqlite_store_is_in_wal_mode(tmp_path):
    Store(tmp_path / "kvwatch.db").close()
    assert query(tmp_path / "kvwatch.db", "PRAGMA journal_mode") == [("wal",)]


def test_busy_timeout_is_set(tmp_path):
    with Store(tmp_path / "kvwatch.db") as store:
        assert store._db.execute("PRAGMA busy_timeout").fetchone()[0] == 1000


def sqlite_heap_bytes() -> int:
    """What SQLite has allocated in this process, by its own count (tracemalloc does not see it)."""
    library = ctypes.CDLL(ctypes.util.find_library("sqlite3"))
    library.sqlite3_libversion.restype = ctypes.c_char_p
    library.sqlite3_memory_used.restype = ctypes.c_int64
    assert library.sqlite3_libversion().decode() == sqlite3.sqlite_version, "not the sqlite3 module's SQLite"
    return library.sqlite3_memory_used()


def test_the_writers_page_cache_stays_small_as_the_history_grows(tmp_path):
    """kvwatch serve writes for months: its memory must not follow the size of the history."""
    path = tmp_path / "kvwatch.db"
    many_rounds = [round_result(n) for n in range(1, 41)]
    with Store(path) as store:
        before = sqlite_heap_bytes()
        for n in range(300):
            store.add_session(session("lab-affinity", 1000.0 + n, *many_rounds))
        grown = sqlite_heap_bytes() - before
    assert path.stat().st_size > 1 << 20  # far past the writer's cache
    assert grown < 512 << 10, f"SQLite's heap grew by {grown >> 10} KiB"


def test_a_postgresql_store_waits_for_a_lock_as_long_as_sqlite(postgres):
    with open_store(postgres.new_database()) as store:
        assert store._db.execute("SHOW lock_timeout").fetchone() == {"lock_timeout": "1s"}


def test_readonly_store_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(StoreError, match="^no kvwatch store at "):
        Store(tmp_path / "missing.db", readonly=True)
    assert not (tmp_path / "missing.db").exists()

    other = tmp_path / "other.db"
    sqlite3.connect(other).close()
    with pytest.raises(StoreError, match=r"other\.db is not a kvwatch store$"):
        Store(other, readonly=True)

    garbage = tmp_path / "garbage.db"
    garbage.write_text("not a database at all" * 100)
    with pytest.raises(StoreError, match=r"garbage\.db: file is not a database$"):
        Store(garbage)

    newer = tmp_path / "newer.db"
    Store(newer).close()
    db = sqlite3.connect(newer)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match=f"has schema {SCHEMA_VERSION + 1}, from a newer kvwatch"):
        Store(newer)


def test_a_readonly_postgresql_store_refuses_what_it_cannot_read(postgres):
    url = postgres.new_database()
    missing = postgres.url().replace("/postgres", "/no_such_database")
    with pytest.raises(
        StoreError, match='^cannot open the kvwatch store .*no_such_database: .*"no_such_database"'
    ):
        open_store(missing, readonly=True)
    with pytest.raises(StoreError, match=r"kvwatch_\d+_\d+ is not a kvwatch store$"):
        open_store(url, readonly=True)
    with pytest.raises(StoreError, match="password authentication failed"):
        Store(url, password="wrong")
    assert query(url, "SELECT to_regclass('sessions')") == [(None,)]  # nothing was created

    open_store(url).close()
    with psycopg.connect(url, password=PASSWORD) as db:
        db.execute(f"UPDATE kvwatch_schema SET version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match=f"has schema {SCHEMA_VERSION + 1}, from a newer kvwatch"):
        open_store(url)


def test_an_unknown_store_scheme_is_refused():
    with pytest.raises(
        StoreError, match=r"^unknown store scheme mysql://; known: a file path, postgresql://"
    ):
        Store("mysql://kvwatch@127.0.0.1/kvwatch")


def test_a_store_of_schema_1_is_upgraded_and_keeps_its_history(tmp_path):
    """Schema 2 added each round's time to the first answer text (reasoning models), schema 3 whether a
    session was cut short by a stop, schema 4 its writer's id and whether it is in flight, schema 5 which
    of several writers wrote it, schema 6 what its stickiness was judged by; a store
    written before them keeps its sessions, whose rounds read None there and which were neither
    interrupted nor in flight."""
    path = tmp_path / "kvwatch.db"
    with Store(path) as store:
        old = store.add_session(session())
    db = sqlite3.connect(path)  # what kvwatch with schema 1 left behind
    db.execute("ALTER TABLE rounds DROP COLUMN first_content_seconds")
    db.execute(DROP_PIN_OUTCOME)
    db.execute("ALTER TABLE sessions DROP COLUMN interrupted")
    db.execute("DROP INDEX sessions_by_uid")
    db.execute("ALTER TABLE sessions DROP COLUMN uid")
    db.execute("ALTER TABLE sessions DROP COLUMN in_flight")
    db.execute("ALTER TABLE sessions DROP COLUMN writer")
    for column in EVIDENCE:
        db.execute(f"ALTER TABLE sessions DROP COLUMN {column}")
    for statement in DROP_LIFE:
        db.execute(statement)
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="has schema 1, from an older kvwatch: `kvwatch serve` upgrades it"):
        Store(path, readonly=True)

    thinking = session("reasoning", 2000.0, round_result(1, first_content_seconds=0.9), round_result(2))
    with Store(path) as store:
        assert store.session(old) == session()
        assert store.session(store.add_session(thinking)) == thinking
    with Store(path, readonly=True) as reader:
        assert [r["first_content_seconds"] for r in reader.rounds("reasoning")] == [0.9, None]
        assert [(s["interrupted"], s["in_flight"]) for s in reader.sessions()] == [(False, False)] * 2
        assert [s["evidence"] for s in reader.sessions()] == ["replica"] * 2


def test_readonly_store_cannot_write(location):
    open_store(location).close()
    refusal = (psycopg.errors.ReadOnlySqlTransaction, sqlite3.OperationalError)
    with open_store(location, readonly=True) as reader, pytest.raises(refusal, match="read-?only"):
        reader.add_session(session())
    assert query(location, "SELECT count(*) FROM sessions") == [(0,)]


# --- alerts ----------------------------------------------------------------------------------------


def webhook(status: str = "firing") -> dict:
    """A notification as Alertmanager 0.27 posts it (webhook format version 4)."""
    return {
        "receiver": "kvwatch",
        "status": status,
        "alerts": [
            {
                "status": status,
                "labels": {
                    "alertname": "KVWatchSessionAffinityBroken",
                    "severity": "critical",
                    "target": "lab-affinity",
                    "route_mode": "affinity",
                    "instance": "127.0.0.1:18004",
                    "job": "kvwatch",
                },
                "annotations": {
                    "summary": "Probe sessions through lab-affinity change backend.",
                    "runbook_url": "https://example.com/alerts/runbook.md#kvwatchsessionaffinitybroken",
                },
                "startsAt": "2026-11-29T18:00:05.123456789Z",
                "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-11-29T18:10:05Z",
                "generatorURL": "http://127.0.0.1:18002/graph?g0.expr=...",
                "fingerprint": "a1b2c3d4e5f60718",
            },
            {
                "status": status,
                "labels": {"alertname": "Watchdog", "severity": "none"},
                "annotations": {},
                "startsAt": "2026-11-29T17:00:00+01:00",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "",
                "fingerprint": "00000000000000ff",
            },
        ],
        "groupLabels": {"alertname": "KVWatchSessionAffinityBroken"},
        "commonLabels": {"severity": "critical"},
        "commonAnnotations": {},
        "externalURL": "http://127.0.0.1:18003",
        "version": "4",
        "groupKey": '{}:{alertname="KVWatchSessionAffinityBroken"}',
        "truncatedAlerts": 0,
    }


def test_webhook_alerts_are_stored(store):
    assert store.add_alerts(webhook(), received_at=5000.0) == AlertsAdded(stored=2)
    watchdog, broken = store.alerts()  # received together: the later row first
    assert broken | {"id": None} == {
        "id": None,
        "received_at": 5000.0,
        "status": "firing",
        "alertname": "KVWatchSessionAffinityBroken",
        "severity": "critical",
        "target": "lab-affinity",
        "instance": "127.0.0.1:18004",
        "labels": webhook()["alerts"][0]["labels"],
        "annotations": webhook()["alerts"][0]["annotations"],
        "starts_at": 1795975205.123456,
        "ends_at": None,
        "fingerprint": "a1b2c3d4e5f60718",
    }
    assert (watchdog["target"], watchdog["starts_at"], watchdog["annotations"]) == (None, 1795968000.0, {})


def test_repeated_notifications_keep_the_first_receipt(store):
    store.add_alerts(webhook(), received_at=5000.0)
    assert store.add_alerts(webhook(), received_at=5060.0).stored == 0
    assert store.add_alerts(webhook("resolved"), received_at=5600.0).stored == 2
    assert [(a["status"], a["received_at"]) for a in store.alerts(status="firing")] == [
        ("firing", 5000.0)
    ] * 2
    resolved = store.alerts(since=5500.0)
    assert {a["status"] for a in resolved} == {"resolved"} and len(resolved) == 2
    assert {a["ends_at"] for a in resolved} == {1795975805.0, None}


def without(key: str, index: int = 0) -> dict:
    payload = webhook()
    del payload["alerts"][index][key]
    return payload


def changed(index: int, **values) -> dict:
    payload = webhook()
    payload["alerts"][index].update(values)
    return payload


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([], "the payload must be a JSON object, got list"),
        ({"alerts": []}, 'version must be "4" (Alertmanager\'s webhook format), got None'),
        ({**webhook(), "version": "3"}, "version must be \"4\" (Alertmanager's webhook format), got '3'"),
        ({**webhook(), "alerts": None}, "alerts: must be a list"),
    ],
)
def test_a_payload_that_is_no_notification_is_rejected_whole(store, payload, message):
    with pytest.raises(ValueError) as error:
        store.add_alerts(copy.deepcopy(payload))
    assert str(error.value) == message
    assert store.alerts() == []


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            {**webhook(), "alerts": ["KVWatchProbeFailing", webhook()["alerts"][1]]},
            "alerts[0]: must be an object",
        ),
        (changed(1, status="pending"), "alerts[1].status: must be firing or resolved, got 'pending'"),
        (without("labels", 1), "alerts[1].labels: must be an object of strings"),
        (changed(0, labels={"alertname": "X", "round": 2}), "alerts[0].labels: must be an object of strings"),
        (changed(0, labels={"severity": "critical"}), "alerts[0].labels: no alertname"),
        (changed(0, annotations=["summary"]), "alerts[0].annotations: must be an object of strings"),
        (without("startsAt"), "alerts[0].startsAt: must be an RFC 3339 time, got None"),
        (changed(0, startsAt="yesterday"), "alerts[0].startsAt: must be an RFC 3339 time, got 'yesterday'"),
        (
            changed(0, startsAt="2026-11-29T18:00:05"),
            "alerts[0].startsAt: must be an RFC 3339 time with a zone, got '2026-11-29T18:00:05'",
        ),
        (
            changed(0, startsAt="0001-01-01T00:00:00Z"),
            "alerts[0].startsAt: must be set, got the zero time '0001-01-01T00:00:00Z'",
        ),
        (changed(1, endsAt=17), "alerts[1].endsAt: must be an RFC 3339 time, got 17"),
        (without("fingerprint", 1), "alerts[1].fingerprint: must be a non-empty string"),
        (
            changed(1, status="x" * 4_000_000),
            "alerts[1].status: must be firing or resolved, got '" + "x" * 60 + "...",  # a line, not 4 MB
        ),
    ],
)
def test_a_malformed_alert_is_skipped_and_the_others_stored(store, payload, message):
    """Alertmanager does not resend a refused notification: refusing it whole would lose its good alerts."""
    assert store.add_alerts(copy.deepcopy(payload)) == AlertsAdded(stored=1, rejected=(message,))
    assert len(store.alerts()) == 1


# --- retention -------------------------------------------------------------------------------------


def test_prune_forgets_what_is_older_than_retention(location):
    now = 100 * DAY
    with open_store(location, retention_days=14) as store:
        old = store.add_session(session("a", now - 15 * DAY))
        kept = store.add_session(session("a", now - 13 * DAY))
        store.add_alerts(webhook(), received_at=now - 20 * DAY)
        store.add_alerts(webhook("resolved"), received_at=now - DAY)

        assert store.prune(now=now) == 3
        assert [row["id"] for row in store.sessions()] == [kept]
        assert store.session(old) is None
        assert {row["session"] for row in store.rounds()} == {kept}
        assert [a["status"] for a in store.alerts()] == ["resolved", "resolved"]
        assert store.prune(now=now) == 0


# --- concurrency -----------------------------------------------------------------------------------


def test_writer_is_not_blocked_by_an_open_read_transaction(tmp_path):
    """WAL: a reader keeps its snapshot while the writer commits, and sees the commit afterwards."""
    path = tmp_path / "kvwatch.db"
    with Store(path) as store:
        store.add_session(session())
        reader = sqlite3.connect(path, isolation_level=None, timeout=0)
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM sessions").fetchone()[0] == 1
        store.add_session(session("b", 2000.0))  # would wait for the reader without WAL
        assert reader.execute("SELECT count(*) FROM sessions").fetchone()[0] == 1
        reader.execute("COMMIT")
        assert reader.execute("SELECT count(*) FROM sessions").fetchone()[0] == 2
        reader.close()


READER = """
import os, sys, time
from kvwatch.store.history import Store

store = Store(sys.argv[1], readonly=True, password=os.environ["STORE_PASSWORD"])
total, seen = int(sys.argv[2]), None
deadline = time.monotonic() + 60
while seen != total and time.monotonic() < deadline:
    rows = store.sessions()
    assert all(len(store.session(row["id"]).rounds) == 3 for row in rows[:5]), "a session without its rounds"
    if len(rows) != seen:
        seen = len(rows)
        print(seen, flush=True)
"""


def test_another_process_reads_while_the_store_is_written(location):
    """The reader prints every count it sees; the writer pauses halfway until the reader has seen it."""
    total = 200
    with open_store(location) as store:
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(location), str(total)],
            cwd=REPO,
            env={**os.environ, "STORE_PASSWORD": PASSWORD},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            seen = [int(reader.stdout.readline())]
            for i in range(total):
                store.add_session(session("lab-affinity", 1000.0 + i))
                if i + 1 == total // 2:
                    for line in reader.stdout:
                        seen.append(int(line))
                        if seen[-1] == total // 2:
                            break
            out, err = reader.communicate(timeout=60)
        finally:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0, err
    seen += [int(line) for line in out.split()]
    assert seen[0] == 0 and seen[-1] == total and seen == sorted(seen) and total // 2 in seen


def test_threads_share_one_store(store):
    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = list(pool.map(lambda i: store.add_session(session("t", float(i))), range(200)))
        alerts = [pool.submit(store.add_alerts, webhook()) for _ in range(8)]
    assert sorted(ids) == list(range(1, 201))
    assert sum(future.result().stored for future in alerts) == 2
    assert len(store.rounds(target="t")) == 600


# --- the writer thread -----------------------------------------------------------------------------


@pytest.fixture
def short_busy_timeout(monkeypatch):
    """The database's own wait for a lock, shortened so that the writer's retries take over within the
    test."""
    monkeypatch.setattr("kvwatch.store.base.BUSY_TIMEOUT_SECONDS", 0.05)


LOCKED = "database is locked|canceling statement due to lock timeout"  # SQLite's, PostgreSQL's


def write_locked(location: Path | str) -> sqlite3.Connection | psycopg.Connection:
    """The store's write lock, held by another connection as another process would hold it: SQLite's
    one write lock, or PostgreSQL's lock on the sessions table; COMMIT releases either."""
    if is_postgres(location):
        holder = psycopg.connect(str(location), password=PASSWORD, autocommit=True)
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE sessions IN EXCLUSIVE MODE")
        return holder
    holder = sqlite3.connect(location, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def release(holder: sqlite3.Connection | psycopg.Connection) -> None:
    holder.execute("COMMIT")
    holder.close()


RETRIES = "kvwatch_store_write_retries_total"


def metric(writer: StoreWriter, name: str, **labels) -> float | None:
    registry = CollectorRegistry()
    registry.register(writer)
    return registry.get_sample_value(name, labels)


def wait_for_a_retry(writer: StoreWriter) -> None:
    """Until the writer tries a write again: the one it holds has failed."""
    before, deadline = metric(writer, RETRIES), time.monotonic() + 5
    while metric(writer, RETRIES) == before:
        assert time.monotonic() < deadline, "the writer never retried"
        time.sleep(0.01)


def test_the_writer_retries_through_a_lock(location, short_busy_timeout):
    with open_store(location) as store:
        writer = StoreWriter()
        holder = write_locked(location)
        locked = writer.submit(store.add_session, session())
        wait_for_a_retry(writer)
        release(holder)
        assert locked.result(timeout=5) == 1
        writer.close()
        assert store.session(1) == session()
        assert metric(writer, "kvwatch_store_writes_dropped_total", reason="failed") == 0


def test_the_writer_retries_through_a_full_disk(tmp_path, short_busy_timeout):
    path = tmp_path / "kvwatch.db"
    with Store(path) as store:
        writer = StoreWriter()
        assert writer.submit(store.add_session, session()).result(timeout=5) == 1
        with store._lock:  # the file may not grow: SQLITE_FULL, as on a full disk
            pages = store._db.execute("PRAGMA page_count").fetchone()[0]
            store._db.execute(f"PRAGMA max_page_count = {pages}")
        long_answer = session("b", 2000.0, round_result(1, error_detail="word " * 4000))
        full = writer.submit(store.add_session, long_answer)
        wait_for_a_retry(writer)
        with store._lock:  # space freed
            store._db.execute("PRAGMA max_page_count = 4294967294")
        assert full.result(timeout=5) == 2
        writer.close()
        assert store.session(2) == long_answer
        assert metric(writer, "kvwatch_store_writes_dropped_total", reason="failed") == 0


def test_a_full_queue_drops_the_newest_write_and_close_writes_the_queued_ones(
    location, short_busy_timeout, caplog
):
    with open_store(location) as store:
        writer = StoreWriter(capacity=1)
        holder = write_locked(location)
        first = writer.submit(store.add_session, session("first", 1.0))
        wait_for_a_retry(writer)  # taken off the queue, waiting for the lock
        queued = writer.submit(store.add_session, session("queued", 2.0))
        newest = writer.submit(store.add_session, session("newest", 3.0))
        with pytest.raises(WriteDropped, match="1 writes are waiting already"):
            newest.result(timeout=0)
        assert metric(writer, "kvwatch_store_writes_dropped_total", reason="queue_full") == 1
        assert metric(writer, "kvwatch_store_writes_queued") == 1
        assert "store write add_session dropped" in caplog.text
        release(holder)
        writer.close()
        assert (first.result(timeout=0), queued.result(timeout=0)) == (1, 2)
        assert [s["target"] for s in store.sessions()] == ["queued", "first"]


def test_a_write_locked_for_good_is_dropped_when_its_retries_run_out_or_at_close(
    location, short_busy_timeout
):
    with open_store(location) as store:
        writer = StoreWriter(retry_seconds=0.2)
        holder = write_locked(location)
        with pytest.raises(WriteDropped, match=LOCKED):
            writer.submit(store.add_session, session()).result(timeout=5)
        writer.retry_seconds = 60.0
        queued = writer.submit(store.add_session, session())
        started = time.monotonic()
        writer.close(timeout=0.2)
        assert time.monotonic() - started < 1.5
        with pytest.raises(WriteDropped, match=LOCKED):
            queued.result(timeout=0)
        assert metric(writer, "kvwatch_store_writes_dropped_total", reason="failed") == 2
        release(holder)
        assert store.sessions() == []


def test_the_writer_connects_to_postgresql_again_and_keeps_its_sessions_alive(postgres):
    """A lost connection (a restarted server, a failover) costs a retry, not the write; the writer takes
    its lock again, so that its session in flight does not read as cut short."""
    url = postgres.new_database()
    with open_store(url) as store:
        writer = StoreWriter()
        one, two = (
            session("t", 1000.0, round_result(1)),
            session("t", 1000.0, round_result(1), round_result(2)),
        )
        assert writer.submit(store.add_session, one, "uid-1", True).result(timeout=5) == 1
        backend = store._db._db.info.backend_pid  # the writer's connection, as the server knows it
        with psycopg.connect(url, password=PASSWORD, autocommit=True) as admin:
            ended = admin.execute("SELECT pg_terminate_backend(%s, 5000)", (backend,)).fetchone()
        assert ended == (True,)
        assert writer.submit(store.add_session, two, "uid-1", True).result(timeout=10) == 1
        assert metric(writer, RETRIES) >= 1
        writer.close()
        with open_store(url, readonly=True) as reader:
            assert [(s["in_flight"], s["interrupted"]) for s in reader.sessions()] == [(True, False)]
            assert reader.session(1) == two


def test_a_writer_whose_old_connection_still_holds_its_id_goes_on_under_a_new_one(postgres):
    """The server has not seen the writer's old connection break (a network cut) and still holds its
    writer id: the writer connects again under a new id, and its session in flight stays alive."""
    url = postgres.new_database()
    with open_store(url) as store:
        writer = StoreWriter(retry_seconds=5)
        one, two = (
            session("t", 1000.0, round_result(1)),
            session("t", 1000.0, round_result(1), round_result(2)),
        )
        writer.submit(store.add_session, one, "uid-1", True).result(timeout=5)
        old_id, backend = store._db.writer, store._db._db.info.backend_pid
        with psycopg.connect(url, password=PASSWORD, autocommit=True) as old_connection:
            old_connection.execute("SELECT pg_terminate_backend(%s, 5000)", (backend,))
            old_connection.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_SPACE, old_id))  # as if alive
            writer.submit(store.add_session, two, "uid-1", True).result(timeout=10)
            assert store._db.writer not in (None, old_id)
            with open_store(url, readonly=True) as reader:
                assert [(s["in_flight"], s["interrupted"]) for s in reader.sessions()] == [(True, False)]
                assert reader.session(1) == two
        writer.close()
    assert metric(writer, "kvwatch_store_writes_dropped_total", reason="failed") == 0


def test_the_writer_retries_through_a_postgresql_outage_and_says_so_twice(postgres_to_stop, caplog):
    """The server stops (an immediate shutdown cuts every connection) and starts again on its port: the
    writes made meanwhile are retried, connecting again, and all stored. One warning says that writes
    fail and why, one line that they succeed again: no traceback, and not the password in the URL."""
    caplog.set_level(logging.INFO, logger="kvwatch.store")
    server = postgres_to_stop
    url = server.new_database().replace(f"{USER}@", f"{USER}:{PASSWORD}@")
    with Store(url) as store:
        writer = StoreWriter(location=store.location)
        written = [writer.submit(store.add_session, session("t", 0.0), "uid-0")]
        written[0].result(timeout=5)
        server.stop()
        for n in range(1, 4):  # writes keep coming while the server is down, each after a failed try
            written.append(writer.submit(store.add_session, session("t", float(n)), f"uid-{n}"))
            wait_for_a_retry(writer)
        server.start()
        for future in written:
            future.result(timeout=30)
        writer.close()
        assert [s["started_at"] for s in store.sessions()] == [3.0, 2.0, 1.0, 0.0]
    assert metric(writer, "kvwatch_store_writes_dropped_total", reason="failed") == 0
    assert metric(writer, RETRIES) >= 3
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kvwatch.store"]
    shown = f"postgresql://{USER}:[redacted]@127.0.0.1:{server.port}/"
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert said[0][1].startswith(f"store writes to {shown}") and "fail (" in said[0][1], said
    assert said[1][1].startswith(f"store writes to {shown}") and "succeed again" in said[1][1], said
    assert PASSWORD not in caplog.text and "Traceback" not in caplog.text


def test_a_write_the_database_refuses_is_dropped_at_once_and_the_next_one_stored(location, caplog):
    """A constraint the write breaks (a session without a target) fails the same way every time: it is
    dropped and counted at once, not retried, and the writer goes on."""
    with open_store(location) as store:
        writer = StoreWriter()
        with pytest.raises(WriteDropped, match="IntegrityError|NotNullViolation"):
            writer.submit(store.add_session, replace(session(), target=None)).result(timeout=5)
        assert writer.submit(store.add_session, session()).result(timeout=5)
        writer.close()
        assert [s["target"] for s in store.sessions()] == ["lab-affinity"]
    assert metric(writer, "kvwatch_store_writes_dropped_total", reason="failed") == 1
    assert metric(writer, RETRIES) == 0
    assert "store write add_session dropped" in caplog.text


def test_a_write_the_store_refuses_goes_back_to_its_caller_uncounted(store):
    writer = StoreWriter()
    with pytest.raises(ValueError, match="version must be"):
        writer.submit(store.add_alerts, {"alerts": []}).result(timeout=5)
    writer.close()
    assert metric(writer, "kvwatch_store_writes_dropped_total", reason="failed") == 0


# --- secrets ---------------------------------------------------------------------------------------


def test_a_password_in_the_store_urls_query_shows_in_no_store_error_or_dropped_write(postgres, caplog):
    """libpq takes `?password=` from the URL (`kvwatch config check` refuses it in store.url; a URL given
    elsewhere may still carry it): every line that names the store shows it as [redacted]."""
    role, secret = f"kvw_url_{os.getpid()}", "pw-url-4c9e1b7f3a"
    url = postgres.new_database()  # …/postgres?options=-csearch_path%3D<its schema>
    with postgres.connect() as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{secret}'")
        admin.execute(f"ALTER SCHEMA {url.rsplit('%3D', 1)[1]} OWNER TO {role}")
    with_password = url.replace(f"//{USER}@", f"//{role}@") + f"&password={secret}"
    shown = []
    for unusable in (
        f"postgresql://{role}@127.0.0.1:{free_port()}/postgres?password={secret}",  # nothing listens
        with_password.replace("/postgres?", "/no_such_database?"),
    ):
        with pytest.raises(StoreError) as refused:
            Store(unusable)
        shown.append(str(refused.value))
    with caplog.at_level(logging.WARNING), Store(with_password) as store:
        writer = StoreWriter(retry_seconds=0.5)
        with postgres.connect() as admin:  # the store's connection is cut, and it may not log in again
            admin.execute(f"ALTER ROLE {role} NOLOGIN")
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
            )
        with pytest.raises(WriteDropped) as dropped:
            writer.submit(store.add_session, session()).result(timeout=30)
        writer.close()
    shown += [str(dropped.value), caplog.text]
    naming_the_store = [line for line in shown if "postgresql://" in line]
    assert len(naming_the_store) >= 2, shown
    assert all("password=[redacted]" in line for line in naming_the_store), shown
    assert "store write add_session dropped" in caplog.text
    assert not [line for line in shown if secret in line]


def test_nothing_in_the_store_takes_an_api_key(location):
    """Probes redact keys before they reach a record; the store has no place a key could go. Only the
    database's password goes in, to connect (from store.password_env or store.password_file)."""
    open_store(location).close()
    secret_words = ("key", "secret", "authorization", "bearer", "password")
    columns = [
        column
        for (column,) in query(
            location,
            "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
            if is_postgres(location)
            else "SELECT p.name FROM sqlite_master t JOIN pragma_table_info(t.name) p WHERE t.type = 'table'",
        )
    ]
    assert "target" in columns and not [c for c in columns if any(word in c for word in secret_words)]
    for name, method in inspect.getmembers(Store, inspect.isfunction):
        parameters = set(inspect.signature(method).parameters) - (
            {"password"} if name == "__init__" else set()
        )
        assert not [p for p in parameters if any(word in p for word in secret_words)], name
    for record in (SessionResult, RoundResult):
        fields = inspect.signature(record).parameters
        assert not [f for f in fields if any(word in f for word in secret_words)], record
