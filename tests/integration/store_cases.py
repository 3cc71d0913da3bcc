"""What the store's integration tests share: the records they store, a new store at each `location`
(an SQLite file, or a database of the session's real PostgreSQL server: tests/postgres.py), what
another client of its database reads, and a notification as Alertmanager posts it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg
import pytest
from postgres import PASSWORD

from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.store.history import Store


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
