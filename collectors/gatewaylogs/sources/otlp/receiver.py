"""What both OTLP transports do with one Export request: check the bearer token, decode the logs, hold
the sender to its rate, hand each record on, and answer with OTLP's partial success.

Nothing a sender does stops the receiver: bytes that are no request, records without the format's
fields, a wrong token or a flood are each counted by `Tally.refuse` with one of tally.REFUSED_REASONS, and
the records that could be read are delivered all the same.
"""

from __future__ import annotations

import hmac
import itertools
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsPartialSuccess,
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)

from kvwatch.collectors.gatewaylogs.sources.otlp.records import (
    AccessLogRecords,
    FieldTypes,
    MissingFields,
    count_records,
    log_records,
)
from kvwatch.core.credentials import read_secret_file
from kvwatch.core.errors import KVWatchError

# OTLP/gRPC's usual message limit.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
# A busy ingress sends some thousands of requests a second; Envoy batches them by the second.
DEFAULT_MAX_RECORDS_PER_SECOND = 50_000.0
DEFAULT_MAX_IN_FLIGHT = 4


class Tally(Protocol):
    """The counting side: what a source hands its records and its refusals to."""

    def take_records(self, records: Iterable[Mapping[str, object]], received_at: float) -> None: ...

    def refuse(self, reason: str, count: int = 1) -> None: ...


class _OneAtATime:
    """The tally called by one thread at a time: the transports' worker threads take turns, so that the
    counting side needs no lock of its own (it is still called from threads other than its owner's)."""

    def __init__(self, tally: Tally) -> None:
        self._tally, self._lock = tally, threading.Lock()

    def take_records(self, records: Iterable[Mapping[str, object]], received_at: float) -> None:
        with self._lock:
            self._tally.take_records(records, received_at)

    def refuse(self, reason: str, count: int = 1) -> None:
        with self._lock:
            self._tally.refuse(reason, count)


class OtlpConfigError(KVWatchError, ValueError):
    """An OTLP source section that cannot serve: a bad address, or TLS half configured."""


@dataclass(frozen=True)
class OtlpSourceConfig:
    """One `source: otlp` section. `listen` is OTLP/gRPC's host:port, `http_listen` OTLP/HTTP's (None:
    no HTTP); port 0 picks a free port (OtlpSource.grpc_port, .http_port say which)."""

    listen: str = "127.0.0.1:4317"
    http_listen: str | None = None
    token_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_records_per_second: float = DEFAULT_MAX_RECORDS_PER_SECOND
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise OtlpConfigError("otlp source: tls_cert_file and tls_key_file go together")
        for address in (self.listen, self.http_listen):
            if address is not None:
                host_and_port(address)
        if self.max_request_bytes < 1 or self.max_records_per_second <= 0 or self.max_in_flight < 1:
            raise OtlpConfigError("otlp source: max_request_bytes, max_records_per_second, max_in_flight > 0")


def host_and_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise OtlpConfigError(f"otlp source: listen address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class RateLimit:
    """A token bucket of records: a second's worth at most, refilled at the rate."""

    def __init__(self, per_second: float) -> None:
        self._rate, self._tokens, self._at = per_second, per_second, time.monotonic()
        self._lock = threading.Lock()

    def admit(self, wanted: int) -> int:
        """How many of `wanted` records fit now; those are taken from the bucket."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
            self._at = now
            admitted = min(wanted, int(self._tokens))
            self._tokens -= admitted
            return admitted


class Refused(KVWatchError):
    """A whole request refused, with the reason it was counted by."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Receiver:
    """The transport-free part of the OTLP logs service, shared by gRPC and HTTP."""

    def __init__(
        self, config: OtlpSourceConfig, tally: Tally, fields: FieldTypes, optional: FieldTypes
    ) -> None:
        self.config, self.tally, self.fields = config, _OneAtATime(tally), fields
        self._access_log_record = AccessLogRecords(fields, optional)
        token = read_secret_file(config.token_file, "OTLP bearer token") if config.token_file else None
        self._expected = f"Bearer {token}".encode() if token else None
        self._rate = RateLimit(config.max_records_per_second)

    def check_token(self, authorization: str | None) -> None:
        """Raises Refused("unauthenticated") unless the request carries the token (if one is set)."""
        if self._expected is None:
            return
        if not hmac.compare_digest((authorization or "").encode(), self._expected):
            self.refuse("unauthenticated")

    def refuse(self, reason: str) -> None:
        self.tally.refuse(reason)
        raise Refused(reason)

    def check_size(self, size: int) -> None:
        if size > self.config.max_request_bytes:
            self.refuse("oversize")

    def decode(self, body: bytes) -> ExportLogsServiceRequest:
        self.check_size(len(body))
        try:
            return ExportLogsServiceRequest.FromString(body)
        except (DecodeError, RecursionError):
            self.refuse("malformed_protobuf")

    def export(self, request: ExportLogsServiceRequest) -> ExportLogsServiceResponse:
        """Every record delivered or counted; the answer names how many were rejected and why. The
        request's records reach the tally together, in one call."""
        received_at = time.time()
        total = count_records(request)
        admitted = self._rate.admit(total)
        records, missing = [], 0
        for log_record in itertools.islice(log_records(request), admitted):
            try:
                records.append(self._access_log_record(log_record))
            except MissingFields:
                missing += 1
        self.tally.take_records(records, received_at)
        rejected = {"missing_field": missing, "over_rate": total - admitted}
        rejected = {reason: count for reason, count in rejected.items() if count}
        for reason, count in rejected.items():
            self.tally.refuse(reason, count)
        if not rejected:
            return ExportLogsServiceResponse()
        message = ", ".join(f"{count} {reason}" for reason, count in rejected.items())
        partial = ExportLogsPartialSuccess(rejected_log_records=sum(rejected.values()), error_message=message)
        return ExportLogsServiceResponse(partial_success=partial)
