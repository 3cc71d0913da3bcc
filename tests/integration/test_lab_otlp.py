"""The lab with `--gateway-log-source otlp`: a real Envoy sends each listener's access log to `kvwatch
serve` over OTLP/gRPC with its OpenTelemetry access logger. kvwatch's figures equal what Envoy's own file
log (kept alongside) says, and break-affinity raises KVWatchGatewaySessionsSpread.
"""

from __future__ import annotations

import time

import pytest
import yaml
from test_lab_syslog import assert_figures_equal_the_file_logs, ground_truth, traffic, wait_for_alert

from labs import Lab

pytestmark = pytest.mark.integration

LAB_OPTIONS = ("--gateway", "envoy", "--gateway-log-source", "otlp", "--replicas", "3", "--users", "0",
               "--no-probes", "--rule-time-scale", "0.1")  # fmt: skip


@pytest.fixture(scope="module")
def lab(start_lab) -> Lab:
    return start_lab(*LAB_OPTIONS)


def test_envoy_feeds_serve_over_otlp_the_gateways_figures_and_break_affinity_alerts(lab):
    config = yaml.safe_load((lab.state_dir / "kvwatch.yaml").read_text())
    assert {(log["source"], log["format"]) for log in config["gateway_logs"]} == {("otlp", "envoy")}
    traffic(lab, "healthy", 7)
    assert_figures_equal_the_file_logs(lab, source="otlp")
    assert ground_truth(lab, "affinity").spread_sessions["affinity", "false"] == 0
    since = time.time()
    assert lab.cli("fault", "break-affinity").returncode == 0
    traffic(lab, "broken", 14)  # the healthy sessions are still in the window: most must move
    assert_figures_equal_the_file_logs(lab, source="otlp")
    assert ground_truth(lab, "affinity").spread_sessions["affinity", "false"] > 0
    wait_for_alert(lab, since, "KVWatchGatewaySessionsSpread", log="affinity", listener="affinity")
