"""Every PromQL expression kvwatch uses, in one place.

The recording rules in prometheus/rules/ are generated from `RECORDING_RULES` (`make generate`; a test
fails when the committed files are stale), and the dashboards and alert rules read the recorded series
by the names defined here.

Conventions: ratios are ratios of summed rates, never averages of ratios; a denominator guarded by
`> 0` makes zero traffic give no sample rather than 0 or NaN. Rules are `level:metric:operations`.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW = "2m"
INSTANCE = "job, instance"
QUANTILES = ("0.5", "0.9", "0.99")


@dataclass(frozen=True)
class Rule:
    record: str
    expr: str
    labels: dict[str, str] | None = None


def _first_of(*selectors: str, by: str = INSTANCE, window: str = WINDOW) -> str:
    """Sum by `by` of the rate of the first series that exists: one name per engine or engine version."""
    return "\n  or ".join(f"sum by ({by}) (rate({selector}[{window}]))" for selector in selectors)


# Prefix-cache lookups and hits in tokens, per engine flavour and version.
QUERIED_TOKENS = (
    "vllm:prefix_cache_queries_total",  # vLLM V1 >= 0.9
    "vllm:gpu_prefix_cache_queries_total",  # vLLM V1 0.8 - 0.11, deprecated
    "sglang:prompt_tokens_total",  # SGLang >= 0.4.6
)
HIT_TOKENS = (
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total",
    "sglang:cached_tokens_total",
)
# vLLM V0 only reports a hit-rate gauge computed by the engine; -1 means no data.
V0_HIT_RATE = "vllm:gpu_prefix_cache_hit_rate"
TTFT_BUCKETS = ("vllm:time_to_first_token_seconds_bucket", "sglang:time_to_first_token_seconds_bucket")
FINISHED_REQUESTS = ("vllm:request_success_total", "sglang:num_requests_total")
# Any of these on an instance means its engine exports cache metrics kvwatch can read.
ENGINE_CACHE_SERIES = (*QUERIED_TOKENS, *HIT_TOKENS, V0_HIT_RATE, "sglang:cache_hit_rate")

INSTANCE_QUERIED = f"instance:kvwatch_prefix_cache_queried_tokens:rate{WINDOW}"
INSTANCE_HITS = f"instance:kvwatch_prefix_cache_hit_tokens:rate{WINDOW}"
INSTANCE_HIT_RATIO = f"instance:kvwatch_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate{WINDOW}"
CLUSTER_HIT_RATIO = f"cluster:kvwatch_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate{WINDOW}"
INSTANCE_TTFT = "instance_quantile:kvwatch_ttft_seconds:histogram_quantile"
ENGINE_TTFT = "engine_quantile:kvwatch_ttft_seconds:histogram_quantile"
INSTANCE_REQUESTS = f"instance:kvwatch_requests:rate{WINDOW}"
INSTANCE_REQUEST_SHARE = f"instance:kvwatch_requests_per_cluster_requests:ratio_rate{WINDOW}"
CLUSTER_LOAD_IMBALANCE = f"cluster:kvwatch_requests_max_per_mean:ratio_rate{WINDOW}"
INSTANCE_CACHE_SERIES = "instance:kvwatch_engine_cache_series:present"


def _ttft_buckets(by: str) -> str:
    parts = [f"sum by ({by}, le) (rate({name}[{WINDOW}]))" for name in TTFT_BUCKETS]
    return "\n  or ".join(parts)


def _engine_ttft_buckets() -> str:
    """TTFT bucket rates summed per engine family: vLLM and SGLang buckets differ, so never mix them."""
    parts = [
        f'label_replace(sum by (le) (rate({name}[{WINDOW}])), "engine", "{name.split(":")[0]}", "", "")'
        for name in TTFT_BUCKETS
    ]
    return "\n  or ".join(parts)


RECORDING_RULES: tuple[Rule, ...] = (
    Rule(INSTANCE_QUERIED, _first_of(*QUERIED_TOKENS)),
    # SGLang creates its cached-tokens counter on the first hit: until then an instance has 0 hits.
    Rule(INSTANCE_HITS, _first_of(*HIT_TOKENS) + f"\n  or 0 * {INSTANCE_QUERIED}"),
    Rule(
        INSTANCE_HIT_RATIO,
        f"{INSTANCE_HITS} / ({INSTANCE_QUERIED} > 0)\n  or max by ({INSTANCE}) ({V0_HIT_RATE} >= 0)",
    ),
    Rule(CLUSTER_HIT_RATIO, f"sum({INSTANCE_HITS}) / (sum({INSTANCE_QUERIED}) > 0)"),
    *(
        Rule(INSTANCE_TTFT, f"histogram_quantile({q}, {_ttft_buckets(INSTANCE)})", {"quantile": q})
        for q in QUANTILES
    ),
    *(
        Rule(ENGINE_TTFT, f"histogram_quantile({q}, {_engine_ttft_buckets()})", {"quantile": q})
        for q in QUANTILES
    ),
    Rule(INSTANCE_REQUESTS, _first_of(*FINISHED_REQUESTS)),
    Rule(
        INSTANCE_REQUEST_SHARE,
        f"{INSTANCE_REQUESTS}\n  / on() group_left() (sum({INSTANCE_REQUESTS}) > 0)",
    ),
    Rule(CLUSTER_LOAD_IMBALANCE, f"max({INSTANCE_REQUESTS}) / (avg({INSTANCE_REQUESTS}) > 0)"),
    Rule(
        INSTANCE_CACHE_SERIES,
        f"group by ({INSTANCE}, series) ("
        + 'label_replace({__name__=~"'
        + "|".join(ENGINE_CACHE_SERIES)
        + '"}, "series", "$1", "__name__", "(.+)"))',
    ),
)


# --- Alerts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thresholds:
    """Every alert threshold, in one place. Durations are for production scrape / evaluation intervals
    of 15 s and a probe interval of 30 s; the lab's --fast mode runs the same rules scaled by 1/10."""

    sticky_ratio_below: float = 0.5  # share of a probe run's sessions that stayed on one replica
    echo_ratio_below: float = 0.5  # share of a probe run's sessions whose id the gateway echoed
    keyless_share_above: float = 0.5  # share of gateway requests that arrived without a session key
    keyless_rise_factor: float = 2.0  # ... and at least this many times the share an hour earlier
    warm_cold_ratio_above: float = 0.8  # warm-round TTFT over round-1 TTFT on an affinity route
    hit_ratio_floor: float = 0.1
    hit_ratio_drop_factor: float = 0.5  # below half of its own average over the previous hour
    min_queried_tokens_per_second: float = 50.0  # traffic guard of the hit-ratio alerts
    probe_stale_intervals: float = 3.0
    load_imbalance_above: float = 2.0  # busiest instance over the mean
    # The scrape jobs of the engines; set it to yours. The lab's is "replicas".
    engine_selector: str = 'job=~"replicas|vllm.*|sglang.*|.*engine.*"'


