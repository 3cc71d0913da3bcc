"""The sending side of the gateway-log sources benchmark (bench_gatewaylog_sources.py), in a process of its
own so that the receiving process's CPU time is the receiver's alone.

`python -m benchmarks.gatewaylog_senders KIND PORT LINES` builds its traffic, prints "ready", and on a
line from stdin sends it all and prints "done". Over UDP, which has no flow control, it sends WINDOW
datagrams at a time, printing "sent N" after each and waiting for a line on stdin (the receiver has taken
them) before the next, so that none is lost to a full receive queue.
"""

from __future__ import annotations

import http.client
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import grpc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs

from benchmarks.bench_gatewaylog import entries, lines
from kvwatch.collectors.gatewaylogs.sources.otlp.transports import EXPORT_METHOD, LOGS_PATH

# Well under the 4 MiB receive queue syslog asks for (net.core.rmem_max here), each datagram's
# bookkeeping included.
WINDOW = 1000
# Envoy's OpenTelemetry access logger flushes its buffer at 16 KiB (buffer_size_bytes' default).
BATCH_BYTES = 16 * 1024
IN_FLIGHT = 4  # the receiver's default max_in_flight
HOST = "127.0.0.1"


def envoy_entries(count: int) -> Iterator[dict[str, object]]:
    """The same requests as Envoy's JSON file log writes them (examples/envoy-access-log.yaml)."""
    for i, entry in enumerate(entries(count)):
        tried = entry["upstream_addr"].split(", ")
        started = datetime.fromtimestamp(entry["msec"] - 0.412, UTC)
        assigned = entry["session_source"] == "assigned"
        yield {
            "start_time": started.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "duration": 412,
            "listener": entry["listener"],
            "response_code": entry["status"],
            "response_flags": "URX" if len(tried) > 1 else "-",
            "upstream_host": tried[-1],
            "upstream_request_attempt_count": len(tried),
            "session_id": None if assigned else entry["session_id"],
            "request_id": entry["session_id"] if assigned else f"{i:032x}",
        }


def otlp_record(entry: dict[str, object]) -> LogRecord:
    """A request as Envoy's OpenTelemetry access logger sends it: every field a string attribute, "-" for
    none (examples/envoy-otlp-access-log.yaml)."""
    attributes = [
        KeyValue(key=key, value=AnyValue(string_value="-" if value is None else str(value)))
        for key, value in entry.items()
    ]
    return LogRecord(time_unix_nano=1, attributes=attributes)


def otlp_batches(count: int) -> list[bytes]:
    """Export requests of up to BATCH_BYTES each, serialized."""
    batches, records, size = [], [], 0
    for entry in envoy_entries(count):
        record = otlp_record(entry)
        records.append(record)
        size += record.ByteSize()
        if size >= BATCH_BYTES:
            batches.append(_request(records))
            records, size = [], 0
    if records:
        batches.append(_request(records))
    return batches


def _request(records: list[LogRecord]) -> bytes:
    scope = ScopeLogs(log_records=records)
    return ExportLogsServiceRequest(resource_logs=[ResourceLogs(scope_logs=[scope])]).SerializeToString()


def rfc3164(count: int) -> list[bytes]:
    """nginx's `access_log syslog:server=...`: `<PRI>TIMESTAMP HOSTNAME TAG: MSG`."""
    return [b"<190>Dec  5 07:12:15 gateway nginx: " + line for line in lines(count)]


def rfc5424(count: int) -> list[bytes]:
    """rsyslog's RFC 5424 forwarding format (RSYSLOG_SyslogProtocol23Format)."""
    return [b"<190>1 2026-12-05T07:12:15.123456+00:00 gateway nginx - - - " + line for line in lines(count)]


def octet_counted(count: int) -> list[bytes]:
    """RFC 5424 messages framed for TCP by octet counting (RFC 6587), as rsyslog's omfwd sends them."""
    return [b"%d %s" % (len(frame), frame) for frame in rfc5424(count)]


def send_udp(port: int, frames: list[bytes]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for start in range(0, len(frames), WINDOW):
            window = frames[start : start + WINDOW]
            for frame in window:
                sock.sendto(frame, (HOST, port))
            print(f"sent {start + len(window)}", flush=True)
            sys.stdin.readline()


def send_tcp(port: int, frames: list[bytes]) -> None:
    with socket.create_connection((HOST, port)) as sock:
        for start in range(0, len(frames), WINDOW):
            sock.sendall(b"".join(frames[start : start + WINDOW]))


def send_grpc(port: int, batches: list[bytes]) -> None:
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        export = channel.unary_unary(EXPORT_METHOD)  # bytes in, bytes out
        pending = []
        for batch in batches:
            pending.append(export.future(batch, timeout=60))
            if len(pending) >= IN_FLIGHT:
                pending.pop(0).result()
        for call in pending:
            call.result()


def send_http(port: int, batches: list[bytes]) -> None:
    """IN_FLIGHT keep-alive connections, each POSTing its share of the batches one after the other."""
    failures: list[str] = []

    def post_all(share: list[bytes]) -> None:
        connection = http.client.HTTPConnection(HOST, port, timeout=60)
        for batch in share:
            connection.request("POST", LOGS_PATH, batch, {"Content-Type": "application/x-protobuf"})
            answer = connection.getresponse()
            answer.read()
            if answer.status != 200:
                failures.append(f"HTTP {answer.status}")
        connection.close()

    threads = [threading.Thread(target=post_all, args=(batches[i::IN_FLIGHT],)) for i in range(IN_FLIGHT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"the OTLP/HTTP receiver answered {failures[0]} ({len(failures)} times)")


# kind -> (its traffic for a count of lines, how it is sent to a port)
KINDS: dict[str, tuple[Callable[[int], list[bytes]], Callable[[int, list[bytes]], None]]] = {
    "syslog-udp-3164": (rfc3164, send_udp),
    "syslog-udp-5424": (rfc5424, send_udp),
    "syslog-tcp-5424": (octet_counted, send_tcp),
    "otlp-grpc": (otlp_batches, send_grpc),
    "otlp-http": (otlp_batches, send_http),
}


def main(kind: str, port: int, count: int) -> None:
    traffic, send = KINDS[kind]
    payloads = traffic(count)
    print("ready", flush=True)
    sys.stdin.readline()
    send(port, payloads)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
