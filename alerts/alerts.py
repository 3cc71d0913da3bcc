"""kvwatch's alerts, generated into alerts/kvwatch.rules.yml (prometheus/rules.py writes the file) with
the thresholds of prometheus/thresholds.py, from the signals and series of prometheus/queries.py. Each
alert's runbook_url opens its section of the runbook (alerts/runbook.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvwatch.core.naming import RUNBOOK_URL
from kvwatch.prometheus.queries import (
    CLUSTER_HIT_RATIO,
    CLUSTER_LOAD_IMBALANCE,
    CLUSTER_PROBE_SHARE,
    ENGINE_PRESENCE,
    GATEWAY_RETURNING_REQUESTS,
    INSTANCE_CACHE_SERIES,
    INSTANCE_HIT_RATIO,
    INSTANCE_PROMPT_TOKENS,
    INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
    INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS,
    INSTANCE_ROUTER_KV_EVENT_GAPS,
    INSTANCE_ROUTER_KV_EVENT_LAG,
    INSTANCE_ROUTER_PREDICTED_HIT_RATIO,
    INSTANCE_ROUTER_PREDICTIONS,
    INSTANCE_ROUTER_REUSE_LOSS,
    INSTANCE_ROUTER_REUSE_TOKENS,
    INSTANCE_ROUTER_SESSION_BIND_REJECTIONS,
    INSTANCE_ROUTER_SESSION_BINDINGS,
    INSTANCE_ROUTER_SESSION_INVALIDATIONS,
    SESSION_LIFECYCLE_REASONS,
    Grouping,
    first_of,
    gateway_moved,
    gateway_spread,
    instance_name,
    per_route,
    reused_sessions_ratio,
    route_warm_reuse,
    sticky_ratio,
    sticky_routes_judged,
    warm_cold_ratio,
    watched_listeners,
    watched_routes,
)
from kvwatch.prometheus.rules import rule_expr
from kvwatch.prometheus.thresholds import THRESHOLDS, Thresholds


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    for_: str = "0m"
    keep_firing_for: str | None = None
    labels: dict[str, str] | None = None
    cluster: str = ""  # the label naming the cluster of the alert's series; "" for none

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK_URL}#{self.name.lower()}"

    @property
    def notification_summary(self) -> str:
        """The summary as notifications carry it: naming the cluster when the alert's series has one, so
        that a Prometheus of one cluster without the label reads as the summary itself."""
        if not self.cluster:
            return self.summary
        where = f"{{{{ with $labels.{self.cluster} }}}} in {self.cluster} {{{{ . }}}}{{{{ end }}}}"
        return f"{self.summary.removesuffix('.')}{where}."

    def entry(self) -> dict:
        """The alert as its rule file holds it."""
        entry = {"alert": self.name, "expr": rule_expr(self.expr), "for": self.for_}
        if self.keep_firing_for:
            entry["keep_firing_for"] = self.keep_firing_for
        entry["labels"] = {"severity": self.severity, **(self.labels or {})}
        entry["annotations"] = {
            "summary": self.notification_summary,
            "description": self.description,
            "runbook_url": self.runbook_url,
        }
        return entry


def alerts(t: Thresholds, by: Grouping) -> tuple[Alert, ...]:
    """Every alert, judging by `t`, its series aggregated by `by`; without `keep_firing_for` where `t` is
    for a rule engine that does not know the field."""
    judged = (
        *_affinity_alerts(t, by),
        *_cache_alerts(t, by),
        *_probe_alerts(t, by),
        *_probe_share_alerts(t, by),
        *_load_alerts(t, by),
        *_reuse_alerts(t, by),
        *_router_state_alerts(t, by),
    )
    held = {} if t.keep_firing_for else {"keep_firing_for": None}
    return tuple(dataclasses.replace(alert, cluster=by.cluster, **held) for alert in judged)


def _cluster_prompt_tokens(by: Grouping) -> str:
    return f"sum by ({by.keeping()}) ({INSTANCE_PROMPT_TOKENS})"


def _affinity_alerts(t: Thresholds, by: Grouping) -> tuple[Alert, ...]:
    """Whether sessions stay on one replica, and carry the key that pins them."""
    window = t.keyless_share_window
    keyless_share = (
        f"sum by ({by.listener}) (rate(kvwatch_gateway_requests_without_session_key_total[{window}]))\n"
        f"  / (sum by ({by.listener}) (rate(kvwatch_gateway_requests_total[{window}])) > 0)"
    )
    keyless_share_an_hour_ago = keyless_share.replace(f"[{window}]", f"[{window}] offset 1h")
    return (
        Alert(
            "KVWatchSessionAffinityBroken",
            f"{sticky_ratio(by)} < {t.sticky_ratio_below}\nand {sticky_routes_judged(by)}",
            "critical",
            "Probe sessions through a sticky route change replica between rounds.",
            "Only {{ $value | humanizePercentage }} of the last probe run's sessions through "
            "{{ $labels.target }} stayed on one replica: the gateway no longer pins sessions, so rounds 2+ "
            "pay a full prefill.",
            keep_firing_for="2m",
        ),
        Alert(
            "KVWatchSessionReuseLost",
            f"{reused_sessions_ratio(by)} < {t.sticky_ratio_below}\nand {watched_routes(by)}",
            "critical",
            "Probe sessions through a session route stopped reusing their history.",
            "Only {{ $value | humanizePercentage }} of the last probe run's sessions through "
            "{{ $labels.target }} reused their history in every warm round"
            f"{route_warm_reuse(by)}: no round names its replica here, and the reuse says the sessions no "
            "longer reach the instance that holds them.",
            keep_firing_for="2m",
        ),
        Alert(
            "KVWatchSessionIdNotPropagated",
            f"{per_route('min', 'kvwatch_probe_session_id_echo_ratio', by)} < {t.echo_ratio_below}",
            "warning",
            "The gateway does not echo the session id.",
            "Only {{ $value | humanizePercentage }} of the last probe run's sessions through "
            "{{ $labels.target }} got their session id back: the id is dropped or replaced before the router "
            "sees it.",
            keep_firing_for="2m",
            labels={"source": "probe"},
        ),
        Alert(
            "KVWatchSessionIdNotPropagated",
            f"({keyless_share}) > {t.keyless_share_above}\n"
            f"unless ({keyless_share}) <= {t.keyless_rise_factor} * ({keyless_share_an_hour_ago})",
            "warning",
            "Requests reach the gateway without a session key.",
            "{{ $value | humanizePercentage }} of the requests on {{ $labels.log }} / {{ $labels.listener }} "
            "carried no session key, far more than an hour ago: clients stopped sending it.",
            for_="5m",
            labels={"source": "gateway_log"},
        ),
        Alert(
            "KVWatchGatewaySessionsSpread",
            f"{gateway_spread(by)} > {t.spread_share_above}\n"
            f"and on({by.listener}) sum by ({by.listener}) (kvwatch_gateway_returning_sessions)"
            f" >= {t.min_returning_sessions}\n"
            f"and {watched_listeners(by)}",
            "critical",
            "Real sessions through a sticky gateway listener are served by several replicas.",
            "{{ $value | humanizePercentage }} of the sessions that came back to {{ $labels.log }} / "
            "{{ $labels.listener }} within the spread window were served by more than one replica, with no "
            "failover to explain it: the gateway no longer pins sessions to the replica holding their cache.",
            for_=t.spread_for,
        ),
        Alert(
            "KVWatchGatewaySessionsMoved",
            f"{gateway_moved(by)} > {t.moved_share_above}\n"
            f"and on({by.listener}) sum by ({by.listener}) ({GATEWAY_RETURNING_REQUESTS}) * 60"
            f" >= {t.min_returning_requests_per_minute:g}\n"
            f"and {watched_listeners(by)}",
            "critical",
            "Real requests through a sticky gateway listener land on another replica than their session's "
            "previous one.",
            "{{ $value | humanizePercentage }} of the requests that came back to {{ $labels.log }} / "
            "{{ $labels.listener }} over the last minute were served by another replica than their "
            "session's previous request, with no failover or change of replicas to explain it: the "
            "gateway no longer pins sessions to the replica holding their cache.",
            for_=t.moved_for,
            keep_firing_for="2m",
        ),
    )


def _cache_alerts(t: Thresholds, by: Grouping) -> tuple[Alert, ...]:
    """Whether the engines' prefix caches serve what they should."""

    def baseline(ratio: str) -> str:
        """The ratio's own average over the hour before the last 10 minutes."""
        return f"avg_over_time({ratio}[1h] offset 10m)"

    instance, cluster, name = by.instance, by.keeping(), instance_name(by)
    # A minute of prompt tokens without a single lookup: prefix caching is off (a restart gives no lookups
    # to the window from the moment the samples before it are a minute old).
    prompt_rate = first_of("vllm:prompt_tokens_total", by=instance, window="1m")
    lookup_rate = first_of(
        "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total", by=instance, window="1m"
    )
    cluster_prompt_tokens = _cluster_prompt_tokens(by)
    return (
        Alert(
            "KVWatchPrefixCacheHitRateDrop",
            f"({CLUSTER_HIT_RATIO} < {t.hit_ratio_drop_factor} * {baseline(CLUSTER_HIT_RATIO)}\n"
            f"  or {CLUSTER_HIT_RATIO} < {t.hit_ratio_floor})\n"
            f"and on({cluster}) {cluster_prompt_tokens} > {t.min_prompt_tokens_per_second}",
            "warning",
            "The cluster's prefix-cache hit ratio dropped.",
            "The cluster serves only {{ $value | humanizePercentage }} of its prompt tokens from cached KV, "
            "well below its own average of the previous hour or under the floor.",
            for_=t.hit_ratio_drop_for,
            labels={"scope": "cluster"},
        ),
        Alert(
            "KVWatchPrefixCacheHitRateDrop",
            f"({INSTANCE_HIT_RATIO} < {t.hit_ratio_drop_factor} * {baseline(INSTANCE_HIT_RATIO)}\n"
            f"  or {INSTANCE_HIT_RATIO} < {t.hit_ratio_floor})\n"
            f"and on({instance}) {INSTANCE_PROMPT_TOKENS} > {t.min_prompt_tokens_per_second}",
            "warning",
            "An instance's prefix-cache hit ratio dropped.",
            f"{name} serves only {{{{ $value | humanizePercentage }}}} of its prompt tokens from "
            "cached KV, well below its own average of the previous hour or under the floor.",
            for_=t.hit_ratio_drop_for,
            labels={"scope": "instance"},
        ),
        Alert(
            "KVWatchWarmRoundNoGain",
            f"{warm_cold_ratio(by)} > {t.warm_cold_ratio_above}\nand {watched_routes(by)}",
            "warning",
            "Warm rounds are not faster than the first round on a sticky route.",
            "Through {{ $labels.target }}, rounds 2+ take {{ $value | humanizePercentage }} of round 1's "
            "time to first token: their history is not reused.",
            for_=t.warm_round_for,
        ),
        Alert(
            "KVWatchPrefixCachingDisabled",
            f"{prompt_rate} > 0\nand on({instance}) ({lookup_rate}) == 0",
            "warning",
            "An instance serves prompts without looking up its prefix cache.",
            f"{name} processes prompt tokens while its prefix-cache lookups stay flat: prefix "
            "caching is off there.",
            for_="30s",
            keep_firing_for="5m",  # sparse traffic must not make it flap
            labels={"evidence": "lookups"},
        ),
        Alert(
            "KVWatchPrefixCachingDisabled",
            f'max by ({instance}) (vllm:cache_config_info{{enable_prefix_caching="False"}}) == 1',
            "warning",
            "An instance runs with prefix caching disabled.",
            f"{name} reports enable_prefix_caching=False: start it with prefix caching on.",
            labels={"evidence": "config"},
        ),
        Alert(
            "KVWatchEngineCacheMetricsMissing",
            f"group by ({instance}) ({ENGINE_PRESENCE})\nunless on({instance}) {INSTANCE_CACHE_SERIES}",
            "warning",
            "An engine exports none of the prefix-cache series kvwatch reads.",
            f"{name} ({{{{ $labels.job }}}}) is a vLLM or SGLang engine but exports none of the "
            "prefix-cache series kvwatch reads: a renamed metric, or a pipeline that rewrote ':' to '_', "
            "would make the hit-ratio panels empty.",
            for_="10m",
        ),
    )