THRESHOLDS = Thresholds()
RUNBOOK = "alerts/runbook.md"
AFFINITY = 'route_mode="affinity"'


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

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK}#{self.name.lower()}"


def _alerts(t: Thresholds) -> tuple[Alert, ...]:
    def baseline(ratio: str) -> str:
        """The ratio's own average over the hour before the last 10 minutes."""
        return f"avg_over_time({ratio}[1h] offset 10m)"

    def probe_errors(auth_match: str) -> str:
        selector = f'kind{auth_match}"unauthorized|forbidden"'
        return f"sum by (target, route_mode, kind) (increase(kvwatch_probe_errors_total{{{selector}}}[3m]))"

    keyless_share = (
        "sum by (log, listener) (rate(kvwatch_gateway_requests_without_session_key_total[5m]))\n"
        "  / (sum by (log, listener) (rate(kvwatch_gateway_requests_total[5m])) > 0)"
    )
    keyless_share_an_hour_ago = keyless_share.replace("[5m]", "[5m] offset 1h")
    instance_prompt_rate = "sum by (job, instance) (rate(vllm:prompt_tokens_total[5m]))"
    return (
        Alert(
            "KVWatchSessionAffinityBroken",
            f"kvwatch_probe_sticky_ratio{{{AFFINITY}}} < {t.sticky_ratio_below}",
            "critical",
            "Probe sessions through an affinity route change replica between rounds.",
            "Only {{ $value | humanizePercentage }} of the last probe run's sessions through "
            "{{ $labels.target }} stayed on one replica: the gateway no longer pins sessions, so rounds 2+ "
            "pay a full prefill.",
            keep_firing_for="2m",
        ),
        Alert(
            "KVWatchSessionIdNotPropagated",
            f"kvwatch_probe_session_id_echo_ratio < {t.echo_ratio_below}",
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
            "KVWatchPrefixCacheHitRateDrop",
            f"({CLUSTER_HIT_RATIO} < {t.hit_ratio_drop_factor} * {baseline(CLUSTER_HIT_RATIO)}\n"
            f"  or {CLUSTER_HIT_RATIO} < {t.hit_ratio_floor})\n"
            f"and on() sum({INSTANCE_QUERIED}) > {t.min_queried_tokens_per_second}",
            "warning",
            "The cluster's prefix-cache hit ratio dropped.",
            "The cluster's token-weighted prefix-cache hit ratio is {{ $value | humanizePercentage }}, well "
            "below its own average of the previous hour or under the floor.",
            for_="5m",
            labels={"scope": "cluster"},
        ),
        Alert(
            "KVWatchPrefixCacheHitRateDrop",
            f"({INSTANCE_HIT_RATIO} < {t.hit_ratio_drop_factor} * {baseline(INSTANCE_HIT_RATIO)}\n"
            f"  or {INSTANCE_HIT_RATIO} < {t.hit_ratio_floor})\n"
            f"and on(job, instance) {INSTANCE_QUERIED} > {t.min_queried_tokens_per_second}",
            "warning",
            "An instance's prefix-cache hit ratio dropped.",
            "The prefix-cache hit ratio of {{ $labels.instance }} is {{ $value | humanizePercentage }}, well "
            "below its own average of the previous hour or under the floor.",
            for_="5m",
            labels={"scope": "instance"},
        ),
        Alert(
            "KVWatchWarmRoundNoGain",
            f"kvwatch_probe_warm_cold_ttft_ratio{{{AFFINITY}}} > {t.warm_cold_ratio_above}",
            "warning",
            "Warm rounds are not faster than the first round on an affinity route.",
            "Through {{ $labels.target }}, rounds 2+ take {{ $value | humanizePercentage }} of round 1's "
            "time to first token: their history is not reused.",
            for_="2m",
        ),
        Alert(
            "KVWatchPrefixCachingDisabled",
            f"{instance_prompt_rate} > 0\n"
            "unless on(job, instance) sum by (job, instance) (rate(vllm:prefix_cache_queries_total[5m])) > 0",
            "warning",
            "An instance serves prompts without looking up its prefix cache.",
            "{{ $labels.instance }} processes prompt tokens while its prefix-cache lookups stay flat: prefix "
            "caching is off there.",
            for_="5m",
            labels={"evidence": "lookups"},
        ),
        Alert(
            "KVWatchPrefixCachingDisabled",
            'max by (job, instance) (vllm:cache_config_info{enable_prefix_caching="False"}) == 1',
            "warning",
            "An instance runs with prefix caching disabled.",
            "{{ $labels.instance }} reports enable_prefix_caching=False: start it with prefix caching on.",
            labels={"evidence": "config"},
        ),
        Alert(
            "KVWatchEngineCacheMetricsMissing",
            f"up{{{t.engine_selector}}} == 1\nunless on(job, instance) {INSTANCE_CACHE_SERIES}",
            "warning",
            "An engine exports none of the prefix-cache series kvwatch reads.",
            "{{ $labels.instance }} ({{ $labels.job }}) is up but exports no vLLM or SGLang prefix-cache "
            "series: a renamed metric or a missing --enable-metrics would make the hit-ratio panels empty.",
            for_="10m",
        ),
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
            f"time() - kvwatch_probe_last_run_timestamp_seconds\n"
            f"  > {t.probe_stale_intervals} * kvwatch_probe_interval_seconds",
            "warning",
            "Probe results are stale.",
            "The last probe run through {{ $labels.target }} finished {{ $value | humanizeDuration }} ago: "
            "the scheduler is stuck or overloaded.",
        ),
        Alert(
            "KVWatchTargetDown",
            "up == 0",
            "critical",
            "A scrape target is down.",
            "{{ $labels.job }} / {{ $labels.instance }} has not answered Prometheus's scrapes.",
            for_="1m",
        ),
        Alert(
            "KVWatchReplicaLoadImbalance",
            f"{CLUSTER_LOAD_IMBALANCE} > {t.load_imbalance_above}",
            "info",
            "Requests are spread unevenly over the replicas.",
            'The busiest replica serves {{ $value | printf "%.1f" }} times the mean: consistent hashing '
            "trades balance for cache reuse; check that it is not one hot session key.",
            for_="15m",
        ),
        Alert(
            "Watchdog",
            "vector(1)",
            "none",
            "The kvwatch alerting pipeline is alive.",
            "Always firing: if it stops arriving, Prometheus, Alertmanager or the route to you is broken.",
        ),
    )


