"""`kvwatch serve` loses no session: two shards split the targets and write one history that the
dashboard shows, and every session is stored through a locked store, a SIGTERM or a SIGKILL mid-run
and a PostgreSQL outage."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest
import streamlit as st
from postgres import PASSWORD
from serve_runs import (
    StallingEngine,
    probed_targets,
    sample,
    samples,
    stalling_target,
    start_serve,
    terminate,
)

from kvwatch.dashboard import data
from kvwatch.serve import shard
from kvwatch.store.base import BUSY_TIMEOUT_SECONDS
from kvwatch.store.history import Store
from processes import http_post, stop, wait_for

pytestmark = pytest.mark.integration


NOTIFICATION = {
    "version": "4",
    "alerts": [{"status": "firing", "labels": {"alertname": "KVWatchProbeFailing"}, "annotations": {},
                "startsAt": "2026-12-01T12:00:00Z", "fingerprint": "f00d"}],
}  # fmt: skip


def exported_sessions(url: str) -> float:
    found = samples(url)
    route = {"target": "direct", "route_mode": "affinity"}
    return sum(
        sample(found, "kvwatch_probe_sessions_total", outcome=o, **route) or 0 for o in ("success", "failure")
    )


def assert_stored_all_but_the_rounds_cut_off(asked: Counter[str], stored: Counter[str]) -> None:
    """Every round the engine was asked is stored, but for the one round per target (one session a run,
    its rounds in turn) that the stop may cut off between the engine's answer and the probe's reading
    it: runs start at their targets' phases, so some run is in flight whenever the shards stop."""
    assert set(asked) == set(stored), (asked, stored)
    assert all(asked[path] - 1 <= stored[path] <= asked[path] for path in asked), (asked, stored)


def run_two_shards(
    tmp_path: Path,
    engine: StallingEngine,
    names: list[str],
    store: dict | None = None,
    until: Callable[[], bool] = lambda: True,
) -> list[set[str]]:
    """Runs `kvwatch serve --shard 0/2` and `1/2` over one target per name until each exports its first
    runs and `until()` holds, and stops them: the targets each exported."""
    targets = [
        {**stalling_target(engine), "name": name, "base_url": f"{engine.url}/{name}"} for name in names
    ]
    shards: list[tuple[subprocess.Popen, str, Path]] = []
    try:
        for index in range(2):
            (tmp_path / str(index)).mkdir()
            shards.append(start_serve(tmp_path / str(index), targets, "--shard", f"{index}/2", store=store))
        exported = [probed_targets(url) for _, url, _ in shards]
        wait_for(until, "the shards' runs the test waits for", 60, 0.2)
        for process, _, log in shards:
            terminate(process, log)
    finally:
        for process, *_ in shards:
            stop(process)
    return exported


def test_two_shards_probe_each_of_six_targets_from_one_process_only(tmp_path: Path):
    """Two `kvwatch serve --shard` processes of one config: each exports exactly its hashmod share, and
    every round the engine answered for a target is one that target's shard stored."""
    engine = StallingEngine()
    names = [f"route-{i}" for i in range(6)]
    try:
        exported = run_two_shards(tmp_path, engine, names)
    finally:
        engine.close()
    assert exported == [{n for n in names if shard.hashmod(n, 2) == i} for i in range(2)]
    stored = Counter()
    for index in range(2):
        with Store(tmp_path / str(index) / "kvwatch.db", readonly=True) as store:
            stored.update(f"/{r['target']}/v1/chat/completions" for r in store.rounds())
    assert set(engine.asked) == {f"/{n}/v1/chat/completions" for n in names}
    assert_stored_all_but_the_rounds_cut_off(engine.asked, stored)


