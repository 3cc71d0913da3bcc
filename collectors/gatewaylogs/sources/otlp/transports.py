"""OTLP's two transports for logs: gRPC (LogsService/Export) and HTTP (POST /v1/logs, protobuf or JSON).

Both bound what one sender can cost: a request's size, the requests handled at once, and the records
per second (receiver.py). gRPC itself refuses a message past twice max_request_bytes, and calls past
twice max_in_flight at once, with RESOURCE_EXHAUSTED before kvwatch sees them: the sender counts those.
"""

from __future__ import annotations

import json
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)

from kvwatch.collectors.gatewaylogs.sources.otlp.receiver import Receiver, Refused, host_and_port

EXPORT_METHOD = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"
LOGS_PATH = "/v1/logs"
# A sender that stops mid-request is let go after this long.
HTTP_READ_TIMEOUT_S = 10.0
# Open HTTP connections per request handled at once: idle keep-alive senders beside the busy ones. Past
# this a new connection is closed at once (counted as busy), so that connections cannot pile up threads.
CONNECTIONS_PER_SLOT = 4
_GRPC_STATUS = {
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "oversize": grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_HTTP_STATUS = {
    "unauthenticated": HTTPStatus.UNAUTHORIZED,
    "oversize": HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    "busy": HTTPStatus.SERVICE_UNAVAILABLE,
}


def _credentials(receiver: Receiver) -> tuple[bytes, bytes] | None:
    config = receiver.config
    if config.tls_cert_file is None:
        return None
    return config.tls_key_file.read_bytes(), config.tls_cert_file.read_bytes()


def grpc_server(receiver: Receiver) -> tuple[grpc.Server, int]:
    """The LogsService on the configured address, not yet started; with the port it bound."""
    limit = receiver.config.max_request_bytes

    def export(body: bytes, context: grpc.ServicerContext) -> ExportLogsServiceResponse:
        try:
            receiver.check_token(dict(context.invocation_metadata()).get("authorization"))
            return receiver.export(receiver.decode(body))
        except Refused as refused:
            context.abort(_GRPC_STATUS.get(refused.reason, grpc.StatusCode.INVALID_ARGUMENT), refused.reason)

    handler = grpc.unary_unary_rpc_method_handler(
        export, response_serializer=ExportLogsServiceResponse.SerializeToString
    )
    service, _, method = EXPORT_METHOD[1:].rpartition("/")
    server = grpc.server(
        ThreadPoolExecutor(max_workers=receiver.config.max_in_flight, thread_name_prefix="otlp-grpc"),
        handlers=[grpc.method_handlers_generic_handler(service, {method: handler})],
        maximum_concurrent_rpcs=2 * receiver.config.max_in_flight,
        # Up to twice the limit reaches the handler, which counts it as oversize.
        options=[("grpc.max_receive_message_length", 2 * limit), ("grpc.so_reuseport", 0)],
    )
    host, port = host_and_port(receiver.config.listen)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    key_and_cert = _credentials(receiver)
    try:
        if key_and_cert:
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([key_and_cert]))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # what grpcio raises when it cannot bind; it does not say why
        bound = 0
    return server, bound


class _LogsHandler(BaseHTTPRequestHandler):
    server: _LogsHttpServer
    timeout = HTTP_READ_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        receiver = self.server.receiver
        if not self.server.slots.acquire(blocking=False):
            receiver.tally.refuse("busy")
            self._answer(_HTTP_STATUS["busy"], b"busy\n", "text/plain", close=True)
            return
        try:
            self._export(receiver)
        except Refused as refused:
            status = _HTTP_STATUS.get(refused.reason, HTTPStatus.BAD_REQUEST)
            self._answer(status, f"{refused.reason}\n".encode(), "text/plain", close=True)
        finally:
            self.server.slots.release()

    def _export(self, receiver: Receiver) -> None:
        if self.path.partition("?")[0] != LOGS_PATH:
            self._answer(
                HTTPStatus.NOT_FOUND, b"OTLP logs are POSTed to /v1/logs\n", "text/plain", close=True
            )
            return
        receiver.check_token(self.headers.get("Authorization"))
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            self._answer(HTTPStatus.LENGTH_REQUIRED, b"Content-Length required\n", "text/plain", close=True)
            return
        receiver.check_size(int(length))
        body = self.rfile.read(int(length))
        if len(body) < int(length):
            receiver.refuse("truncated")
        kind = self.headers.get("Content-Type", "").partition(";")[0].strip()
        if kind == "application/json":
            answer = receiver.export(_json_request(receiver, body))
            self._answer(HTTPStatus.OK, json_format.MessageToJson(answer).encode(), kind)
        else:
            answer = receiver.export(receiver.decode(body))
            self._answer(HTTPStatus.OK, answer.SerializeToString(), "application/x-protobuf")

    def _answer(self, status: int, body: bytes, kind: str, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: every refusal is counted by reason instead."""


def _json_request(receiver: Receiver, body: bytes) -> ExportLogsServiceRequest:
    """OTLP/JSON: protobuf's JSON mapping, but with hex trace and span ids, which kvwatch does not read."""
    try:
        document = json.loads(body)
        for resource in document.get("resourceLogs", []):
            for scope in resource.get("scopeLogs", []):
                for record in scope.get("logRecords", []):
                    for hex_id in ("traceId", "spanId"):
                        record.pop(hex_id, None)
        return json_format.ParseDict(document, ExportLogsServiceRequest(), ignore_unknown_fields=True)
    except (ValueError, TypeError, AttributeError, RecursionError, json_format.ParseError):
        receiver.refuse("malformed_json")


class _LogsHttpServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.slots = threading.BoundedSemaphore(receiver.config.max_in_flight)
        self.connections = threading.BoundedSemaphore(CONNECTIONS_PER_SLOT * receiver.config.max_in_flight)
        super().__init__(host_and_port(receiver.config.http_listen), _LogsHandler)
        key_and_cert = _credentials(receiver)
        if key_and_cert:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(receiver.config.tls_cert_file, receiver.config.tls_key_file)
            # The handshake happens in the request's thread, so that a silent client stalls no one else.
            self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def process_request(self, request, client_address) -> None:
        if not self.connections.acquire(blocking=False):
            self.receiver.tally.refuse("busy")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release()

    def handle_error(self, request, client_address) -> None:
        """A client that goes away mid-request or fails the handshake concerns no other."""


def http_server(receiver: Receiver) -> ThreadingHTTPServer:
    return _LogsHttpServer(receiver)
