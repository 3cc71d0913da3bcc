"""Real users' first-byte time by round: what each format reads of the upstream's time to first byte,
each request's round in its session, and the per-listener, per-round histograms and medians exported."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.collectors.gatewaylogs import LOG_FORMATS, Malformed, envoy
from kvwatch.collectors.gatewaylogs.metrics import GatewayLogCollector
from kvwatch.collectors.gatewaylogs.rounds import BUCKETS, MAX_ROUND, RECENT, ROUNDS, round_label
from kvwatch.collectors.gatewaylogs.sources.otlp.records import AccessLogRecords
from kvwatch.collectors.gatewaylogs.tally import SessionTally, SourceState

T0 = 1_800_000_000.0
NGINX = {
    "msec": T0,
    "listener": "affinity",
    "request": "POST /v1/chat/completions",
    "status": 200,
    "upstream_addr": "10.0.0.1:8000",
    "session_id": "s1",
    "session_source": "client",
    "upstream_header_time": "0.042",
}
ENVOY = {
    "start_time": "2027-01-15T08:00:00.000Z",
    "duration": 100,
    "listener": "affinity",
    "response_code": 200,
    "response_flags": "-",
    "upstream_host": "10.0.0.1:8000",
    "upstream_request_attempt_count": 1,
    "session_id": "s1",
    "request_id": "r1",
    "first_body_byte_us": 42000,
}


def first_byte(format_name: str, record: dict) -> float | None:
    return LOG_FORMATS[format_name].parse(record).first_byte_seconds


@pytest.mark.parametrize(
    ("header_time", "seconds"),
    [
        ("0.042", 0.042),
        ("0.001, 0.042", 0.042),  # a failover: the server that answered is the last one
        ("0.001 : 0.042", 0.042),  # across an internal redirect
        ("-", None),  # nginx proxied but the server sent no headers
        ("", None),  # nginx did not proxy
        ("0.042, -", None),
    ],
)
def test_nginx_reads_the_last_servers_upstream_header_time(header_time, seconds):
    assert first_byte("nginx", {**NGINX, "upstream_header_time": header_time}) == seconds
    ingress = {**NGINX, "req_id": "q1", "proxy_upstream_name": "llm", "upstream_header_time": header_time}
    assert first_byte("ingress-nginx", ingress) == seconds


def test_a_line_without_the_first_byte_field_is_still_a_request():
    without = {key: value for key, value in NGINX.items() if key != "upstream_header_time"}
    assert first_byte("nginx", without) is None
    assert first_byte("envoy", {key: v for key, v in ENVOY.items() if key != "first_body_byte_us"}) is None


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(42000, 0.042), (42000.0, 0.042), ("42000", 0.042), (None, None), ("-", None), (0, 0.0)],
)
def test_envoy_reads_the_first_body_byte_in_microseconds(value, seconds):
    assert first_byte("envoy", {**ENVOY, "first_body_byte_us": value}) == seconds


@pytest.mark.parametrize(
    ("format_name", "field", "value", "reason"),
    [
        ("nginx", "upstream_header_time", 0.042, "wrong_type"),  # the log_format quotes it
        ("nginx", "upstream_header_time", "soon", "wrong_type"),
        ("nginx", "upstream_header_time", "-0.5", "bad_value"),
        ("nginx", "upstream_header_time", "NaN", "bad_value"),
        ("envoy", "first_body_byte_us", True, "wrong_type"),
        ("envoy", "first_body_byte_us", [1], "wrong_type"),
        ("envoy", "first_body_byte_us", -1, "bad_value"),
        ("envoy", "first_body_byte_us", "inf", "bad_value"),
    ],
)
def test_a_first_byte_that_is_no_time_makes_the_line_malformed(format_name, field, value, reason):
    record = {"nginx": NGINX, "envoy": ENVOY}[format_name]
    with pytest.raises(Malformed) as raised:
        LOG_FORMATS[format_name].parse({**record, field: value})
    assert raised.value.reason == reason


def test_otlp_records_carry_the_optional_first_byte_as_a_number():
    sent = {key: "-" if value is None else str(value) for key, value in ENVOY.items()}
    record = LogRecord(attributes=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in sent.items()])
    read = AccessLogRecords(envoy.FIELDS)(record)
    assert read["first_body_byte_us"] == 42000
    assert envoy.FORMAT.parse(read).first_byte_seconds == 0.042
    del record.attributes[-1]
    assert "first_body_byte_us" not in AccessLogRecords(envoy.FIELDS)(record)


def test_round_labels_stop_at_max_round():
    assert [round_label(n) for n in range(1, MAX_ROUND + 3)] == [*ROUNDS, ROUNDS[-1], ROUNDS[-1]]
    assert ROUNDS[-1] == f"{MAX_ROUND}+" and len(ROUNDS) == MAX_ROUND


def take(tally: SessionTally, session: str, seconds: float, **changes) -> None:
    line = {**NGINX, "session_id": session, "upstream_header_time": repr(seconds), **changes}
    tally.take_line(json.dumps(line).encode(), T0)


def test_each_request_is_timed_by_its_round_in_its_session_per_listener():
    tally = SessionTally("gw", clock=lambda: T0)
    for round_ in range(1, MAX_ROUND + 3):  # two sessions, each round slower than the last
        take(tally, "a", round_ / 100)
        take(tally, "b", round_ / 100 + 0.002)
    take(tally, "a", 0.5, listener="round_robin")  # the same id on another listener: a session of its own
    snapshot = tally.snapshot(SourceState())
    medians = snapshot.first_byte_median_seconds
    assert medians[("round_robin", "1")] == 0.5
    for round_ in range(1, MAX_ROUND):
        assert medians[("affinity", str(round_))] == pytest.approx(round_ / 100 + 0.001)
    late = [n / 100 + extra for n in range(MAX_ROUND, MAX_ROUND + 3) for extra in (0, 0.002)]
    assert medians[("affinity", f"{MAX_ROUND}+")] == pytest.approx(statistics.median(late))
    buckets, total = snapshot.first_byte_seconds[("affinity", "1")]
    assert dict(buckets)["0.01"] == 1 and dict(buckets)["0.015"] == 2 and dict(buckets)["+Inf"] == 2
    assert total == pytest.approx(0.022)
    assert len(buckets) == len(BUCKETS) + 1


def test_only_successful_rounds_of_client_sessions_are_timed():
    tally = SessionTally("gw", clock=lambda: T0)
    take(tally, "a", 0.1, status=500)  # round 1, failed: counted as a round, not timed
    take(tally, "a", 0.02)  # round 2
    take(tally, "gw-made", 0.3, session_source="assigned")  # no client key: no round
    take(tally, "b", 0.04, upstream_header_time="-")  # no time
    take(tally, "c", 0.05, request="GET /v1/models")  # not an inference request
    snapshot = tally.snapshot(SourceState())
    assert snapshot.first_byte_median_seconds == {("affinity", "2"): 0.02}
    assert set(snapshot.first_byte_seconds) == {("affinity", "2")}


def test_the_median_is_of_each_rounds_latest_requests():
    tally = SessionTally("gw", clock=lambda: T0)
    for n in range(RECENT):
        take(tally, f"old-{n}", 1.0)
    for n in range(RECENT // 2 + 1):
        take(tally, f"new-{n}", 0.01)
    snapshot = tally.snapshot(SourceState())
    assert snapshot.first_byte_median_seconds[("affinity", "1")] == 0.01
    assert dict(snapshot.first_byte_seconds[("affinity", "1")][0])["+Inf"] == RECENT * 3 // 2 + 1


class _Followed:
    def __init__(self, tally: SessionTally):
        self.name, self.latest = tally.name, tally.snapshot(SourceState())


def test_the_collector_exports_a_histogram_and_the_median_by_listener_and_round():
    tally = SessionTally("gw", clock=lambda: T0)
    take(tally, "a", 0.012)
    take(tally, "a", 0.3)
    registry = CollectorRegistry()
    registry.register(GatewayLogCollector([_Followed(tally)]))
    text = generate_latest(registry).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert families["kvwatch_gateway_first_byte_seconds"].type == "histogram"
    samples = {
        (s.name, s.labels.get("round"), s.labels.get("le")): s.value
        for s in families["kvwatch_gateway_first_byte_seconds"].samples
    }
    assert samples[("kvwatch_gateway_first_byte_seconds_bucket", "1", "0.015")] == 1
    assert samples[("kvwatch_gateway_first_byte_seconds_bucket", "2", "0.25")] == 0
    assert samples[("kvwatch_gateway_first_byte_seconds_count", "2", None)] == 1
    medians = families["kvwatch_gateway_first_byte_median_seconds"].samples
    assert {(s.labels["log"], s.labels["listener"], s.labels["round"], s.value) for s in medians} == {
        ("gw", "affinity", "1", 0.012),
        ("gw", "affinity", "2", 0.3),
    }
    assert '="a"' not in text  # session ids never become label values


def test_the_lab_and_the_docs_log_the_first_byte():
    repo = Path(__file__).resolve().parents[3]
    for page in (repo / "lab" / "templates" / "nginx.conf", repo / "docs" / "gateway-logs.md"):
        assert '"upstream_header_time":"$upstream_header_time"' in page.read_text()