def test_two_shards_write_one_postgresql_history_that_the_dashboard_shows(tmp_path, postgres, monkeypatch):
    """Two `kvwatch serve --shard` processes of six targets write one PostgreSQL history, the password
    from the environment: every target's sessions are there, one an interval (no target probed by both
    shards), every answered round is stored, and the dashboard's data layer reads all six targets."""
    monkeypatch.setenv("KVWATCH_TEST_STORE_PASSWORD", PASSWORD)
    history = {"url": postgres.new_database(), "password_env": "KVWATCH_TEST_STORE_PASSWORD"}
    engine = StallingEngine()
    names = [f"route-{i}" for i in range(6)]

    def two_runs_each() -> bool:
        with Store(history["url"], readonly=True, password=PASSWORD) as store:
            runs = Counter(row["target"] for row in store.sessions())
        return all(runs[name] >= 2 for name in names)

    try:
        run_two_shards(tmp_path, engine, names, store=history, until=two_runs_each)
    finally:
        engine.close()
    with Store(history["url"], readonly=True, password=PASSWORD) as store:
        sessions, rounds = store.sessions(), store.rounds(columns=("target",))
    starts: dict[str, list[float]] = {}
    for row in sorted(sessions, key=lambda row: row["started_at"]):
        starts.setdefault(row["target"], []).append(row["started_at"])
    assert set(starts) == set(names)
    gaps = [later - earlier for times in starts.values() for earlier, later in pairwise(times)]
    assert all(len(times) >= 2 for times in starts.values()) and min(gaps) > 0.5, starts
    assert_stored_all_but_the_rounds_cut_off(
        engine.asked, Counter(f"/{r['target']}/v1/chat/completions" for r in rounds)
    )

    monkeypatch.setattr(sys, "argv", ["app.py", "--config", str(tmp_path / "0" / "kvwatch.yaml")])
    st.cache_data.clear()
    try:
        shown = data.sessions(0)
    finally:
        st.cache_data.clear()
    assert shown.error is None and set(shown.value["target"]) == set(names)


def test_a_locked_store_or_a_sigterm_mid_run_loses_no_session(tmp_path: Path):
    """Another process holds the store's write lock past SQLite's busy timeout: runs go on and /metrics
    counts them meanwhile, and every session and a webhook post meanwhile are stored once the lock goes.
    Then SIGTERM while a session waits for its round 2: its finished round 1 is stored, marked interrupted."""
    engine = StallingEngine()
    try:
        process, url, log = start_serve(tmp_path, stalling_target(engine))
        try:
            before = exported_sessions(url)
            locker = sqlite3.connect(tmp_path / "kvwatch.db", isolation_level=None, timeout=10)
            locker.execute("BEGIN IMMEDIATE")
            posted = []
            poster = threading.Thread(
                target=lambda: posted.append(http_post(f"{url}/alerts", json=NOTIFICATION, timeout=10))
            )
            poster.start()
            deadline = time.monotonic() + 30
            while exported_sessions(url) <= before:  # a run ends while the store is locked
                assert time.monotonic() < deadline, f"no run ended in the lock:\n{log.read_text()}"
                time.sleep(0.05)
            time.sleep(BUSY_TIMEOUT_SECONDS + 0.5)  # the fault's length: that run's write waits past it
            locker.execute("COMMIT")
            locker.close()
            poster.join()
            assert posted[0].status_code == 200 and posted[0].json()["stored"] == 1

            engine.stall()
            deadline = time.monotonic() + 30
            while not engine.stalled and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.stalled == 1, log.read_text()
            finished = exported_sessions(url)
            terminate(process, log)
        finally:
            stop(process)
    finally:
        engine.close()
    with Store(tmp_path / "kvwatch.db", readonly=True) as store:
        sessions = store.sessions()
        assert len(sessions) == finished + 1
        cut, *complete = sessions  # newest first
        assert cut["interrupted"] and not any(s["interrupted"] for s in complete)
        assert [(r["round"], r["error_kind"]) for r in store.rounds() if r["session"] == cut["id"]] == [
            (1, None)
        ]
        assert [a["alertname"] for a in store.alerts()] == ["KVWatchProbeFailing"]


def stored_sessions(path: Path) -> list[tuple[bool, bool, list[int]]]:
    """Each stored session, newest first, as a reader sees it: in flight, interrupted, its rounds."""
    with Store(path, readonly=True) as store:
        rounds = store.rounds()
        return [
            (s["in_flight"], s["interrupted"], [r["round"] for r in rounds if r["session"] == s["id"]])
            for s in store.sessions()
        ]


def wait_for_sessions(path: Path, expected: list, log: Path) -> None:
    deadline = time.monotonic() + 30
    while (found := stored_sessions(path)) != expected:
        assert time.monotonic() < deadline, f"stored {found}, not {expected}:\n{log.read_text()}"
        time.sleep(0.05)


