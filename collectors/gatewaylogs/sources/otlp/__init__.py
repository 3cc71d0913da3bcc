"""The `otlp` gateway-log source: an OTLP logs receiver (gRPC, and HTTP when configured) for gateways
that ship access logs over OpenTelemetry, as Envoy's `envoy.access_loggers.open_telemetry` does for
Istio (`envoyOtelAls`) and Envoy Gateway (docs/gateway-logs.md).

A push source: `start()` binds and serves, `stop()` returns once its sockets are closed. Each record
reaches the tally as the access-log record its format parses (records.py); what cannot be read is
refused by one of tally.REFUSED_REASONS. `SOURCE` builds one from a gateway log's config section.
"""

from __future__ import annotations

import threading

from kvwatch.collectors.gatewaylogs import envoy
from kvwatch.collectors.gatewaylogs.base import session_fields
from kvwatch.collectors.gatewaylogs.sources.base import Source, SourceUnavailable
from kvwatch.collectors.gatewaylogs.sources.otlp.receiver import (
    OtlpConfigError,
    OtlpSourceConfig,
    Receiver,
    Tally,
)
from kvwatch.collectors.gatewaylogs.sources.otlp.records import FieldTypes
from kvwatch.core.credentials import CredentialError

__all__ = ["SOURCE", "OtlpConfigError", "OtlpSource", "OtlpSourceConfig", "Tally"]


class OtlpSource:
    """Receives OTLP logs for one gateway log. `fields` are the format's fields and their types (Envoy's
    by default), the keys of every record handed to `tally.take_records`; `optional` those a record may
    have (Envoy's optional fields by default)."""

    def __init__(
        self,
        config: OtlpSourceConfig,
        tally: Tally,
        fields: FieldTypes = envoy.FIELDS,
        optional: FieldTypes = envoy.OPTIONAL_FIELDS,
    ) -> None:
        # Reads the token file: a bad one fails here.
        self._receiver = Receiver(config, tally, fields, optional)
        self._grpc = None
        self._http = None
        self._http_thread: threading.Thread | None = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None

    def start(self) -> None:
        """Serving once it returns; raises OSError when the gRPC address (gRPC does not say why) or the HTTP
        one cannot be bound."""
        # gRPC starts its own threads and descriptors when imported: only a serve with an OTLP source pays.
        from kvwatch.collectors.gatewaylogs.sources.otlp.transports import grpc_server, http_server

        server, port = grpc_server(self._receiver)
        if not port:
            raise OSError(f"gRPC cannot bind {self._receiver.config.listen}")
        server.start()
        self._grpc, self.grpc_port = server, port
        if self._receiver.config.http_listen is not None:
            try:
                self._http = http_server(self._receiver)
            except OSError as error:
                self.stop()
                address = self._receiver.config.http_listen
                raise OSError(f"OTLP/HTTP cannot bind {address}: {error.strerror}") from None
            self.http_port = self._http.server_address[1]
            self._http_thread = threading.Thread(
                target=self._http.serve_forever, name="otlp-http", kwargs={"poll_interval": 0.2}, daemon=True
            )
            self._http_thread.start()

    def stop(self) -> None:
        """Returns once both listening sockets are closed; requests in progress are cut short."""
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait()
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http_thread.join()
            self._http = self._http_thread = None


# The keys of a gateway log's section (config.settings.GatewayLog) that an OTLP source's config shares.
SECTION_KEYS = (
    "listen", "http_listen", "token_file", "tls_cert_file", "tls_key_file", "max_records_per_second",
)  # fmt: skip


def _receiver(section, tally: Tally) -> OtlpSource:
    """The OTLP/gRPC receiver of a `source: otlp` gateway log (config.settings.GatewayLog), and its OTLP/HTTP
    one where the section sets http_listen."""
    config = OtlpSourceConfig(**{key: getattr(section, key) for key in SECTION_KEYS})
    # The session keys' headers (config session_keys), in attributes named as in a file's lines.
    keyed = dict.fromkeys(session_fields(section.session_keys), (str, type(None)))
    try:
        return OtlpSource(config, tally, optional={**envoy.OPTIONAL_FIELDS, **keyed})
    except (OtlpConfigError, CredentialError) as error:
        raise SourceUnavailable(f"gateway log {section.name}: {error}") from None


SOURCE = Source(name="otlp", default_port=4317, receiver=_receiver)
