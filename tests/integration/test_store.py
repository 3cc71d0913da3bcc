"""The history gives back exactly what was stored, survives restarts and upgrades from older schemas,
and refuses what it cannot read: each test with a `location` runs against SQLite and against a real
PostgreSQL server (tests/postgres.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sqlite3
from dataclasses import asdict, replace
from pathlib import Path

import psycopg
import pytest
from postgres import PASSWORD
from store_cases import (
    is_postgres,
    open_store,
    query,
    round_result,
    session,
    webhook,
)
from store_cases import location as location  # the fixtures
from store_cases import store as store

from kvwatch.store.history import SCHEMA_VERSION, Store, StoreError
from kvwatch.store.schema import LIFE_COLUMNS


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
