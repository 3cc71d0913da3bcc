"""The Sessions page: the list and one session's rounds, and sessions judged by reuse."""

from __future__ import annotations

import json
from dataclasses import replace

from fake_dashboard import (
    NO_STORE,
    REPLICA_IDS,
    SESSIONS,
    SPAN_START,
    metrics,
    open_page,
    rounds_frame,
    session,
    sessions_frame,
    texts,
)
from fake_dashboard import fake as fake  # the fixtures
from fake_dashboard import no_component_scan as no_component_scan

from kvwatch.collectors.probe.records import SessionResult
from kvwatch.dashboard import ui
from kvwatch.prometheus import queries


def test_sessions_name_each_backend_by_replica_id_and_address(fake):
    fake.values[queries.REPLICA_IDS] = REPLICA_IDS
    fake.history = rounds_frame(
        {**SESSIONS, 4: session(4, "lab-round-robin", ["127.0.0.1:18011"] * 4, [0.4] * 4)}
    )
    at = open_page("sessions")
    at.selectbox(key="sessions_target").set_value("lab-round-robin").run()
    at.selectbox(key="sessions_pick").set_value(4).run()
    assert list(at.table[0].value["backend"]) == ["r2 (127.0.0.1:18011)"] * 4
    timeline = json.loads(at.get("plotly_chart")[0].proto.spec)["data"]
    assert "r2 (127.0.0.1:18011)" in [cells["name"] for cells in timeline]


def test_sessions_list_and_drill_into_one(fake):
    at = open_page("sessions")
    assert not at.exception
    assert "2 sessions" in texts(at) and "100% stayed on one replica" in texts(at)
    assert "2 sessions judged by replica identity: each round named the replica that served it." in texts(at)
    assert "judged by reuse" not in texts(at)
    assert list(at.dataframe[0].value["evidence"]) == ["replica", "replica"]
    assert list(at.dataframe[0].value["id"]) == [2, 1]
    assert list(at.dataframe[0].value["interrupted"]) == [False, False]
    assert list(at.dataframe[0].value["in_flight"]) == [False, False]
    at.selectbox(key="sessions_target").set_value("lab-round-robin").run()
    assert "5 backend switches; 1 failed." in texts(at)  # session 4 failed in round 4: r2, r3, r4
    at.selectbox(key="sessions_pick").set_value(4).run()
    detail = at.table[0].value
    assert list(detail["backend"]) == ["r2", "r3", "r4", "r1"]
    assert list(detail["cached tokens"]) == [0, 0, 0, 0]
    assert list(detail["ideal cached tokens"]) == [0, 1300, 1600, 1900]
    assert detail["error"].iloc[-1] == "timeout"


def by_reuse(number: int, lost_round: int | None = None) -> SessionResult:
    """A session through a route that names no replica (a SageMaker endpoint), judged by its warm
    rounds' reuse: each cached all a replica holding the conversation would have, but `lost_round`."""
    judged = session(number, "lab-affinity", [None] * 4, [0.40, 0.05, 0.05, 0.05])
    rounds = tuple(replace(r, cached_tokens=0) if r.round == lost_round else r for r in judged.rounds)
    return replace(judged, rounds=rounds)


# lab-affinity names no replica: its warm rounds ideally cache 1300, 1600 and 1900 tokens; session 6's
# third round cached nothing. lab-round-robin's rounds still name theirs.
BY_REUSE = {
    **{i: s for i, s in SESSIONS.items() if s.target != "lab-affinity"},
    5: by_reuse(5),
    6: by_reuse(6, 3),
}
REUSE_WORDS = (
    "2 sessions judged by reuse: no round named its replica (SageMaker names none); their warm rounds "
    "cached 8,000 of the 9,600 tokens a replica holding the conversation would have (83%), and 5 of 6 "
    "warm rounds at least 50% of theirs."
)


def test_sessions_judged_by_reuse_say_so_with_their_warm_rounds_cached_and_ideal_tokens(fake):
    fake.probed, fake.history = BY_REUSE, rounds_frame(BY_REUSE)
    at = open_page("sessions")
    assert not at.exception
    assert REUSE_WORDS in texts(at) and "replica identity" not in texts(at)
    table = at.dataframe[0].value
    assert list(table["id"]) == [6, 5] and list(table["evidence"]) == ["reuse", "reuse"]
    assert list(table["sticky"]) == [False, True]
    assert list(table["warm_rounds"]) == [3, 3]
    assert list(table["warm_cached_tokens"]) == [1300 + 1900, 1300 + 1600 + 1900]
    assert list(table["warm_ideal_cached_tokens"]) == [1300 + 1600 + 1900] * 2


def test_the_overview_says_what_each_routes_stickiness_was_judged_by(fake):
    fake.probed = BY_REUSE
    said = texts(open_page("overview"))
    since = f"Since {ui.as_of(SPAN_START)}: "
    assert f"{since}{REUSE_WORDS}" in said
    assert (
        f"{since}2 sessions judged by replica identity: each round named the replica that served it." in said
    )
    fake.store = NO_STORE
    at = open_page("overview")
    assert not at.exception and metrics(at)["Sessions on one replica"] == ["100%", "0%"]
    assert f"What each route's stickiness was judged by is not shown: {NO_STORE}" in texts(at)
    assert "judged by reuse" not in texts(at)


def test_sessions_read_the_rounds_of_the_timeline_and_the_picked_session_only(fake):
    at = open_page("sessions")
    at.selectbox(key="sessions_target").set_value("lab-round-robin").run()
    fake.rounds_read.clear()
    at.selectbox(key="sessions_pick").set_value(4).run()
    oldest_shown = sessions_frame().query("target == 'lab-round-robin'")["started_at"].min().timestamp()
    assert fake.rounds_read == [(oldest_shown, "lab-round-robin", None), (SPAN_START, "lab-round-robin", 4)]
