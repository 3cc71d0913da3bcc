"""The exporter turns probe results into the metric contract: kvwatch_* names, base units, bounded labels."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import logging
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest
from test_store import round_result, webhook

from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.config.settings import Config, ExporterSettings, GatewayLog, StoreSettings, Target
from kvwatch.core.labels import MAX_LABEL_VALUE_LENGTH, MAX_VALUES_PER_LABEL, OTHER
from kvwatch.serve.endpoints import (
    MAX_WEBHOOK_BYTES,
    REFUSED_POSTS_KEY,
    make_app,
    open_webhook_warning,
)
from kvwatch.serve.exporter import ProbeCollector, ProbeResults
from kvwatch.serve.scheduler import Service
from kvwatch.store.history import Store

ROUTE = {"target": "lab-affinity", "route_mode": "affinity"}


SESSION_ID = round_result(1).session_id_sent


def session(*rounds: RoundResult) -> SessionResult:
    return SessionResult("lab-affinity", "affinity", SESSION_ID, 1000.0, 1010.0, tuple(rounds))


@pytest.fixture
def exporter():
    results = ProbeResults()
    registry = CollectorRegistry()
    registry.register(ProbeCollector(results, {"lab-affinity": 30}))
    return results, registry


def value(registry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, {**ROUTE, **labels})


def session_counts(registry) -> dict[str, float | None]:
    """The route's sessions by outcome and by stickiness, and the backend switches within them."""
    sessions, stickiness = "kvwatch_probe_sessions_total", "kvwatch_probe_stickiness_sessions_total"
    return {
        "success": value(registry, sessions, outcome="success"),
        "failure": value(registry, sessions, outcome="failure"),
        "sticky": value(registry, stickiness, sticky="true"),
        "not_sticky": value(registry, stickiness, sticky="false"),
        "unknown": value(registry, stickiness, sticky="unknown"),
        "switches": value(registry, "kvwatch_probe_backend_switches_total"),
    }


def test_a_sticky_session_is_counted_round_by_round(exporter):
    results, registry = exporter
    rounds = (round_result(n, ideal_cached_tokens=1200 * (n - 1)) for n in (1, 2, 3))  # ideal != cached
    results.add_run(("lab-affinity", "affinity"), [session(*rounds)], 1000, 1010)
    assert session_counts(registry) == dict(
        success=1, failure=0, sticky=1, not_sticky=0, unknown=0, switches=0
    )
    assert value(registry, "kvwatch_probe_session_id_echo_sessions_total", echoed="true") == 1
    assert value(registry, "kvwatch_probe_cached_tokens_total", round="3") == 2368
    assert value(registry, "kvwatch_probe_ideal_cached_tokens_total", round="3") == 2400
    assert value(registry, "kvwatch_probe_ttft_seconds_count", round="2") == 1
    assert value(registry, "kvwatch_probe_ttft_seconds_bucket", round="2", le="0.05") == 1
    assert value(registry, "kvwatch_probe_ttft_seconds_bucket", round="1", le="0.25") == 0
    assert value(registry, "kvwatch_probe_last_ttft_seconds", round="1") == 0.412
    assert value(registry, "kvwatch_probe_last_run_timestamp_seconds") == 1010
    assert value(registry, "kvwatch_probe_success") == 1
    assert value(registry, "kvwatch_probe_sticky_ratio", evidence="replica") == 1
    assert value(registry, "kvwatch_probe_interval_seconds") == 30


def test_a_configured_route_is_exported_from_the_start_before_any_result(exporter, monkeypatch):
    """KVWatchProbeNoResults fires on these for a route whose runs never finish: no last-run series."""
    results, registry = exporter
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    results.declare(("lab-affinity", "affinity"), rounds=3)
    assert value(registry, "kvwatch_probe_watched_since_timestamp_seconds") == 1000
    assert value(registry, "kvwatch_probe_interval_seconds") == 30
    assert value(registry, "kvwatch_probe_last_run_timestamp_seconds") is None
    monkeypatch.setattr(time, "time", lambda: 1090.0)  # a run, and a declaration again: the start stays
    results.add_run(("lab-affinity", "affinity"), [session(round_result(1))], 1080, 1090)
    results.declare(("lab-affinity", "affinity"), rounds=3)
    assert value(registry, "kvwatch_probe_watched_since_timestamp_seconds") == 1000


