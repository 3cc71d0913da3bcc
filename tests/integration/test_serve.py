"""`kvwatch serve` in the lab: scheduled probes through both gateways, exported, stored; the webhook
stores alerts; and the lab runs exactly the shipped example config."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise
from pathlib import Path

import pytest
import streamlit as st
import yaml
from loopback import answering_bytes, loopback_http
from postgres import (  # noqa: F401 (the session's PostgreSQL server, and a test's own to stop)
    PASSWORD,
    own_postgres_server,
    postgres_server,
)
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, free_port, http_get, http_post, launch, set_wall_clock, stop, wait_for
from kvwatch.collectors.labels import label_names
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe import session as probe_module
from kvwatch.collectors.probe.targets import ProbeClients
from kvwatch.config.settings import (
    LAB_DIRECTORY,
    PROMETHEUS_LABELS,
    Config,
    ExporterSettings,
    GatewayLog,
    StoreSettings,
    Target,
    Workload,
)
from kvwatch.dashboard import data
from kvwatch.lab.configs import render_kvwatch_config
from kvwatch.lab.state import LabState
from kvwatch.serve import shard
from kvwatch.serve.scheduler import GATEWAY_POLL_SECONDS, Service
from kvwatch.store.base import BUSY_TIMEOUT_SECONDS
from kvwatch.store.history import Store

pytestmark = pytest.mark.integration


def samples(url: str) -> dict[tuple, float]:
    text = http_get(f"{url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(found: dict, name: str, **labels) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def test_the_lab_runs_the_shipped_example_config():
    state = LabState(LAB_DIRECTORY, 18000)
    rendered = yaml.safe_load(render_kvwatch_config(state))
    assert rendered == yaml.safe_load((REPO / "examples" / "kvwatch.lab.yaml").read_text())


@pytest.fixture(scope="module")
def lab(start_lab):
    return start_lab("--replicas", "3", "--users", "1", "--think", "0.1", "--time-scale", "0.1")


def test_lab_probes_are_exported_and_stored(lab):
    exporter = lab.status["exporter"]
    affinity = {"target": "lab-affinity", "route_mode": "affinity"}
    round_robin = {"target": "lab-round-robin", "route_mode": "round_robin"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = samples(exporter)
        if (sample(found, "kvwatch_probe_sessions_total", outcome="success", **round_robin) or 0) >= 4:
            break
        time.sleep(1)
    assert sample(found, "kvwatch_probe_sticky_ratio", evidence="replica", **affinity) == 1
    assert sample(found, "kvwatch_probe_sticky_ratio", evidence="replica", **round_robin) == 0
    assert sample(found, "kvwatch_probe_sessions_total", outcome="failure", **affinity) == 0
    assert sample(found, "kvwatch_probe_session_id_echo_sessions_total", echoed="true", **affinity) >= 2
    assert sample(found, "kvwatch_probe_last_run_timestamp_seconds", **affinity) > time.time() - 60
    gateway = sum(v for (name, _), v in found.items() if name == "kvwatch_gateway_requests_total")
    assert gateway > 0

    # Prometheus scrapes the exporter like any target.
    query = {"query": 'kvwatch_probe_sticky_ratio{target="lab-affinity"}'}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = http_get(f"{lab.status['prometheus']}/api/v1/query", params=query).json()["data"]["result"]
        if result:
            break
        time.sleep(0.5)
    assert result and result[0]["value"][1] == "1"

    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        stored = store.sessions(target="lab-affinity")
        assert stored and all(s["sticky"] for s in stored)
        ended = {s["id"] for s in stored if not s["in_flight"]}  # the others have their rounds so far
        rounds = [r for r in store.rounds(target="lab-affinity") if r["session"] in ended]
        assert ended and len(rounds) == 6 * len(ended)


def test_the_webhook_takes_alerts_with_the_labs_token_and_rejects_garbage(lab):
    token_file = lab.state_dir / "webhook-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    authorized = {"Authorization": f"Bearer {token}"}
    payload = {
        "version": "4", "status": "firing", "receiver": "kvwatch", "groupKey": "{}:{}",
        "alerts": [{
            "status": "firing",
            "labels": {"alertname": "KVWatchSessionAffinityBroken", "severity": "critical",
                       "target": "lab-affinity"},
            "annotations": {"summary": "Sessions change replica."}, "startsAt": "2026-11-29T18:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z", "fingerprint": "abc123",
        }],
    }  # fmt: skip
    url = f"{lab.status['exporter']}/alerts"
    assert http_post(url, json=payload, timeout=5).status_code == 401
    answer = http_post(url, json=payload, headers=authorized, timeout=5)
    assert answer.status_code == 200 and answer.json() == {"stored": 1, "rejected": 0}
    garbage = http_post(url, content=b"{not json", headers=authorized, timeout=5)
    assert garbage.status_code == 400 and "bad Alertmanager webhook payload" in garbage.json()["error"]
    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        posted = [a["alertname"] for a in store.alerts() if a["alertname"] != "Watchdog"]  # the lab's own
    assert posted == ["KVWatchSessionAffinityBroken"]
    assert token not in (lab.state_dir / "logs" / "serve.log").read_text()


def start_serve(
    tmp_path: Path, target: dict | list[dict], *options: str, store: dict | None = None, **sections
) -> tuple[subprocess.Popen, str, Path]:
    """A real `kvwatch serve` of a target or several on a free loopback port: its process, its URL and its
    log. Its store is an SQLite file in `tmp_path` unless `store` says otherwise; `sections` are more of
    the config (`exporter` adds to the listen address)."""
    port = free_port()
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        yaml.safe_dump({
            "targets": target if isinstance(target, list) else [target],
            **sections,
            "exporter": {"listen": f"127.0.0.1:{port}", **sections.get("exporter", {})},
            "store": store or {"path": str(tmp_path / "kvwatch.db")},
        })
    )  # fmt: skip
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "kvwatch.cli.main", "serve", "--config", str(config), *options]
    process = launch(argv, log, f"http://127.0.0.1:{port}/-/healthy", cwd=REPO)
    return process, f"http://127.0.0.1:{port}", log


def terminate(process: subprocess.Popen, log: Path) -> None:
    """SIGTERM, as Kubernetes stops a pod, and a clean exit after it."""
    os.kill(process.pid, signal.SIGTERM)
    assert process.wait(timeout=15) == 0, log.read_text()


def test_serve_stops_cleanly_on_sigterm_and_names_a_bad_config(tmp_path: Path, start_replica):
    replica = start_replica("r1", "vllm", "--time-scale", "0.05", "--answer-tokens", "4")
    target = {"name": "direct", "base_url": replica.url, "model": "lab-model", "interval_seconds": 1,
              "rounds": 2, "workload": {"system_tokens": 50, "turn_tokens": 10, "max_tokens": 4}}  # fmt: skip
    process, url, log = start_serve(tmp_path, target)
    config = tmp_path / "kvwatch.yaml"
    try:
        deadline = time.monotonic() + 20
        direct = {"target": "direct", "route_mode": "affinity", "outcome": "success"}
        while time.monotonic() < deadline:
            if sample(samples(url), "kvwatch_probe_sessions_total", **direct):
                break
            time.sleep(0.3)
        terminate(process, log)
    finally:
        stop(process)
    with Store(tmp_path / "kvwatch.db", readonly=True) as store:
        assert store.sessions(target="direct")

    config.write_text("targets: [{name: x, base_url: 'ftp://nope', model: m}]\n")
    bad = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli.main", "serve", "--config", str(config)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 1 and "targets[0].base_url" in bad.stderr


def test_the_cluster_label_overwrites_none_of_kvwatchs_own(tmp_path: Path):
    """Every label a real `kvwatch serve` exports, for probes and a gateway log alike, is one the config
    refuses as cluster_label, and the cluster's is on every sample besides them."""
    engine = StallingEngine()
    access_log = tmp_path / "access.log"
    line = {"time": "2027-01-15T08:00:00+00:00", "msec": time.time(), "listener": "affinity",
            "request": "POST /v1/chat/completions", "status": 200, "upstream_addr": "127.0.0.1:18001",
            "upstream_status": "200", "session_id": "s1", "session_source": "client", "request_time": 0.01,
            "upstream_response_time": "0.01"}  # fmt: skip
    access_log.write_text(json.dumps(line) + "\nnot json\n")
    gateway_log = {"name": "lab", "path": str(access_log)}
    try:
        process, url, log = start_serve(
            tmp_path, stalling_target(engine), gateway_logs=[gateway_log], exporter={"cluster": "c1"}
        )
        try:
            deadline = time.monotonic() + 30
            found = samples(url)
            while time.monotonic() < deadline and not (
                total(found, "kvwatch_probe_sessions_total") and total(found, "kvwatch_gateway_lines_total")
            ):
                time.sleep(0.3)
                found = samples(url)
            terminate(process, log)
        finally:
            stop(process)
    finally:
        engine.close()
    labels = [dict(pairs) for _, pairs in found]
    exported = {name for pairs in labels for name in pairs} - {"cluster"}
    own = {"target", "route_mode", "outcome", "log", "listener", "reason"}
    assert own <= exported <= label_names() | PROMETHEUS_LABELS
    assert all(pairs.get("cluster") == "c1" for pairs in labels)


