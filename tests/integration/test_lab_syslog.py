"""The lab with `--gateway-log-source syslog`: a real nginx sends the affinity listener's access log to
`kvwatch serve` over syslog UDP (RFC 3164) and the round_robin one through a real rsyslog relay (RFC 5424
over TCP, octet-counted). kvwatch's figures equal what the gateway served, its own file log (kept
alongside) being the ground truth, and break-affinity raises KVWatchGatewaySessionsSpread.
"""

from __future__ import annotations

import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway_checks import LAB_CLIENT, chat
from kvwatch.collectors.gatewaylogs.follower import GatewayLogFollower
from kvwatch.collectors.gatewaylogs.tally import GatewayLogSnapshot
from kvwatch.store.history import Store
from labs import Lab

pytestmark = pytest.mark.integration

WAIT_S = 90
LISTENERS = ("affinity", "round_robin")
LAB_OPTIONS = ("--gateway-log-source", "syslog", "--replicas", "3", "--users", "0", "--no-probes",
               "--rule-time-scale", "0.1")  # fmt: skip


@pytest.fixture(scope="module")
def lab(start_lab) -> Lab:
    return start_lab(*LAB_OPTIONS)


def exported(lab: Lab) -> dict[tuple[str, tuple], float]:
    """kvwatch serve's gateway series, by name and sorted labels."""
    text = httpx.get(f"http://127.0.0.1:{lab.base_port + 4}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvwatch_gateway_"):
                samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def ground_truth(lab: Lab, listener: str) -> GatewayLogSnapshot:
    """What the gateway's own file log says, counted with the lab's settings for that log."""
    config = yaml.safe_load((lab.state_dir / "kvwatch.yaml").read_text())
    (settings,) = [log for log in config["gateway_logs"] if log["name"] == listener]
    path = lab.state_dir / "logs" / f"gateway-{listener}.jsonl"
    with GatewayLogFollower(
        path,
        listener,
        spread_window_seconds=settings["spread_window_seconds"],
        expect_sticky=False,
        log_format=settings.get("format", "nginx"),
    ) as follower:
        return follower.poll()


def traffic(lab: Lab, prefix: str, sessions: int) -> None:
    """Sessions of three rounds and keyless requests through both listeners, and the model list. A
    number of sessions that is no multiple of the 3 replicas: round robin moves every session."""
    for listener in LISTENERS:
        url = getattr(lab, listener)
        for round_ in range(3):
            for i in range(sessions):
                assert chat(url, f"{prefix}-{listener}-{i}", f"round {round_}").status_code == 200
        for _ in range(3):
            assert chat(url).status_code == 200
        assert LAB_CLIENT.get(f"{url}/v1/models").status_code == 200


def assert_figures_equal_the_file_logs(lab: Lab, source: str = "syslog") -> None:
    """Once kvwatch has received every line of each file log (from its push `source`), its figures are
    the file's."""
    deadline = time.monotonic() + WAIT_S
    while True:
        truths = {listener: ground_truth(lab, listener) for listener in LISTENERS}
        samples = exported(lab)
        if all(
            value(samples, "kvwatch_gateway_lines_total", log=name) == t.lines for name, t in truths.items()
        ):
            break
        assert time.monotonic() < deadline, f"kvwatch did not receive every line: {truths}"
        time.sleep(1)
    for name, truth in truths.items():
        listener = {"log": name, "listener": name}
        assert truth.lines > 0 and sum(value(samples, "kvwatch_gateway_log_refused_total", log=name, reason=r)
                                       for r in truth.refused) == 0  # fmt: skip
        assert (
            value(samples, "kvwatch_gateway_requests_without_session_key_total", **listener)
            == (truth.without_session_key[name])
        )
        assert (
            value(samples, "kvwatch_gateway_other_requests_total", **listener) == truth.other_requests[name]
        )
        assert (
            value(samples, "kvwatch_gateway_returning_sessions", **listener) == truth.returning_sessions[name]
        )
        for moved in ("false", "true"):
            assert (
                value(samples, "kvwatch_gateway_session_spread_sessions", **listener, failover=moved)
                == (truth.spread_sessions[name, moved])
            )
        sticky = str(name == "affinity").lower()
        assert value(samples, "kvwatch_gateway_log_info", log=name, expect_sticky=sticky, source=source) == 1


def wait_for_alert(lab: Lab, since: float, alertname: str, **labels: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
            for alert in store.alerts():
                matches = all(alert["labels"].get(k) == v for k, v in labels.items())
                named = alert["alertname"] == alertname and alert["status"] == "firing"
                if alert["received_at"] >= since and named and matches:
                    return
        time.sleep(1)
    raise AssertionError(f"no firing {alertname} {labels} within {WAIT_S} s")


def test_syslog_and_the_relay_feed_serve_the_gateways_figures_and_break_affinity_alerts(lab):
    traffic(lab, "healthy", 7)
    assert_figures_equal_the_file_logs(lab)
    assert ground_truth(lab, "affinity").spread_sessions["affinity", "false"] == 0
    since = time.time()
    assert lab.cli("fault", "break-affinity").returncode == 0
    traffic(lab, "broken", 14)  # the healthy sessions are still in the window: most must move
    assert_figures_equal_the_file_logs(lab)
    assert ground_truth(lab, "affinity").spread_sessions["affinity", "false"] > 0
    wait_for_alert(lab, since, "KVWatchGatewaySessionsSpread", log="affinity", listener="affinity")