def test_a_sigkill_mid_session_keeps_its_finished_rounds_cut_short(tmp_path: Path):
    """kvwatch serve is killed while a session waits for its round 2: round 1 was stored as it finished,
    in flight; once the process is gone a reader sees the session interrupted, and the next serve marks
    it so in the store while its own session is in flight; a SIGTERM then ends that one interrupted."""
    engine = StallingEngine()
    engine.stall()  # every session's round 2, from the first run on
    path = tmp_path / "kvwatch.db"
    in_flight, cut = (True, False, [1]), (False, True, [1])
    try:
        killed, _, log = start_serve(tmp_path, stalling_target(engine))
        try:
            wait_for_sessions(path, [in_flight], log)
            os.kill(killed.pid, signal.SIGKILL)
            killed.wait(timeout=10)
        finally:
            stop(killed)
        assert stored_sessions(path) == [cut]

        restarted, _, log = start_serve(tmp_path, stalling_target(engine))
        try:
            wait_for_sessions(path, [in_flight, cut], log)  # the old one read so only if marked in the file
            terminate(restarted, log)
        finally:
            stop(restarted)
    finally:
        engine.close()
    assert stored_sessions(path) == [cut, cut]
    assert "1 sessions were in flight when their writer of" in log.read_text()


OUTAGE_SECONDS = 20.0  # PostgreSQL down: four times the writer's longest backoff (5 s)
DROPPED = "kvwatch_store_writes_dropped_total"


def wait_until_stored(url: str, history: str, sessions: int, log: Path) -> dict:
    """Until a PostgreSQL history holds `sessions` that ended (not in flight), or a write was dropped;
    then the exporter's /metrics."""
    deadline = time.monotonic() + 30
    while True:
        found = samples(url)
        with Store(history, readonly=True, password=PASSWORD) as store:
            stored = sum(not s["in_flight"] for s in store.sessions())
        if stored >= sessions or sample(found, DROPPED, reason="failed"):
            return found
        assert time.monotonic() < deadline, f"{stored} of {sessions} sessions stored:\n{log.read_text()}"
        time.sleep(0.3)


def test_a_postgresql_outage_loses_no_session(tmp_path: Path, postgres_to_stop):
    """PostgreSQL stops for OUTAGE_SECONDS (an immediate shutdown cuts the writer's connection) and starts
    again on its data directory and port while `kvwatch serve` probes each second: /metrics answers all
    along, every write is retried until it connects again, and every round the engine answered is stored,
    none dropped. The log says once that writes fail and once that they succeed again, no traceback."""
    server = postgres_to_stop
    password_file = tmp_path / "store-password"
    password_file.write_text(f"{PASSWORD}\n")
    history = {"url": server.new_database(), "password_file": str(password_file)}
    engine = StallingEngine()
    try:
        process, url, log = start_serve(tmp_path, stalling_target(engine), store=history)
        try:
            assert probed_targets(url) == {"direct"}, log.read_text()
            server.stop()
            outage_ends, before = time.monotonic() + OUTAGE_SECONDS, exported_sessions(url)
            while time.monotonic() < outage_ends:  # the outage itself: its length is the fault
                time.sleep(0.5)
                during = exported_sessions(url)
            server.start()
            assert during > before, log.read_text()  # probes went on, and /metrics answered
            found = wait_until_stored(url, history["url"], during, log)
            terminate(process, log)
        finally:
            stop(process)
    finally:
        engine.close()
    assert sample(found, DROPPED, reason="failed") == 0, log.read_text()
    assert sample(found, "kvwatch_store_write_retries_total") > 0
    with Store(history["url"], readonly=True, password=PASSWORD) as store:
        stored = Counter({"/v1/chat/completions": len(store.rounds(columns=("round",)))})
    assert_stored_all_but_the_rounds_cut_off(engine.asked, stored)
    said = log.read_text()
    assert said.count("kvwatch.store WARNING store writes to") == 1, said
    assert said.count("kvwatch.store INFO store writes to") == 1 and "succeed again" in said, said
    assert "Traceback" not in said and PASSWORD not in said
