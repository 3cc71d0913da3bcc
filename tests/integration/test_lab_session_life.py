"""A probe session's whole life through `kvwatch lab up --gateway sagemaker` (one lab with a short session
TTL, one with a small session table), driven by the real AWS SDK (botocore): idled past the TTL, the
session is refused as expired, its next round runs in a new one (cold where it landed on another
replica), the rounds after stick to it; closed, it is gone from the front's table. `kvwatch serve`'s
scheduled probe stores each session's life so. The table's series (llm-d's names) reach the lab's real
Prometheus and its recording rules, equal to the front's ground truth."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from botocore.exceptions import ClientError
from sagemaker_client import ENDPOINT, close_session, endpoint, open_session, use_lab_credentials

from kvwatch.collectors.engines import Exposition, detect_flavour
from kvwatch.collectors.probe.targets.sagemaker import SageMakerEndpoint
from kvwatch.config.settings import Config, ExporterSettings, Lifecycle, StoreSettings, Target
from kvwatch.lab.gateways.sagemaker import LAB_REGION
from kvwatch.lab.state import LabState
from kvwatch.prometheus import queries
from kvwatch.serve import scheduler
from kvwatch.store.history import Store
from labs import Lab
from processes import free_port, http_get, kvwatch, wait_for

TTL_S = 2.0
IDLE_S = TTL_S + 1.5  # past the TTL, by more than a Prometheus scrape or a clock second
TABLE_SIZE = 2
SESSIONS = 2


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch, tmp_path):
    use_lab_credentials(monkeypatch, tmp_path)


SAGEMAKER_LAB = (
    "--gateway", "sagemaker", "--replicas", "2", "--users", "0", "--no-probes", "--time-scale", "0.1",
    "--rule-time-scale", "0.1",
)  # fmt: skip


@pytest.fixture(scope="module")
def lab(start_lab):
    """Sessions idle out after TTL_S: what a session's life is tested against."""
    return start_lab(*SAGEMAKER_LAB, "--session-ttl", f"{TTL_S:g}")


@pytest.fixture(scope="module")
def table_lab(start_lab):
    """A small table whose sessions never idle out: full for as long as a test looks at it, however slowly
    a busy machine lets it look (with TTL_S, its sessions would expire between two steps)."""
    return start_lab(*SAGEMAKER_LAB, "--session-table-size", str(TABLE_SIZE))


def admin_url(lab: Lab) -> str:
    return f"http://127.0.0.1:{LabState.load(lab.state_dir).ports.gateway_admin}"


def table(lab: Lab):
    """The front's session table as kvwatch reads it (the llm-d flavour), and its pins (ground truth)."""
    text = http_get(f"{admin_url(lab)}/metrics", timeout=5).text
    exposition = Exposition(text)
    snapshot = detect_flavour(exposition).read(exposition, 0.0)
    return snapshot.session_table, http_get(f"{admin_url(lab)}/-/lab-sessions", timeout=5).json()


def served_by(lab: Lab) -> dict[str, set[str]]:
    """Ground truth: the replicas that served each SageMaker session id's chat rounds."""
    found: dict[str, set[str]] = {}
    for replica in lab.status["replicas"]:
        for record in http_get(f"{replica['url']}/lab/ground-truth", timeout=5).json()["records"]:
            if "prompt_tokens" in record and record.get("session_id"):
                found.setdefault(record["session_id"], set()).add(replica["id"])
    return found


def probe(lab: Lab, *options: str) -> list[dict]:
    result = kvwatch(
        "probe", *endpoint(lab.affinity, lab.status["model"]), "--json", "--sessions", str(SESSIONS),
        "--rounds", "3", *options, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)["sessions"]


def test_an_idle_past_the_ttl_is_an_expiry_then_a_round_in_a_new_session_then_a_re_pin(lab):
    before, _ = table(lab)
    sessions = probe(lab, "--idle-after-round", "1", "--idle-seconds", f"{IDLE_S:g}", "--check-close")
    truth = served_by(lab)
    for session in sessions:
        life = session["life"]
        assert session["session_losses"] == [{"round": 2, "kind": "expired"}], session
        assert (life["idled_after_round"], life["expiry"], life["repinned"]) == (1, "expired", True), life
        first, woken, last = session["rounds"]
        (old_home,) = truth[first["session_id_sent"]]
        (new_home,) = truth[woken["session_id_sent"]]  # the new session: round 2 and round 3
        assert last["session_id_sent"] == woken["session_id_sent"] != first["session_id_sent"]
        # Cold exactly where the new session landed on another replica than the history's.
        assert life["cold"] is (new_home != old_home), (life, old_home, new_home)
        assert life["as_expected"] is life["cold"]
        assert session["close_gone"] is True
    after, pins = table(lab)
    assert pins == {} and after.bindings == 0  # every session closed: gone from the table
    idle = after.invalidations["idle"] - before.invalidations.get("idle", 0)
    closes = after.invalidations["close"] - before.invalidations.get("close", 0)
    assert (idle, closes) == (SESSIONS, SESSIONS)