def test_switches_errors_and_totals_accumulate_across_runs(exporter):
    results, registry = exporter
    switching = session(round_result(1, "r1"), round_result(2, "r2"), round_result(3, "r1"))
    failing = session(round_result(1), round_result(2, status=500, error_kind="timeout", ttft_seconds=None))
    results.add_run(("lab-affinity", "affinity"), [switching], 1000, 1010)
    results.add_run(("lab-affinity", "affinity"), [failing], 1020, 1030)
    assert session_counts(registry) == dict(
        success=1, failure=1, sticky=0, not_sticky=1, unknown=1, switches=2
    )
    assert value(registry, "kvwatch_probe_errors_total", kind="timeout") == 1
    assert value(registry, "kvwatch_probe_rounds_total", round="1") == 2
    # The last-run gauges describe only the latest run.
    assert value(registry, "kvwatch_probe_success") == 0
    assert value(registry, "kvwatch_probe_last_run_timestamp_seconds") == 1030


def test_a_name_that_does_not_resolve_and_a_scheme_mismatch_are_counted_by_their_own_kinds(exporter):
    results, registry = exporter
    route, kinds = (
        ("lab-affinity", "affinity"),
        ("dns_error", "tls_mismatch", "connection_refused", "tls_error"),
    )

    def counted() -> dict[str, float | None]:
        return {kind: value(registry, "kvwatch_probe_errors_total", kind=kind) for kind in kinds}

    results.add_run(route, [session(round_result(1), round_result(2))], 1000, 1010)
    assert counted() == dict.fromkeys(kinds, 0)  # exported from 0, as every kind
    typo = session(round_result(1, error_kind="dns_error", status=None, ttft_seconds=None))
    https_to_http = session(round_result(1, error_kind="tls_mismatch", status=None, ttft_seconds=None))
    results.add_run(route, [typo, typo, https_to_http], 1020, 1030)
    assert counted() == {"dns_error": 2, "tls_mismatch": 1, "connection_refused": 0, "tls_error": 0}


def folded(registry, reason: str) -> float | None:
    return value(registry, "kvwatch_probe_label_values_folded_total", label="backend", reason=reason)


def test_backend_labels_stay_bounded_in_number_and_length_and_say_what_they_folded(exporter):
    results, registry = exporter
    results.declare(("lab-affinity", "affinity"))
    assert folded(registry, "too_many_values") == 0 and folded(registry, "too_long") == 0
    many = [session(round_result(1, backend=f"pod-{i}")) for i in range(MAX_VALUES_PER_LABEL + 10)]
    huge = session(round_result(1, backend="x" * 60_000), round_result(2, backend="y" * 129))
    results.add_run(("lab-affinity", "affinity"), [huge, *many], 1000, 1010)
    text = generate_latest(registry).decode()
    backends = {line.split('backend="')[1].split('"')[0] for line in text.splitlines() if 'backend="' in line}
    assert len(backends) == MAX_VALUES_PER_LABEL + 1 and OTHER in backends
    assert max(len(backend) for backend in backends) <= MAX_LABEL_VALUE_LENGTH
    assert value(registry, "kvwatch_probe_backend_rounds_total", backend=OTHER) == 12
    assert folded(registry, "too_many_values") == 10 and folded(registry, "too_long") == 2


def test_session_ids_never_become_labels(exporter):
    results, registry = exporter
    results.add_run(("lab-affinity", "affinity"), [session(round_result(1), round_result(2))], 1000, 1010)
    assert SESSION_ID not in generate_latest(registry).decode()


