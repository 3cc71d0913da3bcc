"""The lab on VictoriaMetrics (`kvwatch lab up --metrics-store victoriametrics`): VictoriaMetrics scrapes,
vmalert evaluates kvwatch's recording rules and the alerts written without keep_firing_for (Debian's
vmalert 1.79 refuses the field), and sends to the lab's Alertmanager. Broken affinity reaches the
webhook; the cluster hit ratio kvwatch reads through its Prometheus client (rules and alerts from
vmalert, prometheus.rules_url) equals the replicas' ground truth; vmalert logs no rule or template error.

With probes (the affinity alert judges the probe runs), --fast and the rule windows at half of
production: a minute of traffic holds enough requests that the few at the window's edges move the
cluster ratio by less than the tolerance."""

from __future__ import annotations

import json
import sys
import time

import pytest
import streamlit as st

from kvwatch.core.promapi import PrometheusApi
from kvwatch.dashboard import data
from kvwatch.grafana import boards
from kvwatch.lab.configs import scale_durations
from kvwatch.prometheus import panel_queries, queries
from kvwatch.prometheus.rules import RULE_GROUPS
from kvwatch.store.history import Store
from labs import Lab, wait_until_recorded
from processes import http_get, kvwatch

pytestmark = pytest.mark.integration

RULE_TIME_SCALE = 0.5
WINDOW_S = int(scale_durations(queries.WINDOW, RULE_TIME_SCALE).removesuffix("s"))
TOLERANCE = 0.02
WAIT_S = 90


@pytest.fixture(scope="module")
def lab(start_lab) -> Lab:
    lab = start_lab("--metrics-store", "victoriametrics", "--replicas", "4", "--users", "6", "--think", "0.2",
                     "--time-scale", "0.1", "--rule-time-scale", str(RULE_TIME_SCALE))  # fmt: skip
    lab.up_at = time.time()
    return lab


