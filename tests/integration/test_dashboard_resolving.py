"""A real Prometheus evaluating kvwatch's real alert rules (their durations scaled as the lab scales them)
on a loopback exporter whose probe stickiness breaks and recovers; the Overview, through AppTest with its
real data layer: red while KVWatchSessionAffinityBroken fires, then, recovered while keep_firing_for still
holds the alert, "healthy again" with the time it clears, which is the evaluation Prometheus resolves it
in; then green."""

from __future__ import annotations

import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pandas as pd
import pytest
import streamlit as st
import yaml
from streamlit.testing.v1 import AppTest

from kvwatch.alerts.verdicts import NOT_WATCHING, ROUTE_STICKY
from kvwatch.dashboard import data, ui
from kvwatch.lab.configs import scale_durations
from paths import REPO
from processes import free_port, http_get, poll, start_prometheus, stop

pytestmark = pytest.mark.integration

SCALE = 0.25  # keep_firing_for: 2m becomes 30 s
EVALUATION_S = 1
WAIT_S = 120
ALERT = ROUTE_STICKY.alert.name


class Probe(BaseHTTPRequestHandler):
    """kvwatch serve's exporter for one sticky route, its last run's stickiness set by the test."""

    sticky = 1.0

    def do_GET(self) -> None:
        route = 'target="chat",route_mode="affinity"'
        body = (
            f"kvwatch_probe_sticky_ratio{{{route}}} {Probe.sticky}\n"
            f'kvwatch_probe_route_info{{{route},expect_sticky="true"}} 1\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def overview() -> AppTest:
    st.cache_data.clear()
    at = AppTest.from_file(str(REPO / "dashboard" / "app_pages" / "overview.py"), default_timeout=60).run()
    assert not at.exception, at.exception
    return at


def verdict(at: AppTest) -> str:
    """The words under the route's stickiness tile."""
    (words,) = [m.value for m in at.markdown if ALERT in m.value or "Sessions stay" in m.value]
    return words


def test_a_recovered_route_reads_as_resolving_until_prometheus_resolves_its_alert(tmp_path, monkeypatch):
    exporter = ThreadingHTTPServer(("127.0.0.1", 0), Probe)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    rules = (REPO / "alerts" / "kvwatch.rules.yml").read_text()
    (tmp_path / "kvwatch.rules.yml").write_text(scale_durations(rules, SCALE))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": f"{EVALUATION_S}s"},
        "rule_files": [str(tmp_path / "kvwatch.rules.yml")],
        "scrape_configs": [{"job_name": "kvwatch", "static_configs": [
            {"targets": [f"127.0.0.1:{exporter.server_address[1]}"]}]}],
    }))  # fmt: skip
    port = free_port()
    prometheus_url = f"http://127.0.0.1:{port}"
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        "targets: [{name: chat, base_url: 'http://127.0.0.1:1', model: m}]\n"
        f"prometheus: {{url: '{prometheus_url}'}}\nstore: {{path: '{tmp_path / 'kvwatch.db'}'}}\n"
    )
    monkeypatch.setattr(sys, "argv", ["app.py", "--config", str(config)])
    monkeypatch.setattr(data, "now", time.time)  # the page's time: now, not a refresh grid's
    prometheus, log = start_prometheus(tmp_path, port)
    try:
        poll(
            lambda: verdict(overview()) == ":green[Sessions stay on their replica.]",
            "no green verdict",
            WAIT_S,
            log,
        )

        Probe.sticky = 0.2
        poll(lambda: verdict(overview()).startswith(f":red[{ALERT} fires:"), "no red verdict", WAIT_S, log)

        Probe.sticky = 1.0
        page = poll(
            lambda: (at := overview()) and verdict(at).startswith(":blue[") and at,
            "no resolving",
            WAIT_S,
            log,
        )
        st.cache_data.clear()
        firing_now = data.firing_alerts(time.time()).value
        (held,) = firing_now[firing_now["alertname"] == ALERT].to_dict("records")
        assert held["keep_firing_for"] == 120 * SCALE  # the rule's, as Prometheus loaded it
        # the only errors: the links this test leaves out (engines, recording rules, Alertmanager)
        assert all(e.value.startswith(f"**{NOT_WATCHING}**") for e in page.error)
        assert page.info[0].value.startswith(
            f"Healthy again: **{ALERT}** on chat, clearing at {ui.clock(held['clears_at'])}."
        )
        assert verdict(page) == (
            f":blue[Healthy again since {ui.clock(held['stopped_at'])}: {ALERT} still fires, held by its "
            f"keep_firing_for of 30 s, and clears at {ui.clock(held['clears_at'])}.]"
        )
        assert held["clears_at"] - held["stopped_at"] == pd.Timedelta(seconds=30)  # 30 evaluations of 1 s

        poll(
            lambda: verdict(overview()) == ":green[Sessions stay on their replica.]",
            "no green again",
            WAIT_S,
            log,
        )
        # The evaluation that resolved it: the one after the alert's last firing sample.
        firing = http_get(
            f"{prometheus_url}/api/v1/query",
            params={"query": f'ALERTS{{alertname="{ALERT}", alertstate="firing"}}[5m]'},
            timeout=10,
        ).json()["data"]["result"]
        last_firing = max(float(t) for series in firing for t, _ in series["values"])
        assert held["clears_at"].timestamp() == pytest.approx(last_firing + EVALUATION_S, abs=0.002)
    finally:
        stop(prometheus)
        exporter.shutdown()
        exporter.server_close()
        st.cache_data.clear()