def stored_lives(lab: Lab, path, monkeypatch) -> list[tuple[dict, list[dict]]]:
    """One run of `kvwatch serve`'s probe of a SageMaker target whose sessions idle past the TTL after
    round 1 and check their close (its phase now, not its name's): each stored session and its rounds,
    once all have ended."""
    monkeypatch.setattr(scheduler, "phase", lambda name, interval: (time.time() + 0.5) % interval)
    life = Target(
        "life", model=lab.status["model"], kind="sagemaker", rounds=3, sessions_per_run=SESSIONS,
        sagemaker=SageMakerEndpoint(ENDPOINT, LAB_REGION, endpoint_url=lab.affinity), interval_seconds=3600,
        lifecycle=Lifecycle(idle_after_round=1, idle_seconds=IDLE_S, check_close=True),
    )  # fmt: skip
    config = Config(
        targets=(life,), exporter=ExporterSettings(f"127.0.0.1:{free_port()}"), store=StoreSettings(path)
    )
    service, loop, stop = scheduler.Service(config), asyncio.new_event_loop(), asyncio.Event()
    serving = threading.Thread(target=loop.run_until_complete, args=(service.run(stop),))
    serving.start()
    try:
        with Store(path, readonly=True) as reader:

            def ended() -> list[dict]:
                sessions = reader.sessions(target="life")
                done = len(sessions) == SESSIONS and not any(s["in_flight"] for s in sessions)
                return done and [(s, reader.rounds(session=s["id"])) for s in sessions]

            return wait_for(ended, "the run's sessions stored as ended", 120, 0.5)
    finally:
        loop.call_soon_threadsafe(stop.set)
        serving.join(60)
        assert not serving.is_alive(), "kvwatch serve did not stop"
        loop.close()


def test_serve_stores_each_sessions_life_as_the_front_and_the_replicas_lived_it(lab, tmp_path, monkeypatch):
    stored = stored_lives(lab, tmp_path / "kvwatch.db", monkeypatch)
    truth = served_by(lab)
    for session, rounds in stored:
        first, woken, last = rounds
        (old_home,) = truth[first["session_id_sent"]]
        (new_home,) = truth[woken["session_id_sent"]]  # the new session's, round 2 and round 3
        assert last["session_id_sent"] == woken["session_id_sent"] != first["session_id_sent"]
        moved = new_home != old_home
        named = None if woken["backend"] is None else (woken["backend"] != first["backend"])
        assert named in (None, moved), (named, old_home, new_home)  # a named replica is the true one
        life = {column: value for column, value in session.items() if column.startswith(("idle_", "clos"))}
        assert life == {
            "closed": True, "close_gone": True, "idle_after_round": 1, "idle_seconds": IDLE_S,
            "idle_expiry": "expired", "idle_cold": moved, "idle_new_replica": named, "idle_repinned": True,
            "idle_as_expected": moved,
        }, (life, old_home, new_home)  # fmt: skip
        assert session["session_losses"] == ((2, "expired"),)
    assert table(lab)[1] == {}  # every session closed: gone from the front's table


def recorded(lab: Lab, query: str) -> float | None:
    answer = http_get(f"{lab.status['prometheus']}/api/v1/query", params={"query": query}, timeout=5)
    result = answer.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_a_full_table_refuses_a_new_session_and_prometheus_records_it(table_lab, sagemaker_runtime):
    bindings = f'{queries.INSTANCE_ROUTER_SESSION_BINDINGS}{{job="sagemaker"}}'
    rejections = f'{queries.INSTANCE_ROUTER_SESSION_BIND_REJECTIONS}{{job="sagemaker"}}'
    # A rate needs a sample before the increase: the table is being recorded before it fills.
    wait_for(lambda: recorded(table_lab, rejections) == 0, "Prometheus recording the table", 30, 0.5)
    client = sagemaker_runtime(table_lab.affinity)
    opened = [open_session(client)[0] for _ in range(TABLE_SIZE)]
    try:
        with pytest.raises(ClientError) as refused:
            open_session(client)
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        sessions, pins = table(table_lab)
        assert set(pins) == set(opened) and sessions.bindings == TABLE_SIZE
        assert sessions.bind_rejections == 1
        wait_for(
            lambda: recorded(table_lab, bindings) == TABLE_SIZE, "Prometheus recorded the bindings", 30, 0.5
        )
        wait_for(
            lambda: (recorded(table_lab, rejections) or 0) > 0, "Prometheus recorded the rejection", 30, 0.5
        )
    finally:
        for session_id in opened:
            close_session(client, session_id)
    assert table(table_lab)[1] == {}


def firing(lab: Lab, name: str) -> list[dict]:
    alerts = http_get(f"{lab.status['prometheus']}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_a_stalled_kv_event_index_fires_its_alert_and_the_heal_resyncs_it(table_lab, sagemaker_runtime):
    """The front's index (lag 0 while it follows) stalls: its lag grows past 5 s, each request it routes
    is a gap, and KVWatchRouterIndexStalled fires through the lab's real Prometheus; healed, it resyncs."""
    admin = admin_url(table_lab)

    def health():
        exposition = Exposition(http_get(f"{admin}/metrics", timeout=5).text)
        return detect_flavour(exposition).read(exposition, 0.0).index_health

    assert (health().lag_seconds, health().degraded_ranks) == (0, 0)
    result = table_lab.cli("fault", "stall-index")
    assert result.returncode == 0, result.stderr
    try:
        client = sagemaker_runtime(table_lab.affinity)
        session_id, _ = open_session(client)
        close_session(client, session_id)
        stalled = health()
        assert (stalled.gaps, stalled.degraded_ranks) == (2, 2) and stalled.lag_seconds > 0  # 2 instances
        alert = wait_for(
            lambda: firing(table_lab, "KVWatchRouterIndexStalled"), "KVWatchRouterIndexStalled fired", 90
        )
        assert {a["labels"]["job"] for a in alert} == {"sagemaker"}
    finally:
        assert table_lab.cli("heal").returncode == 0
    healed = health()
    assert (healed.lag_seconds, healed.degraded_ranks, healed.resyncs) == (0, 0, 1)