def total(found: dict[tuple, float], name: str) -> float:
    """The sum of a metric's samples, whatever their labels."""
    return sum(value for (sample_name, _), value in found.items() if sample_name == name)


# --- durable measurements ---------------------------------------------------------------------------

USAGE = {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
ANSWER = [{"choices": [{"delta": {"role": "assistant", "content": "hi"}}]}, {"choices": [], "usage": USAGE}]


class StallingEngine:
    """An OpenAI-compatible server that answers every round at once until `stall()`; from then on no
    round 2 gets an answer (it hangs until the engine closes), so a run stays in flight with round 1
    finished. It counts the rounds asked of each path."""

    def __init__(self) -> None:
        self.stalling = False
        self.stalled = 0  # requests hanging now
        self.asked: Counter[str] = Counter()
        self._closed = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.asked[self.path] += 1
                if engine.stalling and len(body["messages"]) > 2:  # system, user: round 1
                    engine.stalled += 1
                    engine._closed.wait(30)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for event in [*map(json.dumps, ANSWER), "[DONE]"]:
                    self.wfile.write(f"data: {event}\n\n".encode())

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stall(self) -> None:
        self.stalling = True

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()


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


def stalling_target(engine: StallingEngine) -> dict:
    """One session a run, each second, of two rounds: round 2 is the one a stalling engine holds."""
    return {"name": "direct", "base_url": engine.url, "model": "m", "interval_seconds": 1,
            "sessions_per_run": 1, "rounds": 2, "block_size": 16,
            "workload": {"system_tokens": 20, "turn_tokens": 5, "max_tokens": 1}}  # fmt: skip


def probed_targets(url: str, timeout: float = 15) -> set[str]:
    """The targets an exporter exports, once each has a successful session."""
    deadline = time.monotonic() + timeout
    while True:
        sessions = [(dict(labels), n) for (name, labels), n in samples(url).items()
                    if name == "kvwatch_probe_sessions_total"]  # fmt: skip
        succeeded = {labels["target"]: n for labels, n in sessions if labels["outcome"] == "success"}
        if (succeeded and all(succeeded.values())) or time.monotonic() > deadline:
            return set(succeeded)
        time.sleep(0.2)


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


def step_wall_clock(monkeypatch, seconds: float) -> None:
    """Step the wall clock as every Python reader sees it (conftest.set_wall_clock); the monotonic clock,
    which no step moves, is left alone."""
    wall = time.time
    set_wall_clock(monkeypatch, lambda: wall() + seconds)


@pytest.mark.parametrize("step", [-3600, 3600])
def test_a_step_of_the_wall_clock_or_a_failing_run_does_not_delay_the_next_run_or_log_poll(
    tmp_path, monkeypatch, step
):
    """The wall clock steps an hour back, or forward, in the first run: the next run and the next
    gateway-log poll come on their intervals, not an hour later."""
    target = Target("direct", "http://127.0.0.1:9", "m", interval_seconds=1)
    config = Config(
        targets=(target,),
        gateway_logs=(GatewayLog("gateway", tmp_path / "access.log"),),
        exporter=ExporterSettings(f"127.0.0.1:{free_port()}"),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    service, runs, polls, stepped = Service(config), [], [], []

    async def scenario():
        stop = asyncio.Event()

        def stop_once_both_came_after_the_step() -> None:
            if stepped and runs[-1] > stepped[0] and polls and polls[-1] > stepped[0]:
                stop.set()

        async def probe(target: Target) -> None:
            runs.append(time.monotonic())
            if len(runs) == 1:
                step_wall_clock(monkeypatch, step)
                stepped.append(time.monotonic())
            stop_once_both_came_after_the_step()
            raise RuntimeError("a bug in a run")

        def poll() -> None:
            polls.append(time.monotonic())
            stop_once_both_came_after_the_step()

        monkeypatch.setattr(service, "probe", probe)
        monkeypatch.setattr(service, "poll_gateway_logs", poll)
        polls.append(time.monotonic())  # as if one came at the start: the first is due at once
        await asyncio.wait_for(service.run(stop), timeout=30)  # a guard against a hang, not a timing

    asyncio.run(scenario())
    assert runs[1] - runs[0] < 2  # the interval and its jitter, not the hour of the step
    last_poll_before, first_poll_after = max(p for p in polls if p <= stepped[0]), polls[-1]
    assert first_poll_after - last_poll_before < GATEWAY_POLL_SECONDS + 1


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
STREAM_BODY = b"".join(b"data: %s\n\n" % event.encode() for event in [*map(json.dumps, ANSWER), "[DONE]"])


def probed_once(tmp_path: Path, target: dict) -> tuple[dict[tuple, float], Path]:
    """The samples of a `kvwatch serve` of `target` once it has probed it, and its log; stopped cleanly."""
    process, url, log = start_serve(tmp_path, target)
    try:
        assert probed_targets(url) == {target["name"]}, log.read_text()
        found = samples(url)
        terminate(process, log)
    finally:
        stop(process)
    return found, log


def test_a_gateway_sending_non_ascii_headers_is_probed_stored_and_exported(tmp_path: Path):
    head = STREAM_HEAD + b"Server: caf\xc3\xa9-gateway\r\nX-Upstream: r\xff1\r\n\r\n"
    target = {"name": "direct", "base_url": "", "model": "m", "interval_seconds": 1, "sessions_per_run": 1,
              "rounds": 2, "workload": {"system_tokens": 20, "turn_tokens": 5, "max_tokens": 1}}  # fmt: skip
    with loopback_http(answering_bytes(head + STREAM_BODY)) as engine:
        found, _ = probed_once(tmp_path, {**target, "base_url": engine})
    route = {"target": "direct", "route_mode": "affinity"}
    assert sample(found, "kvwatch_probe_sessions_total", outcome="success", **route) >= 1
    assert sample(found, "kvwatch_probe_last_run_timestamp_seconds", **route) > time.time() - 60
    assert sample(found, "kvwatch_probe_backend_rounds_total", backend="r\xff1", **route) >= 2
    with Store(tmp_path / "kvwatch.db", readonly=True) as store:
        rounds = store.rounds(target="direct")
    assert rounds and {(r["error_kind"], r["backend"]) for r in rounds} == {(None, "r\xff1")}


def test_a_cron_target_runs_on_its_schedule(tmp_path: Path):
    """`schedule` instead of `interval_seconds`: every second by its seconds field, and exported with its
    longest gap as its interval, which the stale-probe alert reads."""
    target = {"name": "cron", "base_url": "", "model": "m", "schedule": "* * * * * *", "sessions_per_run": 1,
              "rounds": 2, "workload": {"system_tokens": 20, "turn_tokens": 5, "max_tokens": 1}}  # fmt: skip
    with loopback_http(answering_bytes(STREAM_HEAD + b"\r\n" + STREAM_BODY)) as engine:
        found, log = probed_once(tmp_path, {**target, "base_url": engine})
    route = {"target": "cron", "route_mode": "affinity"}
    assert sample(found, "kvwatch_probe_interval_seconds", **route) == 1.0
    assert sample(found, "kvwatch_probe_sessions_total", outcome="success", **route) >= 1
    assert "Traceback" not in log.read_text()


RUN_LINES = {
    "steady": r"steady: 1 session in \d+\.\d s, 100% on one replica, 0 failed; ",
    "cron": r"cron: 1 session in \d+\.\d s, 100% on one replica, 0 failed; ",
    "down": r"down: 1 session in \d+\.\d s, stickiness not judged, 1 failed \(http_error 1\); ",
}


def test_serve_says_each_schedule_at_start_and_sums_up_each_run(tmp_path: Path):
    """A real `kvwatch serve` of an interval target through a sticky engine, a cron target and a target
    whose engine answers 503: each schedule and first run logged as it starts, before any run, and one
    line per run with its sessions, time, stickiness and failures by kind."""
    workload = {"system_tokens": 20, "turn_tokens": 5, "max_tokens": 1}
    one = {"model": "m", "sessions_per_run": 1, "rounds": 2, "workload": workload}
    failing = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
    sticky = STREAM_HEAD + b"X-Upstream: 127.0.0.1:9001\r\n\r\n" + STREAM_BODY
    with loopback_http(answering_bytes(sticky)) as engine, loopback_http(answering_bytes(failing)) as down:
        targets = [
            {"name": "steady", "base_url": engine, "interval_seconds": 1, **one},
            {"name": "cron", "base_url": engine, "schedule": "* * * * * *", **one},
            {"name": "down", "base_url": down, "interval_seconds": 1, **one},
        ]
        process, _, log = start_serve(tmp_path, targets)
        try:
            deadline = time.monotonic() + 30
            while not all(re.search(p, log.read_text()) for p in RUN_LINES.values()):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            terminate(process, log)
        finally:
            stop(process)
    lines = log.read_text().splitlines()
    at = r"first run at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"
    schedules = [
        rf"probe run of steady: every 1 s, {at}",
        rf'probe run of cron: on "\* \* \* \* \* \*" \(UTC\), {at}',
        rf"probe run of down: every 1 s, {at}",
    ]

    def first(pattern: str) -> int:
        found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        assert found, (pattern, lines)
        return found[0]

    first_run = min(first(pattern) for pattern in RUN_LINES.values())
    assert all(first(pattern) < first_run for pattern in schedules), lines


def broken_read_chunk(*args) -> None:
    raise RuntimeError("a bug in reading a chunk")


def broken_next_run() -> None:
    raise RuntimeError("a bug in building the workload")


async def broken_learn(*args) -> None:
    raise RuntimeError("a bug in learning the block size")


@pytest.mark.parametrize(
    "module, name, broken, kinds",
    [
        pytest.param(probe_module, "_read_chunk", broken_read_chunk, ["internal_error"], id="in-a-round"),
        pytest.param(None, "next_run", broken_next_run, ["internal_error"], id="building-the-workload"),
        pytest.param(blocksize, "learn", broken_learn, [None, None], id="learning-the-block-size"),
    ],
)
def test_a_run_failing_unforeseen_is_recorded_counted_stored_and_dated(
    tmp_path, monkeypatch, module, name, broken, kinds
):
    workload = Workload(system_tokens=20, turn_tokens=5, max_tokens=1)
    with loopback_http(answering_bytes(STREAM_HEAD + b"\r\n" + STREAM_BODY)) as engine:
        target = Target(
            "direct", engine, "m", interval_seconds=60, sessions_per_run=1, rounds=2, workload=workload
        )
        config = Config(targets=(target,), exporter=ExporterSettings(f"127.0.0.1:{free_port()}"),
                        store=StoreSettings(tmp_path / "kvwatch.db"))  # fmt: skip
        service = Service(config)
        monkeypatch.setattr(module or service.conversations["direct"], name, broken)

        async def one_run() -> None:
            service._gate, service._stop = asyncio.Semaphore(1), asyncio.Event()
            async with ProbeClients() as service._clients:
                await service.probe(target)

        before = time.time()
        asyncio.run(asyncio.wait_for(one_run(), timeout=30))  # a guard against a hang, not a timing
    service.writer.close(5)
    route = {"target": "direct", "route_mode": "affinity"}
    registry = service.registry
    assert registry.get_sample_value("kvwatch_probe_last_run_timestamp_seconds", route) >= before
    errors = registry.get_sample_value("kvwatch_probe_errors_total", {**route, "kind": "internal_error"})
    assert errors == kinds.count("internal_error")
    (stored,) = service.store.sessions(target="direct")
    rounds = service.store.rounds(target="direct")
    assert [r["error_kind"] for r in rounds] == kinds and stored["ok"] == (None in kinds)
    assert all("RuntimeError at" in r["error_detail"] for r in rounds if r["error_kind"])
    service.store.close()


def test_the_store_settings_reach_the_writer(tmp_path, monkeypatch):
    settings = StoreSettings(tmp_path / "kvwatch.db", queue_capacity=3, retry_seconds=7.0, flush_seconds=2.5)
    target = Target("direct", "http://127.0.0.1:9", "m", interval_seconds=60)
    config = Config(targets=(target,), exporter=ExporterSettings(f"127.0.0.1:{free_port()}"), store=settings)
    service, flushed = Service(config), []
    assert (service.writer.capacity, service.writer.retry_seconds) == (3, 7.0)
    close = service.writer.close
    monkeypatch.setattr(service.writer, "close", lambda timeout: flushed.append(timeout) or close(timeout))
    stop = asyncio.Event()
    stop.set()
    asyncio.run(asyncio.wait_for(service.run(stop), timeout=30))
    assert flushed == [2.5]


def test_building_a_large_workload_leaves_the_event_loop_serving(tmp_path, monkeypatch):
    workload = Workload(system_tokens=100_000, turn_tokens=1000)  # about half a second of text to build
    target = Target("direct", "http://127.0.0.1:9", "m", interval_seconds=1, workload=workload)
    config = Config(
        targets=(target,),
        exporter=ExporterSettings(f"127.0.0.1:{free_port()}"),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    service, building, beats = Service(config), [], []
    conversations = service.conversations["direct"]
    build = conversations.next_run

    def timed_build():
        building.append(time.monotonic())
        try:
            return build()
        finally:
            building.append(time.monotonic())

    monkeypatch.setattr(conversations, "next_run", timed_build)

    async def scenario():
        stop = asyncio.Event()

        async def heartbeat():
            for _ in range(3000):  # 30 s at most
                beats.append(time.monotonic())
                if len(building) == 2:
                    stop.set()
                    return
                await asyncio.sleep(0.01)

        await asyncio.wait_for(asyncio.gather(service.run(stop), heartbeat()), timeout=40)

    asyncio.run(scenario())
    started, ended = building
    during = [beat for beat in beats if started < beat < ended]
    assert len(during) >= 3, f"the event loop ran {len(during)} times in {ended - started:.2f} s of building"
