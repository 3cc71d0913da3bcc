"""What kvwatch cannot see, as Prometheus reports it (prometheus.pipeline), against a loopback fake of
Prometheus' HTTP API: every link holds, each link broken on its own, and a Prometheus that fails."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from kvwatch.core.promapi import PrometheusApi
from kvwatch.prometheus import queries
from kvwatch.prometheus.pipeline import BROKEN, OK, RULE_GROUPS, UNKNOWN, links
from processes import free_port

EXPORTER_PORT = 9464
KVWATCH_TARGET = {
    "scrapeUrl": f"http://10.0.0.5:{EXPORTER_PORT}/metrics",
    "labels": {"job": "kvwatch", "instance": f"10.0.0.5:{EXPORTER_PORT}"},
    "health": "up",
    "lastError": "",
}
ENGINE_TARGET = {"scrapeUrl": "http://10.0.0.6:8000/metrics", "labels": {"job": "vllm"}, "health": "up"}
ENGINE = {"metric": {"job": "vllm", "instance": "10.0.0.6:8000"}, "value": [0, "1"]}


def healthy() -> dict:
    """What a Prometheus that sees everything answers, by API path (and query for /query)."""
    rule = {"name": "KVWatchSessionAffinityBroken", "health": "ok", "lastError": ""}
    return {
        "targets": {"activeTargets": [KVWATCH_TARGET, ENGINE_TARGET], "droppedTargets": []},
        "rules": {"groups": [{"name": group, "rules": [rule]} for group in RULE_GROUPS]},
        "alertmanagers": {"activeAlertmanagers": [{"url": "http://10.0.0.7:9093/api/v2/alerts"}]},
        queries.ENGINES_SCRAPED: [ENGINE],
        queries.EXPORTER_SERIES: [],
    }


class FakePrometheus:
    """Prometheus' API on a loopback port, answering from `answers`; `status` != 200 fails every call."""

    def __init__(self) -> None:
        self.answers = healthy()
        self.status = 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
                parts = urlsplit(self.path)
                name = parts.path.removeprefix("/api/v1/")
                if name != "query" and name not in fake.answers:  # as vmalert answers a path it lacks
                    self.send_response(400)
                    self.end_headers()
                    self.wfile.write(f"unsupported path requested: {parts.path!r}".encode())
                    return
                if name == "query":
                    data = {"resultType": "vector", "result": fake.answers[parse_qs(parts.query)["query"][0]]}
                else:
                    data = fake.answers[name]
                body = {"status": "success", "data": data} if fake.status == 200 else {"status": "error"}
                encoded = json.dumps(body).encode()
                self.send_response(fake.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(encoded)))
                self.end_headers()
                self.wfile.write(encoded)

            def do_POST(self) -> None:  # noqa: N802 (prometheus-api-client posts its queries)
                length = int(self.headers.get("Content-Length", 0))
                self.path += "?" + self.rfile.read(length).decode()
                self.do_GET()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def links(self, rules_url: str | None = None) -> dict[str, tuple[str, str, str]]:
        found = links(PrometheusApi(self.url, 5, rules_url), EXPORTER_PORT)
        return {link.name: (link.status, link.evidence, link.fix) for link in found}


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def statuses(found: dict[str, tuple[str, str, str]]) -> dict[str, str]:
    return {name: status for name, (status, _, _) in found.items()}


EVERY_LINK = (
    "Prometheus answers",
    "Prometheus scrapes kvwatch serve",
    "Prometheus scrapes the engines",
    "Prometheus evaluates kvwatch's rules",
    "Prometheus sends alerts to Alertmanager",
)


def test_every_link_holds_when_prometheus_sees_everything(prometheus):
    found = prometheus.links()
    assert statuses(found) == dict.fromkeys(EVERY_LINK, OK)
    assert f"http://10.0.0.5:{EXPORTER_PORT}/metrics (job kvwatch)" in found[EVERY_LINK[1]][1]
    assert "1 engine(s) scraped: vllm / 10.0.0.6:8000" in found[EVERY_LINK[2]][1]


def test_an_exporter_that_is_no_scrape_target_is_named_with_its_port(prometheus):
    prometheus.answers["targets"]["activeTargets"] = [ENGINE_TARGET]
    status, evidence, fix = prometheus.links()["Prometheus scrapes kvwatch serve"]
    assert status == BROKEN
    assert (
        f"no scrape target on port {EXPORTER_PORT}" in evidence
        and "none of kvwatch serve's series" in evidence
    )
    assert f"scrape job for kvwatch serve's /metrics on port {EXPORTER_PORT}" in fix


def test_an_exporter_scraped_under_another_address_holds_by_its_series(prometheus):
    """A port-forward or a Service on port 80: no target on the exporter's port, but its series arrive."""
    prometheus.answers["targets"]["activeTargets"] = [ENGINE_TARGET]
    prometheus.answers[queries.EXPORTER_SERIES] = [
        {"metric": {"job": "kv", "instance": "svc:80"}, "value": [0, "1"]}
    ]
    status, evidence, _ = prometheus.links()["Prometheus scrapes kvwatch serve"]
    assert (status, evidence) == (OK, "Prometheus holds kvwatch serve's series, scraped as kv / svc:80.")


def test_an_exporter_that_is_down_is_named_with_the_scrape_error(prometheus):
    down = {**KVWATCH_TARGET, "health": "down", "lastError": "connection refused"}
    prometheus.answers["targets"]["activeTargets"] = [down, ENGINE_TARGET]
    status, evidence, fix = prometheus.links()["Prometheus scrapes kvwatch serve"]
    assert status == BROKEN
    assert evidence == f"kvwatch serve's scrape target is down ({down['scrapeUrl']}: connection refused)."
    assert "kvwatch serve --config FILE" in fix


