"""kvwatch's SageMaker target against `kvwatch lab up --gateway sagemaker`, through the real AWS SDK
(botocore): `kvwatch probe` judges sessions by reuse and says when they are lost and reopened, the lab's
`kvwatch serve` probes the endpoint and KVWatchSessionReuseLost reaches Alertmanager when the front
ignores session ids, `kvwatch experiment` sets the endpoint without sessions against the same with them,
and the doctor names stateful sessions not enabled. Simulated replicas here (fast); real vLLM in
test_sagemaker_vllm.py."""

from __future__ import annotations

import json
import re
import sys
from itertools import pairwise

import pytest
import sagemaker_client as sagemaker
import streamlit as st
from streamlit.testing.v1 import AppTest

from conftest import behind_a_dead_proxy
from kvwatch.dashboard import data
from kvwatch.lab.engine import ReplicaSettings
from kvwatch.prometheus import panel_queries, queries
from kvwatch.store.history import Store
from labs import Lab
from paths import REPO
from processes import http_get, kvwatch, wait_for

REPLICAS = ("r1", "r2", "r3", "r4")


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch, tmp_path):
    sagemaker.use_lab_credentials(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def lab(start_lab):
    """Four simulated replicas behind the front, the lab's serve probing its endpoint every 5 s. Started
    from a shell with settings of the user's own, which the lab's serve must not take up: a profile the
    lab does not have (botocore would refuse to start with it), a session token and a proxy."""
    with behind_a_dead_proxy(), pytest.MonkeyPatch.context() as users_shell:
        users_shell.setenv("AWS_PROFILE", "a-profile-of-the-users")
        users_shell.setenv("AWS_SESSION_TOKEN", "a-token-of-the-users")
        return start_lab("--gateway", "sagemaker", "--replicas", str(len(REPLICAS)), "--users", "0")


def records(lab: Lab, session_ids: set[str]) -> dict[str, list[dict]]:
    """Each replica's ground-truth chat records of these sessions."""
    found = {}
    for replica in lab.status["replicas"]:
        truth = http_get(f"{replica['url']}/lab/ground-truth", timeout=5).json()["records"]
        found[replica["id"]] = [
            r for r in truth if "prompt_tokens" in r and r.get("session_id") in session_ids
        ]
    return found


def prometheus(lab: Lab, query: str) -> list[dict]:
    """The lab Prometheus's instant answer to a board's query, every target, a 30 s rate window."""
    filled = panel_queries.fill_variables(query, window="30s", time_range="5m")
    answer = http_get(f"{lab.status['prometheus']}/api/v1/query", params={"query": filled}, timeout=10)
    return answer.json()["data"]["result"]


def test_probe_through_botocore_is_sticky_by_reuse_on_the_replica_that_opened_each_session(lab):
    report, result = sagemaker.probe_json(lab, "--sessions", "3", "--rounds", "4")
    assert result.returncode == 0, result.stderr
    sagemaker.assert_sticky_by_reuse(report, block=16)  # the simulator's block
    ids = {s["session_id"] for s in report["sessions"]}
    assert len(ids) == 3
    served = records(lab, ids)
    for session_id in ids:  # ground truth: all four rounds on one replica, which knew the session
        holders = [
            replica for replica, found in served.items() if any(r["session_id"] == session_id for r in found)
        ]
        assert len(holders) == 1, (session_id, served)
        assert sum(r["session_id"] == session_id for r in served[holders[0]]) == 4
    text = kvwatch("probe", *sagemaker.endpoint(lab.affinity), "--sessions", "2", "--rounds", "3")
    assert text.returncode == 0, text.stderr
    assert "stateful sessions" in text.stdout and "Sessions closed at the end: 2 of 2." in text.stdout


def page(name: str, lab: Lab, monkeypatch) -> AppTest:
    """A dashboard page on the lab's own config: its store, its Prometheus."""
    monkeypatch.setattr(sys, "argv", ["app.py", "--config", str(lab.state_dir / "kvwatch.yaml")])
    st.cache_data.clear()
    at = AppTest.from_file(str(REPO / "dashboard" / "app_pages" / f"{name}.py"), default_timeout=60).run()
    assert not at.exception, at.exception
    return at


def captions(at: AppTest) -> list[str]:
    return [caption.value for caption in at.caption]


def warm_truth(served: list[dict], block: int) -> tuple[int, int]:
    """What a session's warm rounds cached, as the replica recorded them, and what a replica holding the
    conversation would have cached: each round's previous prompt and answer in whole blocks, below its
    own prompt's last token."""
    cached = sum(r["cached_tokens"] for r in served[1:])
    held = [
        min((before["prompt_tokens"] + before["completion_tokens"]) // block * block,
            (after["prompt_tokens"] - 1) // block * block)
        for before, after in pairwise(served)
    ]  # fmt: skip
    return cached, sum(held)


def test_the_store_and_the_pages_say_each_session_was_judged_by_reuse_as_the_replicas_cached(
    lab, monkeypatch
):
    """The lab's serve stores each session through the endpoint judged by reuse, with its warm rounds'
    cached and ideal tokens; the Sessions page and the Overview show them, and they are what the replica
    holding each session cached and what its prompts and answers let it cache."""

    def stored() -> list[dict] | None:
        with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
            done = [s for s in store.sessions(target="lab-affinity") if not s["in_flight"]]
        return done if len(done) >= 2 else None

    done = wait_for(stored, "two stored sessions of lab-affinity")
    assert all(s["evidence"] == "reuse" for s in done)
    at = page("sessions", lab, monkeypatch)
    assert at.selectbox(key="sessions_target").value == "lab-affinity"
    # Every session of the target the page shows, those still running too: the caption speaks of them all.
    shown = at.dataframe[0].value
    assert set(shown[~shown["in_flight"]]["evidence"]) == {"reuse"}, shown  # a running one may be unjudged
    by_reuse = shown[shown["evidence"] == "reuse"]
    judged = by_reuse[by_reuse["warm_rounds"] > 0]
    assert len(judged) >= 2, shown
    truth = records(lab, set(judged["session_id"]))
    for row in judged.to_dict("records"):
        holders = {
            replica
            for replica, found in truth.items()
            if any(r["session_id"] == row["session_id"] for r in found)
        }
        assert len(holders) == 1, (row, holders)  # ground truth: sticky
        served = sorted(
            (r for r in truth[holders.pop()] if r["session_id"] == row["session_id"]), key=lambda r: r["time"]
        )
        cached, ideal = warm_truth(served[: 1 + row["warm_rounds"]], ReplicaSettings.block_size)
        assert (row["warm_cached_tokens"], row["warm_ideal_cached_tokens"]) == (cached, ideal), (row, served)
        assert cached == ideal > 0 and row["sticky"]
    cached, ideal = int(judged["warm_cached_tokens"].sum()), int(judged["warm_ideal_cached_tokens"].sum())
    rounds = int(judged["warm_rounds"].sum())
    said = (
        f"{len(by_reuse)} sessions judged by reuse: no round named its replica (SageMaker names none); their "
        f"warm rounds cached {cached:,} of the {ideal:,} tokens a replica holding the conversation would "
        f"have (100%), and {rounds} of {rounds} warm rounds at least 50% of theirs."
    )
    assert any(said in caption for caption in captions(at)), captions(at)  # then what the running ones are

    overview = [c for c in captions(page("overview", lab, monkeypatch)) if "judged by" in c]
    assert len(overview) == 2, overview  # one for each route, both judged by reuse alone
    affinity = re.search(
        r"cached ([\d,]+) of the ([\d,]+) tokens .* \(100%\), and (\d+) of (\d+) warm", overview[0]
    )
    assert affinity and (affinity[1], affinity[3]) == (affinity[2], affinity[4]), overview
    assert "judged by replica identity" not in " ".join(overview)


@pytest.fixture(scope="module")
def quiet_lab(start_lab):
    """One slow simulated replica and no serve probing: the only session open is the test's."""
    return start_lab("--gateway", "sagemaker", "--replicas", "1", "--users", "0", "--no-probes",
                     "--time-scale", "4")  # fmt: skip


def test_expired_sessions_are_reported_and_reopened(quiet_lab):
    """The fault expires the open session once its first round is done, while the probe runs on."""

    def expire(_probe) -> None:
        assert "every open session expired (1 in all)" in sagemaker.fault(quiet_lab, "expire-sessions")

    sagemaker.probe_through_an_expiry(quiet_lab, ["--max-tokens", "64"], expire)
    assert quiet_lab.cli("heal").returncode == 0


# The Overview's tiles of a route judged by reuse: the share KVWatchSessionReuseLost fires on, the warm
# reuse beside it.
TILES = {
    "Sessions reusing their history": queries.REUSED_SESSIONS_RATIO,
    "Warm rounds' reuse": queries.WARM_REUSE_RATIO,
}


def reuse_tiles(lab: Lab, monkeypatch, verdict: str) -> tuple[str, str] | None:
    """lab-affinity's share of sessions that kept their reuse and its warm rounds' reuse on the Overview,
    rendered on the lab's own config, once the share's verdict reads `verdict` (the page reads Prometheus
    on its refresh grid, a little behind); None before, and when the render straddled two grid times.
    Both checked against the lab Prometheus at the page's time."""
    at_time = data.now()
    at = page("overview", lab, monkeypatch)
    said = [m.value for m in at.markdown]
    shown: dict[str, str] = {}
    for metric in at.metric:  # lab-affinity's come first, then lab-round-robin's
        if metric.label in TILES:
            shown.setdefault(metric.label, metric.value)
    if data.now() != at_time or not (len(shown) == 2 and any(text.startswith(verdict) for text in said)):
        return None
    assert not any("KVWatchSessionAffinityBroken" in text for text in said), said  # it cannot apply here
    for label, query in TILES.items():
        params = {"query": query, "time": at_time}
        answer = http_get(f"{lab.status['prometheus']}/api/v1/query", params=params, timeout=10).json()
        (held,) = [
            float(r["value"][1]) for r in answer["data"]["result"] if r["metric"]["target"] == "lab-affinity"
        ]
        assert shown[label] == f"{held:.0%}", (label, shown, held)
    return shown["Sessions reusing their history"], shown["Warm rounds' reuse"]


def test_the_lab_serve_probes_the_endpoint_and_the_reuse_alert_reaches_alertmanager(lab, monkeypatch):
    """...and the Overview judges the route by that reuse with the alert's verdict, green then red."""
    exporter = f"{lab.status['exporter']}/metrics"

    def reuse_series() -> list[str]:
        lines = http_get(exporter, timeout=5).text.splitlines()
        return [line for line in lines if line.startswith('kvwatch_probe_warm_reuse_ratio{evidence="reuse"')]

    series = wait_for(lambda: [s for s in reuse_series() if 'target="lab-affinity"' in s], "a probed run")
    assert float(series[0].rsplit(" ", 1)[1]) == 1.0, series

    # The boards' evidence panels, as the lab's Prometheus answers them: both routes judged by reuse alone.
    def evidence() -> dict[tuple[str, str], float] | None:
        found = {(r["metric"]["target"], r["metric"]["evidence"]): float(r["value"][1])
                 for r in prometheus(lab, panel_queries.PROBE_EVIDENCE_SHARE)}  # fmt: skip
        return found if {target for target, _ in found} == {"lab-affinity", "lab-round-robin"} else None

    shares = {key: share for key, share in wait_for(evidence, "the evidence shares").items() if share}
    assert shares == {("lab-affinity", "reuse"): 1.0, ("lab-round-robin", "reuse"): 1.0}, shares
    reuse = prometheus(lab, panel_queries.PROBE_WARM_REUSE)
    assert {(r["metric"]["target"], r["metric"]["evidence"]) for r in reuse} == {
        ("lab-affinity", "reuse"),
        ("lab-round-robin", "reuse"),
    }, reuse
    assert not sagemaker.active_alerts(lab, "KVWatchSessionReuseLost")
    healthy = ":green[Sessions reuse their history"
    shown = wait_for(lambda: reuse_tiles(lab, monkeypatch, healthy), "a green reuse verdict")
    assert shown == ("100%", "100%"), shown
    sagemaker.fault(lab, "ignore-session-ids")
    try:
        (alert,) = wait_for(
            lambda: sagemaker.active_alerts(lab, "KVWatchSessionReuseLost"),
            "KVWatchSessionReuseLost at Alertmanager",
        )
        assert alert["labels"]["target"] == "lab-affinity", alert
        assert alert["labels"]["severity"] == "critical"
        assert not sagemaker.active_alerts(lab, "KVWatchSessionAffinityBroken")  # one break, one alert
        fires = ":red[KVWatchSessionReuseLost fires"
        wait_for(lambda: reuse_tiles(lab, monkeypatch, fires), "a red reuse verdict on the Overview")
    finally:
        assert lab.cli("heal").returncode == 0


def test_experiment_sessions_against_no_sessions_gives_the_articles_table(lab, tmp_path):
    out = tmp_path / "experiment"
    result = kvwatch(
        "experiment", *sagemaker.endpoint(lab.affinity), "--out", str(out), "--sessions", "6",
        "--rounds", "4", "--system-tokens", "600", "--turn-tokens", "100", "--max-tokens", "8", "--seed", "5",
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows, routes = sagemaker.experiment_tables(out, sessions=6, rounds=4)
    for number in (2, 3, 4):
        with_sessions, without = rows["session", number], rows["no_session", number]
        assert float(with_sessions["cached_ratio"]) >= float(without["cached_ratio"]), (number, rows)
    assert float(routes["session"]["sticky_share"]) == 1.0, routes
    report = (out / "report.md").read_text()
    assert "seed 5" in report and "no_session" in report, report


def test_doctor_names_stateful_sessions_disabled(lab):
    assert "without SAGEMAKER_ENABLE_STATEFUL_SESSIONS" in sagemaker.fault(lab, "disable-sessions")
    try:
        result = kvwatch("doctor", *sagemaker.endpoint(lab.affinity), "--json", timeout=180)
        assert result.returncode == 1, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert "stateful_sessions_disabled" in report["causes"], report
        text = kvwatch("doctor", *sagemaker.endpoint(lab.affinity), timeout=180).stdout
        assert "stateful sessions not enabled" in text, text
        assert "SAGEMAKER_ENABLE_STATEFUL_SESSIONS=true" in text, text
    finally:
        assert lab.cli("heal").returncode == 0