def _probe_alerts(t: Thresholds, by: Grouping) -> tuple[Alert, ...]:
    """Whether the probe runs, is let in, and reaches its targets."""

    def probe_errors(auth_match: str) -> str:
        selector = f'kind{auth_match}"unauthorized|forbidden"'
        return f"sum by ({by.route}, kind) (increase(kvwatch_probe_errors_total{{{selector}}}[3m]))"

    name = instance_name(by)
    return (
        Alert(
            "KVWatchProbeFailing",
            f"{probe_errors('!~')} > 0",
            "warning",
            "Probe rounds fail.",
            "Probe rounds through {{ $labels.target }} failed with {{ $labels.kind }} in the last 3 minutes.",
            for_="1m",
        ),
        Alert(
            "KVWatchProbeUnauthorized",
            f"{probe_errors('=~')} > 0",
            "critical",
            "The probe's API key is refused.",
            "{{ $labels.target }} answers {{ $labels.kind }} to the probe: the key is missing, wrong, "
            "expired or not allowed to use the model.",
        ),
        Alert(
            "KVWatchProbeStale",
            f"time() - {per_route('max', 'kvwatch_probe_last_run_timestamp_seconds', by)}\n"
            f"  > {t.probe_stale_intervals} * {per_route('max', 'kvwatch_probe_interval_seconds', by)}",
            "warning",
            "Probe results are stale.",
            "The last probe run through {{ $labels.target }} finished {{ $value | humanizeDuration }} ago: "
            "the scheduler is stuck or overloaded.",
        ),
        Alert(
            "KVWatchProbeNoResults",
            f"time() - {per_route('max', 'kvwatch_probe_watched_since_timestamp_seconds', by)}\n"
            f"  > {t.probe_stale_intervals} * {per_route('max', 'kvwatch_probe_interval_seconds', by)}\n"
            f"unless on({by.route}) kvwatch_probe_last_run_timestamp_seconds",
            "warning",
            "A configured probe target has no result.",
            "kvwatch serve has probed {{ $labels.target }} for {{ $value | humanizeDuration }} and not one "
            "run's result has reached Prometheus: every run hangs, or the scheduler never ran it.",
        ),
        Alert(
            "KVWatchGatewayLogSilent",
            f"time() - max by ({by.keeping('job, instance, log')}) "
            f"(kvwatch_gateway_log_last_record_timestamp_seconds)\n  > {t.source_silent_seconds:g}\n"
            f'and on({by.keeping("job, instance, log")}) kvwatch_gateway_log_info{{source!="file"}}',
            "warning",
            "A gateway log's receiver gets nothing.",
            "{{ $labels.log }} has received no access-log line for {{ $value | humanizeDuration }}: the "
            "gateway or its relay stopped sending, or cannot reach kvwatch's listen address.",
            for_="5m",
        ),
        Alert(
            "KVWatchTargetDown",
            "up == 0",
            "critical",
            "A scrape target is down.",
            f"{{{{ $labels.job }}}} / {name} has not answered Prometheus's scrapes.",
            for_="1m",
        ),
    )