def test_no_engine_series_is_named(prometheus):
    prometheus.answers[queries.ENGINES_SCRAPED] = []
    status, evidence, fix = prometheus.links()["Prometheus scrapes the engines"]
    assert status == BROKEN and "no vLLM or SGLang engine series" in evidence and "`replica` label" in fix


def test_rule_groups_not_loaded_are_named_with_their_files(prometheus):
    prometheus.answers["rules"]["groups"] = [{"name": "someone-elses", "rules": []}]
    status, evidence, fix = prometheus.links()["Prometheus evaluates kvwatch's rules"]
    assert status == BROKEN
    assert "kvwatch-engines (prometheus/rules/kvwatch-engines.yml)" in evidence
    assert "and 2 more" in evidence  # five groups, three named
    assert "rule_files" in fix


def test_a_rule_that_fails_to_evaluate_is_named_with_its_error(prometheus):
    broken = {"name": "KVWatchProbeStale", "health": "err", "lastError": "many-to-many matching not allowed"}
    prometheus.answers["rules"]["groups"][0]["rules"].append(broken)
    status, evidence, _ = prometheus.links()["Prometheus evaluates kvwatch's rules"]
    assert status == BROKEN
    assert (
        evidence
        == "1 of kvwatch's rules fail to evaluate: KVWatchProbeStale: many-to-many matching not allowed."
    )


def test_rules_not_evaluated_yet_are_unknown_not_ok(prometheus):
    prometheus.answers["rules"]["groups"][0]["rules"][0]["health"] = "unknown"
    status, evidence, _ = prometheus.links()["Prometheus evaluates kvwatch's rules"]
    assert status == UNKNOWN and "Not evaluated yet: KVWatchSessionAffinityBroken" in evidence


def test_no_alertmanager_is_named(prometheus):
    prometheus.answers["alertmanagers"]["activeAlertmanagers"] = []
    status, evidence, fix = prometheus.links()["Prometheus sends alerts to Alertmanager"]
    assert status == BROKEN and "no Alertmanager" in evidence and "alerting.alertmanagers" in fix


@pytest.fixture
def vmalert() -> Iterator[FakePrometheus]:
    """A rule engine apart from the store: the rules API, and no /api/v1/alertmanagers."""
    fake = FakePrometheus()
    fake.answers = {"rules": healthy()["rules"]}
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def test_a_store_with_its_rules_at_vmalert_is_judged_by_vmalerts_rules_and_sent_alerts(prometheus, vmalert):
    """VictoriaMetrics answers the queries and targets, vmalert the rules; vmalert lists no Alertmanager,
    so the alerts it counts as sent (its own counter, scraped into the store) show where they go."""
    prometheus.answers["rules"] = {"groups": []}  # the store evaluates nothing itself
    sent = {"metric": {"addr": "http://10.0.0.7:9093/api/v2/alerts"}, "value": [0, "12"]}
    prometheus.answers[queries.RULE_ENGINE_NOTIFIERS] = [sent]
    found = prometheus.links(rules_url=vmalert.url)
    assert statuses(found) == dict.fromkeys(EVERY_LINK, OK)
    assert f"{len(RULE_GROUPS)} rule groups loaded" in found["Prometheus evaluates kvwatch's rules"][1]
    assert found["Prometheus sends alerts to Alertmanager"][1] == (
        f"The rule engine at {vmalert.url} has sent alerts to http://10.0.0.7:9093/api/v2/alerts."
    )
    assert statuses(prometheus.links())["Prometheus evaluates kvwatch's rules"] == BROKEN  # not at the store

    prometheus.answers[queries.RULE_ENGINE_NOTIFIERS] = []  # vmalert is not scraped
    status, evidence, fix = prometheus.links(rules_url=vmalert.url)["Prometheus sends alerts to Alertmanager"]
    assert status == UNKNOWN and "does not list its Alertmanagers" in evidence and "-notifier.url" in fix


def test_a_prometheus_that_fails_breaks_the_first_link_and_judges_no_other(prometheus):
    prometheus.status = 503
    found = statuses(prometheus.links())
    assert found == {EVERY_LINK[0]: BROKEN, **dict.fromkeys(EVERY_LINK[1:], UNKNOWN)}


def test_a_prometheus_that_is_not_there_is_named():
    found = links(PrometheusApi(f"http://127.0.0.1:{free_port()}", 5), EXPORTER_PORT)
    assert [link.status for link in found] == [BROKEN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN]
    assert "Connection refused" in found[0].evidence


def test_a_link_prometheus_fails_to_answer_is_unknown_and_the_others_judged(prometheus):
    del prometheus.answers["alertmanagers"]["activeAlertmanagers"]
    found = statuses(prometheus.links())
    assert found == {**dict.fromkeys(EVERY_LINK, OK), "Prometheus sends alerts to Alertmanager": UNKNOWN}


def test_a_password_in_prometheus_url_is_never_shown(prometheus):
    url = prometheus.url.replace("http://", "http://kvwatch:s3cret@")
    found = links(PrometheusApi(url, 5), EXPORTER_PORT) + links(
        PrometheusApi(f"http://u:s3cret@127.0.0.1:{free_port()}", 5), EXPORTER_PORT
    )
    assert found[0].status == OK and found[len(EVERY_LINK)].status == BROKEN
    assert not [link for link in found if "s3cret" in link.evidence + link.fix]
