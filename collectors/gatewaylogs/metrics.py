"""A gateway log's latest snapshot as `kvwatch_gateway_*` metrics, fresh on every scrape, whatever its
source (collectors/gatewaylogs/sources/)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvwatch.collectors.gatewaylogs.tally import GatewayLogSnapshot


class FollowedLog(Protocol):
    """A gateway log as the collector reads it: its name and its latest snapshot."""

    name: str
    latest: GatewayLogSnapshot


# name, family, snapshot attribute, labels after `log`, HELP
_FAMILIES = (
    ("kvwatch_gateway_requests", CounterMetricFamily, "requests", ("listener", "upstream"),
     "Requests in the gateway access log, by the upstream that served them (the last one tried)."),
    ("kvwatch_gateway_other_requests", CounterMetricFamily, "other_requests", ("listener",),
     "Requests to other than the inference paths (GET /v1/models, health checks): counted apart, never "
     "as requests without a session key."),
    ("kvwatch_gateway_responses", CounterMetricFamily, "responses", ("listener", "status_class"),
     "Requests in the gateway access log, by HTTP status class."),
    ("kvwatch_gateway_requests_without_session_key", CounterMetricFamily, "without_session_key",
     ("listener",), "Requests that arrived without a client session key, so the gateway assigned one."),
    ("kvwatch_gateway_assigned_session_ids", CounterMetricFamily, "assigned_session_ids", ("listener",),
     "Distinct session ids the gateway assigned to requests without a session key."),
    ("kvwatch_gateway_failovers", CounterMetricFamily, "failovers", ("listener",),
     "Requests the gateway sent to more than one upstream, or whose upstream failed (Envoy: UF, URX)."),
    ("kvwatch_gateway_session_spread_sessions", GaugeMetricFamily, "spread_sessions",
     ("listener", "failover"), "Sessions served by more than one upstream within the spread window, as of "
     "the last log poll; failover=\"true\": moved because an upstream failed."),
    ("kvwatch_gateway_returning_sessions", GaugeMetricFamily, "returning_sessions", ("listener",),
     "Sessions with two or more requests within the spread window (the ones that could spread), as of the "
     "last log poll."),
    ("kvwatch_gateway_returning_requests", CounterMetricFamily, "returning_requests", ("listener",),
     "Requests on an upstream whose session's previous request came within the session TTL."),
    ("kvwatch_gateway_moved_requests", CounterMetricFamily, "moved_requests", ("listener", "failover"),
     "Returning requests served by another upstream than their session's previous request; "
     "failover=\"true\": a failover or a replica joining or leaving the listener explains the move."),
    ("kvwatch_gateway_active_sessions", GaugeMetricFamily, "active_sessions", ("listener",),
     "Sessions seen within the session TTL, as of the last log poll."),
    ("kvwatch_gateway_malformed_lines", CounterMetricFamily, "malformed", ("reason",),
     "Access log lines that were skipped because they could not be read as a request."),
    ("kvwatch_gateway_lines", CounterMetricFamily, "lines", (),
     "Access log lines read, malformed ones included."),
    ("kvwatch_gateway_label_values_folded", CounterMetricFamily, "folded_labels", ("label", "reason"),
     'Requests whose listener or upstream was shown as "other": beyond 32 values per log, or too long.'),
    ("kvwatch_gateway_evicted_sessions", CounterMetricFamily, "evicted_sessions", (),
     "Sessions forgotten early to keep memory bounded; when rising, raise max_sessions."),
    ("kvwatch_gateway_future_timestamps", CounterMetricFamily, "future_times", (),
     "Requests logged more than 60 s ahead of kvwatch's clock, counted as of the poll that read them."),
    ("kvwatch_gateway_log_readable", GaugeMetricFamily, "readable", (),
     "Whether the last poll could read the access log (0: missing or unreadable)."),
    ("kvwatch_gateway_log_unreadable_polls", CounterMetricFamily, "unreadable_polls", ("reason",),
     "Polls that could not read the access log, by reason."),
    ("kvwatch_gateway_log_unread_bytes", GaugeMetricFamily, "unread_bytes", (),
     "Bytes of the access log left for later polls by the bound on bytes read per poll, as of the last "
     "poll; when rising, kvwatch falls behind the log."),
    ("kvwatch_gateway_log_unread_files", CounterMetricFamily, "unread_files", ("reason",),
     "Files of the access log that were never read, by reason: rotated_unopened, rotated away before a "
     "poll opened them (the log rotates more than once per poll). Linux only."),
    ("kvwatch_gateway_log_last_poll_timestamp_seconds", GaugeMetricFamily, "taken_at", (),
     "Unix time of the last poll of the access log by the scheduler."),
    ("kvwatch_gateway_log_refused", CounterMetricFamily, "refused", ("reason",),
     "What a push source (syslog, OTLP) received and could not take, by reason: truncated, malformed, "
     "oversize, kernel_drops (the UDP receive queue was full), over_rate, unauthenticated."),
    ("kvwatch_gateway_log_last_record_timestamp_seconds", GaugeMetricFamily, "last_record_at", (),
     "Unix time the log's source last delivered a line or record (0: never)."),
    ("kvwatch_gateway_first_byte_median_seconds", GaugeMetricFamily, "first_byte_median_seconds",
     ("listener", "round"), "Median upstream time to first byte of the latest 256 successful requests "
     "with a client session key, by their round in the session (8+: the 8th and later): TTFT by round "
     "where the first byte is the first token (docs/gateway-logs.md)."),
    ("kvwatch_gateway_log_info", GaugeMetricFamily, "info", ("expect_sticky", "source"),
     "The log's settings: whether its listeners are meant to keep each session on one upstream, and its "
     "source (file, syslog, otlp)."),
)  # fmt: skip
FIRST_BYTE = "kvwatch_gateway_first_byte_seconds"
LABEL_NAMES = frozenset({"log", *(label for _, _, _, labels, _ in _FAMILIES for label in labels)})


def _samples(value: Mapping | float) -> Iterator[tuple[tuple[str, ...], float]]:
    """(label values after `log`, value) pairs of a number, or of a mapping keyed by label values."""
    if not isinstance(value, Mapping):
        yield (), float(value)
        return
    for key, count in value.items():
        yield (key if isinstance(key, tuple) else (key,)), count


def _metric_families(snapshots: list[GatewayLogSnapshot]) -> Iterator[Metric]:
    for name, family_type, attribute, labels, documentation in _FAMILIES:
        family = family_type(name, documentation, labels=["log", *labels])
        for snapshot in snapshots:
            for label_values, value in _samples(getattr(snapshot, attribute)):
                family.add_metric([snapshot.log, *label_values], value)
        yield family
    yield _first_byte_histograms(snapshots)


def _first_byte_histograms(snapshots: list[GatewayLogSnapshot]) -> Metric:
    histogram = HistogramMetricFamily(
        FIRST_BYTE,
        "Upstream time to first byte of successful requests with a client session key, by their round "
        "in the session (8+: the 8th and later): nginx's $upstream_header_time, Envoy's first body byte.",
        labels=["log", "listener", "round"],
    )
    for snapshot in snapshots:
        for (listener, round_), (buckets, total) in snapshot.first_byte_seconds.items():
            histogram.add_metric([snapshot.log, listener, round_], list(buckets), total)
    return histogram


class GatewayLogCollector(Collector):
    """The logs' latest snapshots as metrics: `REGISTRY.register(GatewayLogCollector(followers))`."""

    def __init__(self, followers: Iterable[FollowedLog]):
        self._followers = tuple(followers)
        names = [follower.name for follower in self._followers]
        if len(set(names)) != len(names):
            raise ValueError(f"gateway log names must be unique, got {names}")

    def collect(self) -> Iterator[Metric]:
        # Fresh families from the latest snapshots: a scrape never sees a half-updated follower.
        yield from _metric_families([follower.latest for follower in self._followers])