def _probe_share_alerts(t: Thresholds, by: Grouping) -> tuple[Alert, ...]:
    """Whether the cluster's figures describe kvwatch's own probes rather than its users."""
    return (
        Alert(
            "KVWatchProbesDominate",
            f"{CLUSTER_PROBE_SHARE} > {t.probe_share_above}",
            "warning",
            "Most of the cluster's prompt tokens are kvwatch's own probes.",
            "kvwatch's probes are {{ $value | humanizePercentage }} of the prompt tokens the engines "
            "count: the cluster's hit ratio describes the probes, not the users. Read the real traffic's "
            "hit ratio, or probe less often or with shorter sessions.",
            for_=t.probe_share_for,
        ),
    )


def _load_alerts(t: Thresholds, by: Grouping) -> tuple[Alert, ...]:
    """Load balance, routers' predictions, kvwatch's own store, and the pipeline's heartbeat."""
    instance, cluster, cluster_prompt_tokens = by.instance, by.keeping(), _cluster_prompt_tokens(by)
    return (
        Alert(
            "KVWatchReplicaLoadImbalance",
            f"{CLUSTER_LOAD_IMBALANCE} > {t.load_imbalance_above}",
            "info",
            "Requests are spread unevenly over the replicas.",
            'The busiest replica serves {{ $value | printf "%.1f" }} times the mean: consistent hashing '
            "trades balance for cache reuse; check that it is not one hot session key.",
            for_=t.load_imbalance_for,
        ),
        Alert(
            "KVWatchRouterPredictionMiss",
            f"{INSTANCE_ROUTER_DELIVERED_PER_PREDICTED} < {t.delivered_per_predicted_below}\n"
            f"and on({instance}) {INSTANCE_ROUTER_PREDICTED_HIT_RATIO} > {t.router_predicted_above}\n"
            f"and on({instance}) {INSTANCE_ROUTER_PREDICTIONS} > {t.min_router_predictions_per_second}\n"
            f"and on({cluster}) {cluster_prompt_tokens} > {t.min_prompt_tokens_per_second}",
            "warning",
            "A router predicts prefix reuse that the engines do not deliver.",
            "{{ $labels.instance }} ({{ $labels.job }}) routes requests where its index predicts most of "
            "their prefix cached, but the engines serve only {{ $value | humanizePercentage }} of that "
            "prediction from cached KV: its index has drifted from the engines' caches, or caching is off.",
            for_=t.prediction_miss_for,
        ),
        Alert(
            "KVWatchStoreWritesDropped",
            f"sum by ({instance}, reason) (increase(kvwatch_store_writes_dropped_total[10m])) > 0",
            "warning",
            "Writes to the kvwatch store were dropped.",
            "{{ $labels.instance }} dropped store writes in the last 10 minutes ({{ $labels.reason }}): "
            "probe sessions or received alerts are missing from the history the dashboard shows.",
        ),
        Alert(
            "KVWatchStoreWritesRetried",
            f"sum by ({instance}) (increase(kvwatch_store_write_retries_total[2m])) > 0",
            "warning",
            "The kvwatch store keeps refusing writes.",
            "{{ $labels.instance }} has retried store writes for 5 minutes: the store is locked by another "
            "process, or its disk is full or failing; a write is dropped once its retries run out.",
            for_="5m",
        ),
        Alert(
            "Watchdog",
            "vector(1)",
            "none",
            "The kvwatch alerting pipeline is alive.",
            "Always firing: if it stops arriving, Prometheus, Alertmanager or the route to you is broken.",
        ),
    )