def test_unknown_stickiness_without_backend_or_cached_tokens(exporter):
    results, registry = exporter
    blind = session(round_result(1, backend=None), round_result(2, backend=None, cached_tokens=None))
    results.add_run(("lab-affinity", "affinity"), [blind], 1000, 1010)
    assert value(registry, "kvwatch_probe_stickiness_sessions_total", sticky="unknown") == 1
    assert value(registry, "kvwatch_probe_sticky_ratio", evidence="replica") is None
    assert value(registry, "kvwatch_probe_sticky_ratio", evidence="reuse") is None


def test_declared_routes_export_zeros_before_their_first_run(exporter):
    results, registry = exporter
    results.declare(("lab-affinity", "affinity"), rounds=3)
    assert value(registry, "kvwatch_probe_sessions_total", outcome="success") == 0
    assert value(registry, "kvwatch_probe_stickiness_sessions_total", sticky="true") == 0
    assert value(registry, "kvwatch_probe_last_run_timestamp_seconds") is None
    # Each round's counters and TTFT histogram too, so that the first run counts in their rates.
    assert value(registry, "kvwatch_probe_cached_tokens_total", round="3") == 0
    assert value(registry, "kvwatch_probe_ideal_cached_tokens_total", round="2") == 0
    assert value(registry, "kvwatch_probe_ttft_seconds_bucket", round="1", le="+Inf") == 0
    assert value(registry, "kvwatch_probe_ttft_seconds_count", round="3") == 0
    assert value(registry, "kvwatch_probe_rounds_total", round="4") is None
    results.add_run(("lab-affinity", "affinity"), [session(round_result(1), round_result(2))], 1000, 1010)
    assert value(registry, "kvwatch_probe_ttft_seconds_count", round="2") == 1
    assert value(registry, "kvwatch_probe_cached_tokens_total", round="2") == 1184


def test_outcome_counters_start_at_zero_so_increase_sees_the_first_failure(exporter):
    results, registry = exporter
    results.add_run(("lab-affinity", "affinity"), [session(round_result(1), round_result(2))], 1000, 1010)
    assert value(registry, "kvwatch_probe_sessions_total", outcome="failure") == 0
    assert value(registry, "kvwatch_probe_errors_total", kind="unauthorized") == 0
    assert value(registry, "kvwatch_probe_session_id_echo_sessions_total", echoed="false") == 0
    assert value(registry, "kvwatch_probe_stickiness_sessions_total", sticky="false") == 0


def test_route_info_says_which_routes_must_be_sticky():
    results = ProbeResults()
    registry = CollectorRegistry()
    registry.register(ProbeCollector(results, {}, {"chat-cache-aware": True, "lab-affinity": False}))
    for route in [("lab-affinity", "affinity"), ("chat-cache-aware", "cache_aware"), ("sglang", "manual"),
                  ("lab-round-robin", "round_robin")]:  # fmt: skip
        results.declare(route)

    def info(target: str, route_mode: str, expect_sticky: str) -> float | None:
        labels = {"target": target, "route_mode": route_mode, "expect_sticky": expect_sticky}
        return registry.get_sample_value("kvwatch_probe_route_info", labels)

    # Set explicitly for the first two; the others take their route mode's default.
    assert info("lab-affinity", "affinity", "false") == 1
    assert info("chat-cache-aware", "cache_aware", "true") == 1
    assert info("sglang", "manual", "true") == 1
    assert info("lab-round-robin", "round_robin", "false") == 1
    assert info("lab-round-robin", "round_robin", "true") is None


# --- the webhook -----------------------------------------------------------------------------------

TOKEN = "kvw-webhook-0123456789abcdef"  # must never be echoed