ALERTS = _alerts(THRESHOLDS)

RULE_FILES = {
    "prometheus/rules/kvwatch-engines.yml": ("kvwatch-engines", RECORDING_RULES),
    "alerts/kvwatch.rules.yml": ("kvwatch-alerts", ALERTS),
}


# --- Dashboard queries ----------------------------------------------------------------------------
# One expression per panel, shared by the Grafana boards (collectors/grafana.py) and the Streamlit app.
# They use Grafana's variables: `$job`, `$instance` and `$target` are label regexes, `$__rate_interval`
# is the rate window and `$__range` the whole time range; outside Grafana, `fill_variables()` sets them.
# Panels on recording rules keep the rules' fixed WINDOW; probe panels rate kvwatch_probe_* counters.

RATE_WINDOW = "$__rate_interval"
ENGINE_SELECTOR = 'job=~"$job", instance=~"$instance"'
PROBE_SELECTOR = 'target=~"$target"'
LABEL_VARIABLES = ("job", "instance", "target")
ROUTE = "target, route_mode"


def fill_variables(expr: str, *, window: str, time_range: str, **labels: str) -> str:
    """A dashboard query with Grafana's variables set, to run it elsewhere (Streamlit, tests);
    label variables that are not given match everything."""
    values = {"__rate_interval": window, "__range": time_range, **dict.fromkeys(LABEL_VARIABLES, ".*")}
    for name, value in (values | labels).items():
        expr = expr.replace(f"${name}", value)
    return expr


