"""The access-log formats: each reads its gateway's real lines as the requests the follower counts."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from kvwatch.collectors.gatewaylogs import (
    LOG_FORMATS,
    MALFORMED_REASONS,
    NO_UPSTREAM,
    Malformed,
    Request,
    envoy,
    ingress_nginx,
    json_object,
    nginx,
)
from kvwatch.collectors.gatewaylogs.follower import GatewayLogFollower
from kvwatch.config.settings import Config, ExporterSettings, GatewayLog, StoreSettings
from kvwatch.serve.scheduler import Service
from paths import REPO
from processes import free_port

R1, R2 = "10.0.0.1:8000", "10.0.0.2:8000"

# As the lab's nginx writes its `kvwatch_json` log_format: a failover from R1 to R2.
NGINX_LINE = (
    '{"time":"2026-12-01T13:20:31+00:00","msec":1764595231.535,"listener":"affinity",'
    '"request":"POST /v1/chat/completions","status":200,"upstream_addr":"10.0.0.1:8000, 10.0.0.2:8000",'
    '"upstream_status":"502, 200","session_id":"chat-42","session_source":"client",'
    '"request_time":0.412,"upstream_response_time":"0.001, 0.411",'
    '"upstream_header_time":"0.001, 0.087"}\n'
)
# Written from Envoy 1.40's documented output of examples/envoy-access-log.yaml (no Envoy binary here):
# keys sorted, no spaces, numbers for the numeric operators, "-" for no response flags.
ENVOY_LINE = (
    '{"duration":412,"listener":"affinity","request_id":"2b8f2c7e-4d1a-4a5e-9f0b-6c3d1e7a9b10",'
    '"response_code":200,"response_flags":"-","session_id":"chat-42",'
    '"start_time":"2026-12-01T13:20:31.123Z","upstream_host":"10.0.0.1:8000",'
    '"upstream_request_attempt_count":1,"first_body_byte_us":87012}\n'
)
# As ingress-nginx writes the log-format-upstream of docs/gateway-logs.md: a failover from R1 to R2.
INGRESS_NGINX_LINE = (
    '{"time":"2026-12-01T13:20:31+00:00","msec":1764595231.535,"req_id":"5f1c0d2b9a3e4f60",'
    '"proxy_upstream_name":"llm-vllm-8000","upstream_addr":"10.0.0.1:8000, 10.0.0.2:8000",'
    '"upstream_status":"502, 200","status":200,"method":"POST","uri":"/v1/chat/completions",'
    '"session_id":"chat-42","request_time":0.412,"upstream_header_time":"0.001, 0.087"}\n'
)
STARTED = datetime.fromisoformat("2026-12-01T13:20:31.123+00:00").timestamp()
REQUEST_ID = "2b8f2c7e-4d1a-4a5e-9f0b-6c3d1e7a9b10"


def envoy_line(**changes: object) -> str:
    """ENVOY_LINE with some fields changed, as Envoy orders and spaces them."""
    record = {**json.loads(ENVOY_LINE), **changes}
    return json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"


def parse(format_name: str, line: str) -> Request:
    return LOG_FORMATS[format_name].parse(json_object(line.encode()))


def test_every_format_is_registered_under_its_name():
    assert LOG_FORMATS == {
        "nginx": nginx.FORMAT,
        "ingress-nginx": ingress_nginx.FORMAT,
        "envoy": envoy.FORMAT,
    }
    with pytest.raises(
        ValueError, match='unknown gateway log format "istio"; known: envoy, ingress-nginx, nginx'
    ):
        LOG_FORMATS.lookup("istio")
    with pytest.raises(ValueError, match="unknown gateway log format"):
        GatewayLogFollower("access.jsonl", "lab", log_format="haproxy")


FAILED_OVER = Request(
    time=1764595231.535, listener="affinity", upstream=R2, failover=True, status=200,
    session_id="chat-42", assigned=False, path="/v1/chat/completions", first_byte_seconds=0.087,
)  # fmt: skip


@pytest.mark.parametrize(
    "format_name, line, expected",
    [
        # The nginx formats name the server that answered after a failover.
        ("nginx", NGINX_LINE, FAILED_OVER),
        ("ingress-nginx", INGRESS_NGINX_LINE, FAILED_OVER._replace(listener="llm-vllm-8000")),  # its backend
        # Envoy's request ended when its last byte went out; this line has no path.
        (
            "envoy",
            ENVOY_LINE,
            FAILED_OVER._replace(
                time=STARTED + 0.412, upstream=R1, failover=False, path=None, first_byte_seconds=0.087012
            ),
        ),
    ],
)
def test_each_formats_line_is_the_request_it_stands_for(format_name, line, expected):
    assert parse(format_name, line) == expected


@pytest.mark.parametrize(
    "changes",
    [
        {"session_id": None},  # the client sent no X-Session-Id and the gateway assigned none
        {"session_id": ""},
        {"session_id": REQUEST_ID},  # the gateway gave the request its own id
    ],
)
def test_an_envoy_request_without_a_client_session_key_takes_the_request_id(changes):
    request = parse("envoy", envoy_line(**changes))
    assert (request.session_id, request.assigned) == (REQUEST_ID, True)


@pytest.mark.parametrize(
    ("changes", "failover"),
    [
        ({"upstream_request_attempt_count": 2, "upstream_host": R2}, True),  # retried on another host
        ({"response_flags": "UF", "response_code": 503}, True),
        ({"response_flags": "UF,URX", "response_code": 503, "upstream_request_attempt_count": 3}, True),
        ({"response_flags": "UT", "response_code": 504}, False),  # slow, not failed
        ({"response_flags": "-"}, False),
    ],
)
def test_envoy_retries_and_upstream_failures_are_failovers(changes, failover):
    assert parse("envoy", envoy_line(**changes)).failover is failover


def test_envoy_without_an_upstream_or_a_response():
    no_host = parse("envoy", envoy_line(upstream_host=None, response_flags="UH", response_code=503))
    assert (no_host.upstream, no_host.status, no_host.failover) == (NO_UPSTREAM, 503, False)
    # The client went away before any response: Envoy's 0 is nginx's 499, a 4xx for both gateways.
    assert parse("envoy", envoy_line(response_code=0, response_flags="DC")).status == 499


def test_the_documented_envoy_json_format_is_what_the_envoy_format_reads():
    snippet = yaml.safe_load((REPO / "examples" / "envoy-access-log.yaml").read_text())
    config = snippet["access_log"][0]["typed_config"]
    assert config["@type"] == "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"
    fields = config["log_format"]["json_format"]
    assert sorted(fields) == sorted([*envoy.FIELDS, "first_body_byte_us"])
    assert fields["session_id"] == "%REQ(X-SESSION-ID)%" and fields["request_id"] == "%REQ(X-REQUEST-ID)%"
    # The line of these tests has exactly the documented fields.
    assert sorted(json.loads(ENVOY_LINE)) == sorted(fields)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"duration":412,"listener":"affinity"\n', "invalid_json"),
        (envoy_line(session_id=None, request_id=None), "bad_value"),
        # Envoy's v2 json_format wrote every value as a string.
        (envoy_line(response_code="200"), "wrong_type"),
        (envoy_line(upstream_request_attempt_count=True), "wrong_type"),
        (envoy_line(upstream_host=["10.0.0.1:8000"]), "wrong_type"),
        (ENVOY_LINE.replace('"response_flags":"-",', ""), "missing_field"),
        (envoy_line(start_time="[2026-12-01T13:20:31.123Z]"), "bad_value"),
        (envoy_line(start_time="2026-12-01T13:20:31.123"), "bad_value"),  # no time zone
        (envoy_line(duration=-1), "bad_value"),
        (ENVOY_LINE.replace('"duration":412', '"duration":NaN'), "bad_value"),
        (envoy_line(response_code=1000), "bad_value"),
    ],
)
def test_malformed_envoy_lines_are_counted_by_reason_and_reading_goes_on(tmp_path, line, reason):
    log = tmp_path / "envoy.jsonl"
    log.write_text(ENVOY_LINE + line + ENVOY_LINE)
    with GatewayLogFollower(log, "envoy", log_format="envoy", clock=lambda: STARTED + 60) as follower:
        snapshot = follower.poll()
    assert snapshot.lines == 3
    assert snapshot.malformed == {**dict.fromkeys(MALFORMED_REASONS, 0), reason: 1}
    assert snapshot.requests == {("affinity", R1): 2}


def test_an_envoy_start_time_far_ahead_of_the_clock_cannot_keep_a_session_active(tmp_path):
    log = tmp_path / "envoy.jsonl"
    log.write_text(envoy_line(start_time="9999-12-31T23:59:59.999Z"))
    now = [STARTED]
    with GatewayLogFollower(log, "envoy", log_format="envoy", clock=lambda: now[0]) as follower:
        assert follower.poll().future_times == 1
        now[0] += 1801  # past the default TTL of 30 min
        assert follower.poll().active_sessions == {"affinity": 0}


def test_malformed_is_a_value_error_with_its_reason():
    with pytest.raises(Malformed) as raised:
        parse("nginx", ENVOY_LINE)
    assert raised.value.reason == "missing_field"


def test_the_service_follows_an_envoy_log_with_the_same_metrics(tmp_path: Path):
    log = tmp_path / "envoy.jsonl"
    # The service's clock is the real one: lines of now, within its spread window.
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    log.write_text(
        envoy_line(start_time=now, session_id="s1")
        + envoy_line(start_time=now, session_id="s1", upstream_host=R2, upstream_request_attempt_count=2)
        + envoy_line(start_time=now, session_id=None)
        + envoy_line(
            start_time=now, session_id="s2", upstream_host=None, response_flags="UH", response_code=503
        )
    )
    config = Config(
        gateway_logs=(GatewayLog(name="envoy", path=log, format="envoy"),),
        exporter=ExporterSettings(f"127.0.0.1:{free_port()}"),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    service = Service(config)
    try:
        service.poll_gateway_logs()
    finally:
        service.followers[0].close()
        service.store.close()

    def value(name: str, **labels: str) -> float | None:
        return service.registry.get_sample_value(f"kvwatch_gateway_{name}", {"log": "envoy", **labels})

    listener = {"listener": "affinity"}
    assert value("lines_total") == 4 and value("malformed_lines_total", reason="missing_field") == 0
    assert value("requests_total", **listener, upstream=R1) == 2
    assert value("requests_total", **listener, upstream=R2) == 1
    assert value("requests_total", **listener, upstream="none") == 1
    assert value("responses_total", **listener, status_class="5xx") == 1
    assert value("failovers_total", **listener) == 1
    assert value("requests_without_session_key_total", **listener) == 1
    assert value("session_spread_sessions", **listener, failover="true") == 1
    assert value("session_spread_sessions", **listener, failover="false") == 0


def ingress_line(**changes: object) -> str:
    return json.dumps({**json.loads(INGRESS_NGINX_LINE), **changes}) + "\n"


def test_an_ingress_nginx_request_without_the_session_header_is_one_the_gateway_assigned():
    keyless = parse("ingress-nginx", ingress_line(session_id="", upstream_addr=R1))
    assert (keyless.session_id, keyless.assigned, keyless.failover) == ("5f1c0d2b9a3e4f60", True, False)
    no_server = parse("ingress-nginx", ingress_line(upstream_addr="", status=503))
    assert no_server.upstream == NO_UPSTREAM


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"req_id": None}, "wrong_type"),
        ({"status": "200"}, "wrong_type"),
        ({"msec": float("nan")}, "bad_value"),
    ],
)
def test_an_ingress_nginx_line_without_what_kvwatch_counts_is_malformed(changes, reason):
    record = {**json.loads(INGRESS_NGINX_LINE), **changes}
    with pytest.raises(Malformed) as raised:
        LOG_FORMATS["ingress-nginx"].parse(record)
    assert raised.value.reason == reason
    without_backend = json.loads(INGRESS_NGINX_LINE)
    del without_backend["proxy_upstream_name"]
    with pytest.raises(Malformed, match="missing_field"):
        LOG_FORMATS["ingress-nginx"].parse(without_backend)
