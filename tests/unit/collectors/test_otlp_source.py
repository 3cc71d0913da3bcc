"""The OTLP gateway-log source: what each transport does with good and bad input, each refusal counted
by its reason while the source keeps serving (the real Envoy: tests/integration/test_otlp_envoy.py)."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue, KeyValueList
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs

from conftest import RecordingTally
from kvwatch.collectors.gatewaylogs import LOG_FORMATS, envoy
from kvwatch.collectors.gatewaylogs.sources import SourceUnavailable, open_log
from kvwatch.collectors.gatewaylogs.sources.otlp import (
    OtlpConfigError,
    OtlpSource,
    OtlpSourceConfig,
)
from kvwatch.collectors.gatewaylogs.sources.otlp.transports import CONNECTIONS_PER_SLOT as CONNECTIONS
from kvwatch.collectors.gatewaylogs.sources.otlp.transports import EXPORT_METHOD
from kvwatch.config.settings import GatewayLog
from processes import free_port, http_post

REPO = Path(__file__).resolve().parents[3]
# As Envoy's OpenTelemetry access logger sends a request (examples/envoy-otlp-access-log.yaml).
ENVOY_ATTRIBUTES = {
    "start_time": "2026-12-05T05:28:35.055Z",
    "duration": "38",
    "listener": "chat",
    "response_code": "200",
    "response_flags": "-",
    "upstream_host": "127.0.0.1:8001",
    "upstream_request_attempt_count": "1",
    "session_id": "-",
    "request_id": "45a54e73",
}
# What Envoy's JSON file log writes for the same request.
FILE_LOG_LINE = {
    **ENVOY_ATTRIBUTES,
    "duration": 38,
    "response_code": 200,
    "upstream_request_attempt_count": 1,
    "session_id": None,
}


def key_values(fields: dict[str, object]) -> list[KeyValue]:
    return [KeyValue(key=key, value=AnyValue(string_value=str(value))) for key, value in fields.items()]


def export_request(*log_records: LogRecord) -> ExportLogsServiceRequest:
    scope = ScopeLogs(log_records=list(log_records))
    return ExportLogsServiceRequest(resource_logs=[ResourceLogs(scope_logs=[scope])])


def envoy_record(**changes: str) -> LogRecord:
    return LogRecord(attributes=key_values({**ENVOY_ATTRIBUTES, **changes}))


@pytest.fixture
def tally() -> RecordingTally:
    return RecordingTally()


@pytest.fixture
def serve(request, tally):
    def start(**options) -> OtlpSource:
        config = OtlpSourceConfig(listen="127.0.0.1:0", http_listen="127.0.0.1:0", **options)
        source = OtlpSource(config, tally)
        source.start()
        request.addfinalizer(source.stop)
        return source

    return start


def grpc_export(source: OtlpSource, body: bytes, metadata=(), credentials=None) -> ExportLogsServiceResponse:
    target = f"127.0.0.1:{source.grpc_port}"
    if credentials:
        options = [("grpc.ssl_target_name_override", "localhost")]
        channel = grpc.secure_channel(target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        call = channel.unary_unary(EXPORT_METHOD, response_deserializer=ExportLogsServiceResponse.FromString)
        return call(body, metadata=metadata, timeout=10)


def grpc_status(source: OtlpSource, body: bytes, metadata=()) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        grpc_export(source, body, metadata)
    return refused.value.code()


def http_export(source: OtlpSource, body: bytes, kind="application/x-protobuf", **headers) -> httpx.Response:
    url = f"http://127.0.0.1:{source.http_port}/v1/logs"
    return http_post(url, content=body, headers={"Content-Type": kind, **headers}, timeout=10)


def test_envoy_attributes_become_the_records_its_file_log_writes(serve, tally):
    source = serve()
    answer = grpc_export(source, export_request(envoy_record(), envoy_record()).SerializeToString())
    assert not answer.HasField("partial_success")
    assert tally.records == [FILE_LOG_LINE, FILE_LOG_LINE]
    LOG_FORMATS.lookup("envoy").parse(tally.records[0])


def test_the_fields_come_from_a_kvlist_body_or_a_json_body(serve, tally):
    source = serve()
    kvlist = LogRecord(body=AnyValue(kvlist_value=KeyValueList(values=key_values(ENVOY_ATTRIBUTES))))
    json_body = LogRecord(body=AnyValue(string_value=json.dumps(FILE_LOG_LINE)))
    grpc_export(source, export_request(kvlist, json_body).SerializeToString())
    assert tally.records == [FILE_LOG_LINE, FILE_LOG_LINE]


def test_a_record_without_a_field_is_refused_and_the_rest_delivered(serve, tally):
    source = serve()
    incomplete = LogRecord(attributes=key_values({"listener": "chat"}), body=AnyValue(string_value="GET /"))
    answer = grpc_export(source, export_request(envoy_record(), incomplete).SerializeToString())
    assert answer.partial_success.rejected_log_records == 1
    assert "missing_field" in answer.partial_success.error_message
    assert (tally.records, tally.refused) == ([FILE_LOG_LINE], ["missing_field"])


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe garbage", export_request(envoy_record()).SerializeToString()[:-7]],
    ids=["garbage", "truncated"],
)
def test_bytes_that_are_no_request_are_refused_and_the_source_serves_on(serve, tally, body):
    source = serve()
    assert grpc_status(source, body) == grpc.StatusCode.INVALID_ARGUMENT
    assert http_export(source, body).status_code == 400
    assert tally.refused == ["malformed_protobuf", "malformed_protobuf"]
    grpc_export(source, export_request(envoy_record()).SerializeToString())
    assert tally.records == [FILE_LOG_LINE]


def test_an_oversize_request_is_refused(serve, tally):
    big = export_request(*[envoy_record() for _ in range(10)]).SerializeToString()
    source = serve(max_request_bytes=len(big) - 1)
    assert grpc_status(source, big) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert http_export(source, big).status_code == 413
    assert (tally.records, tally.refused) == ([], ["oversize", "oversize"])


def test_past_twice_the_limit_grpc_refuses_a_message_itself(serve, tally):
    """Its transport refuses to read it: the sender sees RESOURCE_EXHAUSTED and counts it."""
    huge = export_request(*[envoy_record() for _ in range(10)]).SerializeToString()
    source = serve(max_request_bytes=len(huge) // 2 - 1)
    assert grpc_status(source, huge) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert tally.refused == []


def test_an_http_body_shorter_than_its_length_is_refused_as_truncated(serve, tally):
    source = serve()
    with socket.create_connection(("127.0.0.1", source.http_port), timeout=10) as connection:
        head = b"POST /v1/logs HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        connection.sendall(head + b"\x0a\x02")
        connection.shutdown(socket.SHUT_WR)
        assert connection.recv(100).startswith(b"HTTP/1.1 400")
    assert tally.refused == ["truncated"]


def test_a_flood_is_held_to_the_rate_and_counted(serve, tally):
    source = serve(max_records_per_second=10)
    answer = grpc_export(source, export_request(*[envoy_record() for _ in range(25)]).SerializeToString())
    assert answer.partial_success.rejected_log_records == 15
    assert answer.partial_success.error_message == "15 over_rate"
    assert (len(tally.records), tally.refused) == (10, ["over_rate"] * 15)


def test_a_sender_holding_every_slot_gets_the_next_one_refused_as_busy(serve, tally):
    source = serve(max_in_flight=1)
    with socket.create_connection(("127.0.0.1", source.http_port), timeout=10) as slow:
        slow.sendall(b"POST /v1/logs HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n\x0a")
        answers = [http_export_or_none(source) for _ in range(50)]
        assert 503 in answers  # at once, while the slow sender still holds the only slot
    assert "busy" in tally.refused


def test_connections_past_the_bound_are_closed_and_counted_as_busy(serve, tally):
    source = serve(max_in_flight=1)
    idle = [socket.create_connection(("127.0.0.1", source.http_port), timeout=10) for _ in range(CONNECTIONS)]
    try:
        with pytest.raises(httpx.TransportError):
            http_export(source, export_request(envoy_record()).SerializeToString())
        assert tally.refused == ["busy"]
    finally:
        for connection in idle:
            connection.close()
    # Once the idle ones are gone, a sender is served again.
    deadline = time.monotonic() + 10
    while http_export_or_none(source) != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tally.records == [FILE_LOG_LINE]


def http_export_or_none(source: OtlpSource) -> int | None:
    try:
        return http_export(source, export_request(envoy_record()).SerializeToString()).status_code
    except httpx.TransportError:
        return None


@pytest.mark.parametrize("sent", [None, "Bearer wrong", "Bearer s3cret-but-longer", "s3cret"])
def test_a_missing_or_wrong_token_is_unauthenticated(serve, tally, tmp_path, sent):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    source = serve(token_file=token_file)
    body = export_request(envoy_record()).SerializeToString()
    metadata = [("authorization", sent)] if sent else []
    assert grpc_status(source, body, metadata) == grpc.StatusCode.UNAUTHENTICATED
    assert http_export(source, body, **({"Authorization": sent} if sent else {})).status_code == 401
    assert (tally.records, tally.refused) == ([], ["unauthenticated", "unauthenticated"])
    grpc_export(source, body, [("authorization", "Bearer s3cret")])
    assert http_export(source, body, Authorization="Bearer s3cret").status_code == 200
    assert tally.records == [FILE_LOG_LINE, FILE_LOG_LINE]


def test_otlp_json_over_http(serve, tally):
    source = serve()
    attributes = [{"key": k, "value": {"stringValue": v}} for k, v in ENVOY_ATTRIBUTES.items()]
    record = {"traceId": "5b8efff798038103d269b633813fc60c", "attributes": attributes}
    document = {"resourceLogs": [{"scopeLogs": [{"logRecords": [record]}]}]}
    answer = http_export(source, json.dumps(document).encode(), "application/json")
    assert (answer.status_code, answer.json()) == (200, {})
    assert http_export(source, b"{not json", "application/json").status_code == 400
    assert (tally.records, tally.refused) == ([FILE_LOG_LINE], ["malformed_json"])


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_with_tls_only_tls_clients_are_served(serve, tally, certificate):
    cert, key = certificate
    source = serve(tls_cert_file=cert, tls_key_file=key)
    body = export_request(envoy_record()).SerializeToString()
    with pytest.raises(grpc.RpcError):
        grpc_export(source, body)  # plaintext to a TLS port
    with pytest.raises(httpx.TransportError):
        http_export(source, body)
    grpc_export(source, body, credentials=grpc.ssl_channel_credentials(cert.read_bytes()))
    url = f"https://127.0.0.1:{source.http_port}/v1/logs"
    answer = httpx.post(url, content=body, verify=ssl.create_default_context(cafile=cert), timeout=10)
    assert answer.status_code == 200
    assert tally.records == [FILE_LOG_LINE, FILE_LOG_LINE]


def test_without_tls_a_tls_client_is_not_served(serve, tally, certificate):
    source = serve()
    body = export_request(envoy_record()).SerializeToString()
    with pytest.raises(grpc.RpcError):
        grpc_export(source, body, credentials=grpc.ssl_channel_credentials(certificate[0].read_bytes()))
    grpc_export(source, body)
    assert tally.records == [FILE_LOG_LINE]


def test_stop_closes_the_sockets(serve):
    source = serve()
    source.stop()
    for port in (source.grpc_port, source.http_port):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.mark.parametrize(
    "options",
    [{"listen": "nowhere"}, {"tls_cert_file": Path("cert.pem")}, {"max_records_per_second": 0}],
)
def test_a_section_that_cannot_serve_is_refused(options):
    with pytest.raises(OtlpConfigError):
        OtlpSourceConfig(**options)


def test_a_gateway_log_with_source_otlp_counts_what_envoy_sends_and_what_it_refuses(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    section = GatewayLog(name="gw", format="envoy", source="otlp", listen=str(free_port()), token_file=token)
    log = open_log(section)
    log.start()
    try:
        with grpc.insecure_channel(section.listen) as channel:
            export = channel.unary_unary(EXPORT_METHOD)
            metadata = [("authorization", "Bearer s3cret")]
            export(export_request(envoy_record(), envoy_record()).SerializeToString(), metadata=metadata)
            with pytest.raises(grpc.RpcError):
                export(b"\xff\xfe garbage", metadata=metadata)
            with pytest.raises(grpc.RpcError):
                export(export_request(envoy_record()).SerializeToString(), metadata=[("authorization", "x")])
        snapshot = log.poll()
    finally:
        log.close()
    assert sum(snapshot.requests.values()) == 2
    assert {reason: count for reason, count in snapshot.refused.items() if count} == {
        "malformed_protobuf": 1,
        "unauthenticated": 1,
    }


OTLP_LOG = GatewayLog(name="gw", format="envoy", source="otlp")


def test_a_gateway_log_with_http_listen_takes_otlp_http_beside_grpc():
    grpc_port, http_port = free_port(), free_port()
    log = open_log(replace(OTLP_LOG, listen=str(grpc_port), http_listen=str(http_port)))
    log.start()
    try:
        body = export_request(envoy_record(), envoy_record()).SerializeToString()
        url = f"http://127.0.0.1:{http_port}/v1/logs"
        answer = http_post(url, content=body, headers={"Content-Type": "application/x-protobuf"}, timeout=10)
        assert answer.status_code == 200, answer.text
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            channel.unary_unary(EXPORT_METHOD)(export_request(envoy_record()).SerializeToString(), timeout=10)
        snapshot = log.poll()
    finally:
        log.close()
    assert sum(snapshot.requests.values()) == 3


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_gateway_log_whose_otlp_port_is_taken_says_so(transport):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if transport == "grpc":
            section = replace(OTLP_LOG, listen=f"127.0.0.1:{port}")
            said = f"gRPC cannot bind 127.0.0.1:{port}"
        else:
            section = replace(OTLP_LOG, listen=str(free_port()), http_listen=f"127.0.0.1:{port}")
            said = f"OTLP/HTTP cannot bind 127.0.0.1:{port}: Address already in use"
        log = open_log(section)
        with pytest.raises(SourceUnavailable, match=f"gw: cannot listen for its otlp source: {said}"):
            log.start()


def documented_otlp_blocks() -> list[dict]:
    """The YAML blocks of docs/gateway-logs.md's OTLP section (Envoy, Istio, Envoy Gateway, kvwatch)."""
    page = (REPO / "docs" / "gateway-logs.md").read_text()
    section = page.partition("## Envoy, Istio and Envoy Gateway over OpenTelemetry")[2]
    blocks = [block.partition("```")[0] for block in section.split("```yaml\n")[1:]]
    return [document for block in blocks for document in yaml.safe_load_all(block)]


def test_the_documented_configs_send_the_fields_the_envoy_format_reads():
    example = yaml.safe_load((REPO / "examples" / "envoy-otlp-access-log.yaml").read_text())
    envoy_doc, istio, istio_telemetry, gateway, kvwatch_config = documented_otlp_blocks()
    assert GatewayLog(**kvwatch_config["gateway_logs"][0]).listen == "0.0.0.0:4317"
    assert envoy_doc == example
    attributes = example["access_log"][0]["typed_config"]["attributes"]["values"]
    sent = {pair["key"]: pair["value"]["string_value"] for pair in attributes}
    assert sorted(sent) == sorted([*envoy.FIELDS, "first_body_byte_us"])
    (provider,) = istio["meshConfig"]["extensionProviders"]
    assert provider["envoyOtelAls"]["logFormat"]["labels"] == sent
    assert istio_telemetry["spec"]["accessLogging"][0]["providers"] == [{"name": provider["name"]}]
    (setting,) = gateway["spec"]["telemetry"]["accessLog"]["settings"]
    assert setting["format"]["json"] == sent
    assert setting["sinks"][0]["type"] == "OpenTelemetry"