def wait_for_alert(lab: Lab, since: float, alertname: str, status: str, **labels: str) -> dict:
    """The first alert of that name, status and labels kvwatch's webhook received after `since`."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
            for alert in store.alerts(since=since):
                matches = all(alert["labels"].get(k) == v for k, v in labels.items())
                if alert["alertname"] == alertname and alert["status"] == status and matches:
                    return alert
        time.sleep(1)
    raise AssertionError(f"no {status} {alertname} {labels} reached the webhook within {WAIT_S} s")


def test_the_lab_runs_victoriametrics_and_vmalert_on_loopback(lab: Lab):
    status = lab.status
    assert status["metrics_store"] == "victoriametrics"
    assert {"victoria-metrics", "vmalert"} <= status["processes"].keys() and "prometheus" not in status[
        "processes"
    ]
    assert status["rules"] == f"http://127.0.0.1:{lab.base_port + 9}" != status["prometheus"]
    assert http_get(f"{status['prometheus']}/health", timeout=5).text.strip() == "OK"
    rules = (lab.state_dir / "rules" / "kvwatch.rules.yml").read_text()
    assert "KVWatchSessionAffinityBroken" in rules and "keep_firing_for" not in rules


def test_the_cluster_hit_ratio_read_through_kvwatch_equals_the_ground_truth(lab: Lab):
    api = PrometheusApi(lab.status["prometheus"], 10, lab.status["rules"])
    deadline = time.monotonic() + WINDOW_S + 45
    evaluated = []  # the window must lie wholly inside the traffic, and the recorded ratio be there
    while time.monotonic() < deadline and not evaluated:
        time.sleep(1)
        if time.time() - lab.up_at > WINDOW_S + 5:
            evaluated = api.query(f"timestamp({queries.CLUSTER_HIT_RATIO})")
    assert evaluated, f"no {queries.CLUSTER_HIT_RATIO} recorded in VictoriaMetrics"
    at = float(evaluated[0]["value"][1])
    (shown,) = api.query(queries.CLUSTER_HIT_RATIO, at=at)
    wait_until_recorded(lab.status["replicas"], at)
    counted = [
        record
        for replica in lab.status["replicas"]
        for record in http_get(f"{replica['url']}/lab/ground-truth", timeout=10).json()["records"]
        if record.get("ttft_seconds") is not None
        and at - WINDOW_S < record["time"] + record["ttft_seconds"] <= at  # vLLM counts at the first token
    ]
    expected = sum(r["cached_tokens"] for r in counted) / sum(r["prompt_tokens"] for r in counted)
    assert 0.3 < expected < 1.0  # real reuse happened, so the comparison means something
    ratio = float(shown["value"][1])
    assert ratio == pytest.approx(expected, abs=TOLERANCE), (len(counted), expected, ratio - expected)
    print(f"cluster hit ratio {ratio:.4f}, ground truth {expected:.4f} over {len(counted)} requests")


def test_no_engine_change_is_recorded_where_none_happened(lab: Lab):
    """MetricsQL's changes() also counts a series that began in its window: every `up`, for a window
    after VictoriaMetrics starts. The record the affinity alert is excused by must not read that as
    replicas that went down or came back."""
    lived = time.time() - lab.up_at
    assert lived > WINDOW_S  # the test above waited for a whole rule window of traffic
    api = PrometheusApi(lab.status["prometheus"], 10, lab.status["rules"])
    assert api.query('up{job="replicas"}') and api.query(queries.ENGINES_SCRAPED)
    assert api.query(f"max_over_time({queries.CLUSTER_ENGINES_CHANGED}[{int(lived)}s])") == []


def test_broken_affinity_reaches_alertmanager_and_the_webhook_through_vmalert(lab: Lab):
    since = time.time()
    result = lab.cli("fault", "break-affinity")
    assert result.returncode == 0, result.stderr
    alert = wait_for_alert(lab, since, "KVWatchSessionAffinityBroken", "firing", target="lab-affinity")
    assert alert["labels"]["severity"] == "critical"
    answer = http_get(f"{lab.status['alertmanager']}/api/v2/alerts", timeout=10).json()
    assert "KVWatchSessionAffinityBroken" in {a["labels"]["alertname"] for a in answer}
    # vmalert writes each alert's ALERTS series into VictoriaMetrics, which the boards' alert panels read
    (series,) = PrometheusApi(lab.status["prometheus"], 10).query(
        'ALERTS{alertname="KVWatchSessionAffinityBroken", alertstate="firing"}'
    )
    assert series["metric"]["target"] == "lab-affinity"
    firing = PrometheusApi(lab.status["prometheus"], 10, lab.status["rules"]).alerting_rules()
    assert any(a["state"] == "firing" for r in firing if r["name"] == "KVWatchSessionAffinityBroken"
               for a in r.get("alerts", []))  # fmt: skip


def test_vmalert_logs_no_rule_or_template_error(lab: Lab):
    log = (lab.state_dir / "logs" / "vmalert.log").read_text()
    started = {
        line.split('"')[1] for line in log.splitlines() if 'group "kvwatch-' in line and "started" in line
    }
    assert started == set(RULE_GROUPS), log[-2000:]
    failing = [line for line in log.splitlines() if "\terror\t" in line or "\twarn\t" in line]
    assert failing == [], "\n".join(failing[:10])


def test_the_dashboard_reads_the_firing_alerts_from_vmalert(lab: Lab, monkeypatch):
    """After the broken affinity above: the Overview's firing alerts, read by dashboard/data.py from the
    lab's config, whose prometheus.rules_url is vmalert's."""
    monkeypatch.setattr(sys, "argv", ["app.py", "--config", str(lab.state_dir / "kvwatch.yaml")])
    st.cache_data.clear()
    firing = data.firing_alerts(time.time())
    st.cache_data.clear()
    assert firing.error is None
    assert "KVWatchSessionAffinityBroken" in set(firing.value["alertname"])
    assert firing.value["stopped_at"].isna().all()  # no keep_firing_for: nothing is held


def test_doctor_setup_finds_every_link_through_victoriametrics_and_vmalert(lab: Lab):
    result = kvwatch("doctor", "--setup", "--config", str(lab.state_dir / "kvwatch.yaml"), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every link holds" in result.stdout
    assert f"The rule engine at {lab.status['rules']} has sent alerts to" in " ".join(result.stdout.split())


def board_queries() -> list[str]:
    """Every query of every provisioned board."""
    found = set()

    def walk(node: dict) -> None:
        for panel in node.get("panels", []):
            found.update(target["expr"] for target in panel.get("targets", []) if "expr" in target)
            walk(panel)

    for path, text in boards.dashboard_files().items():
        if path.startswith("grafana/dashboards/"):
            walk(json.loads(text))
    return sorted(found)


def test_every_board_query_answers_in_victoriametrics(lab: Lab):
    """MetricsQL takes every query the boards ask, through kvwatch's Prometheus client."""
    api, now = PrometheusApi(lab.status["prometheus"], 10), time.time()
    answered = 0
    for query in board_queries():
        expr = panel_queries.fill_variables(query, window=f"{WINDOW_S}s", time_range="5m")
        api.query(expr)  # raises QueryRefused for what VictoriaMetrics cannot parse or run
        answered += bool(api.query_range(expr, now - 120, now, 10))
    assert answered > len(board_queries()) / 2  # most panels have data: the queries are not vacuous
