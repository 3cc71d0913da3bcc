"""The history is readable while written, by threads and by other processes; its writer thread retries
through locks, a full disk and PostgreSQL outages, drops what it must and says so; and no secret shows:
each test with a `location` runs against SQLite and against a real PostgreSQL server (tests/postgres.py)."""

from __future__ import annotations

import inspect
import logging
import os
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from postgres import PASSWORD, USER
from prometheus_client import CollectorRegistry
from store_cases import is_postgres, open_store, query, round_result, session, webhook
from store_cases import location as location  # the fixtures
from store_cases import store as store

from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.store.history import Store, StoreError, StoreWriter, WriteDropped
from kvwatch.store.postgres import LOCK_SPACE
from processes import free_port

REPO = Path(__file__).resolve().parent.parent


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