def _sum_rate(metric: str, selector: str, by: str, window: str = RATE_WINDOW) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{window}]))"


def _ratio(numerator: str, denominator: str) -> str:
    return f"{numerator}\n  / ({denominator} > 0)"


def _probe_ttft_median(by: str, *matchers: str, window: str = RATE_WINDOW) -> str:
    selector = ", ".join((PROBE_SELECTOR, *matchers))
    buckets = _sum_rate("kvwatch_probe_ttft_seconds_bucket", selector, f"le, {by}", window)
    return f"histogram_quantile(0.5, {buckets})"


HIT_RATIO_BY_INSTANCE = f"{INSTANCE_HIT_RATIO}{{{ENGINE_SELECTOR}}}"
TTFT_QUANTILES_BY_INSTANCE = f"{INSTANCE_TTFT}{{{ENGINE_SELECTOR}}}"
REQUEST_SHARE_BY_INSTANCE = f"{INSTANCE_REQUEST_SHARE}{{{ENGINE_SELECTOR}}}"
# Engine TTFT bucket rates for a heatmap, one query per engine family: their buckets differ.
ENGINE_TTFT_BUCKET_RATES = {
    name.split(":")[0]: f"sum by (le) (rate({name}{{{ENGINE_SELECTOR}}}[{RATE_WINDOW}]))"
    for name in TTFT_BUCKETS
}