def exchange(store: Store, requests: list[tuple[str, str, dict]], token: str | None = TOKEN) -> list:
    """Send (method, path, aiohttp keyword arguments) to a real exporter on 127.0.0.1; (status, body)
    of each answer, and the /metrics text at the end."""

    async def run() -> list:
        registry = CollectorRegistry()
        async with TestClient(
            TestServer(make_app(registry, store.add_alerts, token), host="127.0.0.1")
        ) as client:
            answers = []
            for method, path, options in requests:
                answer = await client.request(method, path, **options)
                answers.append((answer.status, await answer.text()))
            metrics = await client.get("/metrics")
            return [*answers, await metrics.text()]

    return asyncio.run(run())


def bearer(token: str) -> dict:
    return {"headers": {"Authorization": f"Bearer {token}"}}


def test_with_a_token_the_webhook_takes_only_posts_that_carry_it(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with Store(tmp_path / "kvwatch.db") as store:
        refused = [
            {"json": webhook()},
            {"json": webhook(), **bearer(TOKEN[:-1])},
            {"json": webhook(), **bearer(TOKEN + "0")},
            {"json": webhook(), "headers": {"Authorization": f"Basic {TOKEN}"}},
            {"json": webhook(), "headers": {"Authorization": TOKEN}},
        ]
        *answers, healthy, metrics_text = exchange(
            store,
            [*(("POST", "/alerts", options) for options in refused), ("GET", "/-/healthy", {})],
        )
        assert [status for status, _ in answers] == [401] * len(refused)
        assert healthy == (200, "OK\n") and "kvwatch_webhook_alerts_rejected_total 0.0" in metrics_text
        assert store.alerts() == []
        stored, _ = exchange(store, [("POST", "/alerts", {"json": webhook(), **bearer(TOKEN)})])
        assert stored == (200, '{"stored": 2, "rejected": 0}') and len(store.alerts()) == 2
    said = [caplog.text, metrics_text, *(body for _, body in answers), (tmp_path / "kvwatch.db").read_bytes()]
    assert not any(TOKEN in str(text) for text in said)


def test_one_bad_alert_is_skipped_counted_and_named_and_the_good_one_stored(tmp_path, caplog):
    payload = copy.deepcopy(webhook())
    payload["alerts"][0]["status"] = "pending"
    with Store(tmp_path / "kvwatch.db") as store:
        answer, not_json, not_an_object, metrics_text = exchange(
            store,
            [("POST", "/alerts", {"json": payload, **bearer(TOKEN)}),
             ("POST", "/alerts", {"data": b"{not json", **bearer(TOKEN)}),
             ("POST", "/alerts", {"json": [payload], **bearer(TOKEN)})],
        )  # fmt: skip
        assert answer == (200, '{"stored": 1, "rejected": 1}')
        assert [a["alertname"] for a in store.alerts()] == ["Watchdog"]
    assert not_json[0] == 400 and "bad Alertmanager webhook payload" in not_json[1]
    assert not_an_object[0] == 400 and "must be a JSON object" in not_an_object[1]
    assert "kvwatch_webhook_alerts_rejected_total 1.0" in metrics_text
    assert "alerts[0].status: must be firing or resolved, got 'pending'" in caplog.text


def test_json_nested_too_deep_is_a_bad_payload_and_the_webhook_goes_on(tmp_path, caplog):
    """200,000 levels overflow Python's recursive JSON parser: a 400 naming the nesting, no traceback;
    nesting the parser takes, in an alert's label, skips that alert alone."""
    deep_label = copy.deepcopy(webhook())
    deep_label["alerts"][0]["labels"]["target"] = json.loads("[" * 900 + "]" * 900)
    with Store(tmp_path / "kvwatch.db") as store:
        too_deep, one_bad, good, metrics_text = exchange(
            store,
            [("POST", "/alerts", {"data": b"[" * 200_000 + b"]" * 200_000, **bearer(TOKEN)}),
             ("POST", "/alerts", {"json": deep_label, **bearer(TOKEN)}),
             ("POST", "/alerts", {"json": webhook(), **bearer(TOKEN)})],
        )  # fmt: skip
        assert sorted(a["alertname"] for a in store.alerts()) == ["KVWatchSessionAffinityBroken", "Watchdog"]
    assert too_deep[0] == 400 and "JSON nested too deep to parse" in json.loads(too_deep[1])["error"]
    assert one_bad == (200, '{"stored": 1, "rejected": 1}') and good[0] == 200
    assert "RecursionError" not in caplog.text and "Traceback" not in caplog.text
    assert 'kvwatch_webhook_posts_refused_total{reason="bad_payload"} 1.0' in metrics_text


def refusal_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]