def _reuse_alerts(t: Thresholds, by: Grouping) -> tuple[Alert, ...]:
    """Where a router's reuse is lost: to its choice of replica, or between its prediction and the engine.
    A workload with nothing to reuse is no fault of the cluster's: its loss is shown, not alerted on."""
    instance = by.instance

    def lost(loss: str, above: float) -> str:
        return (
            f'{INSTANCE_ROUTER_REUSE_LOSS}{{loss="{loss}"}} > {above}\n'
            f'and on({instance}) {INSTANCE_ROUTER_REUSE_TOKENS}{{leg="prompt"}}'
            f" > {t.min_router_prompt_tokens_per_second:g}"
        )

    return (
        Alert(
            "KVWatchReuseLostToRouting",
            lost("routing", t.routing_loss_above),
            "warning",
            "A router sends requests away from the replica that holds their prefix.",
            "{{ $labels.instance }} ({{ $labels.job }}) chose replicas holding "
            "{{ $value | humanizePercentage }} of the prompt tokens less than the best replica held at "
            "decision time: sessions are spread, or load outweighs cache in its scoring.",
            for_=t.reuse_loss_for,
            labels={"loss": "routing"},
        ),
        Alert(
            "KVWatchReuseLostInEngine",
            lost("engine", t.engine_loss_above),
            "warning",
            "Engines do not reuse the prefixes their router predicted cached.",
            "{{ $labels.instance }} ({{ $labels.job }}) predicted cached {{ $value | humanizePercentage }} "
            "of the prompt tokens more than the engines reused: prefix caching is off, the cache evicts "
            "too early, or the router's index has drifted from the engines' caches.",
            for_=t.reuse_loss_for,
            labels={"loss": "engine"},
        ),
    )