# Median probe TTFT per round and route over the whole time range: the source article's chart.
PROBE_TTFT_BY_ROUND = _probe_ttft_median("route_mode, round", window="$__range")
PROBE_TTFT_BY_ROUND_OVER_TIME = _probe_ttft_median("round")
# Warm rounds' median TTFT over round 1's: affinity keeps it low, round robin makes it grow.
# The exporter's exact per-run ratio: medians from histogram buckets would land anywhere in one bucket.
WARM_COLD_TTFT_RATIO = f"max by ({ROUTE}) (kvwatch_probe_warm_cold_ttft_ratio{{{PROBE_SELECTOR}}})"
PROBE_STICKY_SHARE = _ratio(
    _sum_rate("kvwatch_probe_stickiness_sessions_total", f'{PROBE_SELECTOR}, sticky="true"', ROUTE),
    _sum_rate("kvwatch_probe_stickiness_sessions_total", f'{PROBE_SELECTOR}, sticky!="unknown"', ROUTE),
)
PROBE_BACKEND_SWITCHES_PER_SESSION = _ratio(
    _sum_rate("kvwatch_probe_backend_switches_total", PROBE_SELECTOR, ROUTE),
    _sum_rate("kvwatch_probe_sessions_total", PROBE_SELECTOR, ROUTE),
)
# Delivered over ideal cached tokens. Round 1 has nothing to reuse (its ideal is 0) but can still hit
# the shared system prompt, so it stays out.
AFFINITY_EFFICIENCY = _ratio(
    _sum_rate("kvwatch_probe_cached_tokens_total", f'{PROBE_SELECTOR}, round!="1"', ROUTE),
    _sum_rate("kvwatch_probe_ideal_cached_tokens_total", f'{PROBE_SELECTOR}, round!="1"', ROUTE),
)
SESSION_ID_NOT_ECHOED_SHARE = _ratio(
    _sum_rate("kvwatch_probe_session_id_echo_sessions_total", f'{PROBE_SELECTOR}, echoed="false"', ROUTE),
    _sum_rate("kvwatch_probe_session_id_echo_sessions_total", PROBE_SELECTOR, ROUTE),
)
REQUESTS_WITHOUT_SESSION_KEY_SHARE = _ratio(
    _sum_rate("kvwatch_gateway_requests_without_session_key_total", "", "log, listener"),
    _sum_rate("kvwatch_gateway_requests_total", "", "log, listener"),
)
PROBE_ERRORS_BY_KIND = _sum_rate("kvwatch_probe_errors_total", PROBE_SELECTOR, "kind")
PROBE_ROUNDS_BY_BACKEND = _sum_rate("kvwatch_probe_backend_rounds_total", PROBE_SELECTOR, "backend")
PROBE_LAST_RUN_AGE = (
    f"time() - max by ({ROUTE}) (kvwatch_probe_last_run_timestamp_seconds{{{PROBE_SELECTOR}}})"
)
FIRING_ALERTS_BY_NAME = 'count by (alertname, severity) (ALERTS{alertstate="firing", alertname=~"KVWatch.+"})'


# --- Streamlit queries ----------------------------------------------------------------------------
# What the Streamlit app (dashboard/app_pages/) shows besides the dashboard queries above.

FIRING_ALERTS = f"sum({FIRING_ALERTS_BY_NAME}) or vector(0)"
PREFIX_CACHING_CONFIG = "max by (job, instance, enable_prefix_caching) (vllm:cache_config_info)"