def test_refused_posts_are_each_counted_and_logged_once_a_minute_at_most(tmp_path, caplog):
    """A sender retrying a bad post: the first refusal is logged, the rest only counted until a minute
    has passed on the webhook's clock; then one line sums up the refusals since."""
    now = [1000.0]

    async def run() -> str:
        with Store(tmp_path / "kvwatch.db") as store:
            app = make_app(CollectorRegistry(), store.add_alerts, TOKEN)
            app[REFUSED_POSTS_KEY].clock = lambda: now[0]
            async with TestClient(TestServer(app, host="127.0.0.1")) as client:
                for _ in range(50):
                    assert (await client.post("/alerts", json=webhook())).status == 401
                for _ in range(3):
                    assert (await client.post("/alerts", data=b"{not json", **bearer(TOKEN))).status == 400
                huge = io.BytesIO(b" " * (MAX_WEBHOOK_BYTES + 1))
                assert (await client.post("/alerts", data=huge, **bearer(TOKEN))).status == 413
                assert len(refusal_lines(caplog)) == 1
                now[0] += 61
                assert (await client.post("/alerts", json=webhook())).status == 401
                assert (await client.post("/alerts", json=webhook(), **bearer(TOKEN))).status == 200
                return await (await client.get("/metrics")).text()

    caplog.set_level(logging.INFO)
    metrics_text = asyncio.run(run())
    assert refusal_lines(caplog) == [
        "refused a webhook post from 127.0.0.1: no or wrong bearer token",
        "refused 54 webhook posts in the last 61 s (bad_payload 3, too_large 1, unauthorized 50); the latest "
        "from 127.0.0.1: no or wrong bearer token",
    ]
    for reason, count in (
        ("unauthorized", 51),
        ("bad_payload", 3),
        ("too_large", 1),
        ("store_unavailable", 0),
    ):
        assert f'kvwatch_webhook_posts_refused_total{{reason="{reason}"}} {count}.0' in metrics_text


def test_serve_warns_when_anyone_beyond_this_machine_may_post_alerts():
    everyone = ExporterSettings(listen="0.0.0.0:9464")
    warning = open_webhook_warning(everyone, None)
    assert warning and "0.0.0.0:9464" in warning and "webhook_token_file" in warning
    assert open_webhook_warning(ExporterSettings(listen="kvwatch.example.com:9464"), None)
    assert open_webhook_warning(everyone, TOKEN) is None
    for loopback in ("127.0.0.1:9464", "[::1]:9464", "localhost:9464"):
        assert open_webhook_warning(ExporterSettings(listen=loopback), None) is None


def test_every_series_names_the_cluster_set_in_the_config(tmp_path):
    """Probe, gateway-log, store and webhook series all carry the configured cluster label."""
    (tmp_path / "access.jsonl").touch()
    config = Config(
        targets=(Target(name="chat", base_url="http://127.0.0.1:18000", model="lab-model"),),
        gateway_logs=(GatewayLog(name="chat", path=tmp_path / "access.jsonl"),),
        exporter=ExporterSettings(cluster="eu-west"),
        store=StoreSettings(path=tmp_path / "kvwatch.db"),
        cluster_label="region",
    )
    service = Service(config)
    make_app(service.registry, alert_sink=None)
    samples = [s for family in service.registry.collect() for s in family.samples]
    families = {s.name.split("_")[1] for s in samples}
    assert {"probe", "gateway", "store", "webhook"} <= families
    assert [s for s in samples if s.labels.get("region") != "eu-west"] == []
    assert 'region="eu-west"' in generate_latest(service.registry).decode()


