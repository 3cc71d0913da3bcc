"""The `otlp` source: OpenTelemetry access-log records (Envoy's `envoy.access_loggers.open_telemetry`,
Istio, Envoy Gateway) over OTLP. Its receiver is not part of this build yet."""

from __future__ import annotations

from kvwatch.collectors.gatewaylogs.sources.base import Source, SourceUnavailable
from kvwatch.collectors.gatewaylogs.tally import SessionTally


def _receiver(section: object, tally: SessionTally):
    raise SourceUnavailable(f"gateway log {tally.name}: the OTLP receiver is not part of this kvwatch yet")


SOURCE = Source(name="otlp", default_port=4317, receiver=_receiver)