def _router_state_alerts(t: Thresholds, by: Grouping) -> tuple[Alert, ...]:
    """Routers' session tables (full, or losing sessions early) and their KV-event index (stalled)."""
    instance = by.instance
    early = f'{INSTANCE_ROUTER_SESSION_INVALIDATIONS}{{reason!~"{SESSION_LIFECYCLE_REASONS}"}}'
    early_per_minute = f"60 * sum by ({instance}) ({early})"
    return (
        Alert(
            "KVWatchRouterSessionTableFull",
            f"{INSTANCE_ROUTER_SESSION_BIND_REJECTIONS} > 0",
            "warning",
            "A router's session table refuses new sessions.",
            "{{ $labels.instance }} ({{ $labels.job }}) refuses {{ $value | humanize }} new sessions per "
            "second: its session table is full, so new conversations go unpinned (llm-d) or get 503 "
            "(Dynamo, 65,536 sessions). Shorten the session TTL, close sessions that end, or add routers.",
            for_=t.session_table_full_for,
        ),
        Alert(
            "KVWatchRouterSessionInvalidationSurge",
            f"{early_per_minute}\n  / on({instance}) ({INSTANCE_ROUTER_SESSION_BINDINGS} > 0)\n"
            f"  > {t.session_invalidated_share_above}\n"
            f"and on({instance}) {early_per_minute} > {t.min_session_invalidations_per_minute}",
            "warning",
            "A router drops session bindings before they end.",
            "{{ $labels.instance }} ({{ $labels.job }}) drops {{ $value | humanizePercentage }} of its bound "
            "sessions per minute for pod deletions or errors, not idleness or a close: those sessions "
            "start again cold on another replica. Look for restarting or failing pods.",
            for_=t.session_invalidations_for,
        ),
        Alert(
            "KVWatchRouterIndexStalled",
            f"{INSTANCE_ROUTER_KV_EVENT_LAG} > {t.kv_event_lag_above:g}\n"
            f"or {INSTANCE_ROUTER_KV_EVENT_GAPS} > 0\n"
            f"or {INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS} > 0",
            "warning",
            "A router's KV-cache index trails the engines' events.",
            "{{ $labels.instance }} ({{ $labels.job }}) has a KV-event index that lags the engines' events "
            f"by over {t.kv_event_lag_above:g} s, misses events (gaps) or has degraded ranks: it predicts "
            "reuse from blocks the engines no longer hold. Check the event subscriptions and resyncs.",
            for_=t.index_stalled_for,
        ),
    )


ALERTS = alerts(THRESHOLDS, Grouping())