def test_without_a_cluster_the_series_carry_no_cluster_label(tmp_path):
    config = Config(
        targets=(Target(name="chat", base_url="http://127.0.0.1:18000", model="lab-model"),),
        store=StoreSettings(path=tmp_path / "kvwatch.db"),
    )
    samples = [s for family in Service(config).registry.collect() for s in family.samples]
    assert samples and [s for s in samples if "cluster" in s.labels] == []


def test_an_idled_session_exports_what_followed_its_idle_and_a_checked_close(exporter):
    """Idled after round 1: round 2 on another replica cached nothing (cold), round 3 stayed there."""
    results, registry = exporter
    rounds = (
        round_result(1),
        round_result(2, backend="r2", cached_tokens=0),
        round_result(3, backend="r2"),
    )
    idled = SessionResult(
        "lab-affinity",
        "affinity",
        "s-1",
        1000.0,
        1010.0,
        rounds,
        closed=True,
        idle=(1, 30.0),
        close_gone=False,
    )
    results.add_run(("lab-affinity", "affinity"), [idled, session(*rounds)], 1000, 1010)
    outcomes = {"idled": 1, "expired": 0, "cold": 1, "new_replica": 1, "repinned": 1}
    for outcome, count in outcomes.items():
        assert value(registry, "kvwatch_probe_idle_sessions_total", outcome=outcome) == count, outcome
    assert value(registry, "kvwatch_probe_close_checks_total", gone="false") == 1
    assert value(registry, "kvwatch_probe_close_checks_total", gone="true") == 0


def test_sessions_judged_by_reuse_export_their_evidence_warm_reuse_and_session_losses(exporter):
    """A SageMaker route names no replica: its sessions are judged by reuse, its last run's warm reuse is
    exported with that evidence, and sessions found gone are counted by kind."""
    results, registry = exporter
    lost = SessionResult(
        "lab-affinity", "affinity", "s-2", 1000.0, 1010.0,
        tuple(round_result(n, backend=None, cached_tokens=0 if n == 1 else 9) for n in (1, 2)),
        closed=True, session_losses=((2, "expired"),),
    )  # fmt: skip
    named = session(*(round_result(n) for n in (1, 2, 3)))
    results.add_run(("lab-affinity", "affinity"), [lost], 1000, 1010)
    assert value(registry, "kvwatch_probe_evidence_sessions_total", evidence="reuse") == 1
    assert value(registry, "kvwatch_probe_evidence_sessions_total", evidence="replica") == 0
    assert value(registry, "kvwatch_probe_session_losses_total", kind="expired") == 1
    assert value(registry, "kvwatch_probe_session_losses_total", kind="not_found") == 0
    warm_ideal = lost.rounds[1].ideal_cached_tokens
    assert value(registry, "kvwatch_probe_warm_reuse_ratio", evidence="reuse") == 9 / warm_ideal
    # The session's own verdict by that reuse (under half of its ideal: not sticky), apart from the
    # replica verdicts KVWatchSessionAffinityBroken judges.
    assert value(registry, "kvwatch_probe_sticky_ratio", evidence="reuse") == 0
    assert value(registry, "kvwatch_probe_sticky_ratio", evidence="replica") is None
    results.add_run(("lab-affinity", "affinity"), [named], 1000, 1010)
    warm = named.rounds[1:]
    reused = sum(r.cached_tokens for r in warm) / sum(r.ideal_cached_tokens for r in warm)
    assert value(registry, "kvwatch_probe_warm_reuse_ratio", evidence="replica") == reused
    assert value(registry, "kvwatch_probe_warm_reuse_ratio", evidence="reuse") is None
    assert value(registry, "kvwatch_probe_sticky_ratio", evidence="replica") == 1
    assert value(registry, "kvwatch_probe_sticky_ratio", evidence="reuse") is None
