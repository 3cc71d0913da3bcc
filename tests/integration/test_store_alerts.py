"""Alertmanager's notifications in the history: each alert stored once, a malformed one skipped and the
others kept; and retention forgets what is older than it. Each test runs against SQLite and against a
real PostgreSQL server (tests/postgres.py)."""

from __future__ import annotations

import copy

import pytest
from store_cases import location as location  # the fixtures
from store_cases import open_store, session, webhook
from store_cases import store as store

from kvwatch.store.history import AlertsAdded

DAY = 86400.0


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
