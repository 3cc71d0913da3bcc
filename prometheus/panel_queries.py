"""The panel queries: one PromQL expression per panel of the Grafana boards (grafana/boards.py) and the
Streamlit app (dashboard/app_pages/), built on the recorded series of prometheus/queries.py.

They use Grafana's variables: `$job`, `$instance` and `$target` are label regexes, `$__rate_interval` is
the rate window and `$__range` the whole time range; outside Grafana, `fill_variables()` sets them.
Panels on recording rules keep the rules' fixed WINDOW; probe panels rate kvwatch_probe_* counters.
"""

from __future__ import annotations

from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.prometheus import promql
from kvwatch.prometheus.queries import (
    GATEWAY_SPREAD_SHARE,
    INSTANCE,
    INSTANCE_CACHED_BY_SOURCE,
    INSTANCE_HIT_RATIO,
    INSTANCE_LMCACHE_HITS_BY_TIER,
    INSTANCE_PROMPT_TOKENS,
    INSTANCE_REQUEST_SHARE,
    INSTANCE_TTFT,
    LMCACHE,
    LOCAL,
    ROUTE,
    ROUTE_PROBE_SHARE,
    TTFT_BUCKETS,
    per_route,
)

RATE_WINDOW = "$__rate_interval"
ENGINE_SELECTOR = 'job=~"$job", instance=~"$instance"'
PROBE_SELECTOR = 'target=~"$target"'
LABEL_VARIABLES = ("job", "instance", "target")
# What a label variable set to All matches: any value, but the label must be there.
ALL_VALUES = ".+"
# The boards' Cluster variable lists the values of the cluster label on every scraped target's `up`, and
# every query of a board matches it. Its All matches any value or none, so that a Prometheus without the
# label shows everything as before.
CLUSTER_VARIABLE = "cluster"
CLUSTERS_SERIES = "up"
ALL_CLUSTERS = ".*"


def cluster_matcher(label: str = CLUSTER_LABEL) -> str:
    """The matcher that narrows a board's queries to the clusters picked in its Cluster variable."""
    return f'{label}=~"${CLUSTER_VARIABLE}"'


def one_cluster(label: str, cluster: str) -> str:
    """The matcher that narrows the Streamlit pages' queries to the cluster picked in the sidebar."""
    return f"{label}={promql.string(cluster)}"


def clusters(label: str) -> str:
    """One series per cluster, labelled by it alone."""
    return f"group by ({label}) ({CLUSTERS_SERIES})"


def fill_variables(expr: str, *, window: str, time_range: str, **labels: str) -> str:
    """A dashboard query with Grafana's variables set, to run it elsewhere (Streamlit, tests);
    label variables that are not given are All."""
    values = {
        "__rate_interval": window,
        "__range": time_range,
        CLUSTER_VARIABLE: ALL_CLUSTERS,
        **dict.fromkeys(LABEL_VARIABLES, ALL_VALUES),
    }
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
LOCAL_HIT_RATIO_BY_INSTANCE = f"{LOCAL.instance_ratio}{{{ENGINE_SELECTOR}}}"
# Each source's share of an instance's prompt tokens (device, host, disk, p2p, external).
CACHED_SHARE_BY_SOURCE = (
    f"{INSTANCE_CACHED_BY_SOURCE}{{{ENGINE_SELECTOR}}}\n"
    f"  / on({INSTANCE}) group_left() ({INSTANCE_PROMPT_TOKENS} > 0)"
)
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
WARM_COLD_TTFT_RATIO = per_route("max", f"kvwatch_probe_warm_cold_ttft_ratio{{{PROBE_SELECTOR}}}")
PROBE_STICKY_SHARE = _ratio(
    _sum_rate("kvwatch_probe_stickiness_sessions_total", f'{PROBE_SELECTOR}, sticky="true"', ROUTE),
    _sum_rate("kvwatch_probe_stickiness_sessions_total", f'{PROBE_SELECTOR}, sticky!="unknown"', ROUTE),
)
# What a route's stickiness is judged by: per route, the share of its probe sessions judged by the replica
# a round names, by the warm rounds' reuse (SageMaker names no replica), or by nothing.
PROBE_EVIDENCE_SHARE = (
    _sum_rate("kvwatch_probe_evidence_sessions_total", PROBE_SELECTOR, f"{ROUTE}, evidence")
    + f"\n  / on ({ROUTE}) group_left() "
    + f"({_sum_rate('kvwatch_probe_evidence_sessions_total', PROBE_SELECTOR, ROUTE)} > 0)"
)
# The last run's share of sticky sessions per route, with the evidence they were judged by: by replica,
# KVWatchSessionAffinityBroken's gauge, by reuse KVWatchSessionReuseLost's; and the warm rounds' reuse
# behind the latter.
PROBE_LAST_RUN_STICKY = f"min by ({ROUTE}, evidence) (kvwatch_probe_sticky_ratio{{{PROBE_SELECTOR}}})"
PROBE_WARM_REUSE = f"min by ({ROUTE}, evidence) (kvwatch_probe_warm_reuse_ratio{{{PROBE_SELECTOR}}})"
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


def _probe_share(counter: str, leg: str) -> str:
    tokens = _sum_rate(counter, PROBE_SELECTOR, ROUTE)
    prompt = _sum_rate("kvwatch_probe_prompt_tokens_total", PROBE_SELECTOR, ROUTE)
    return f'label_replace({_ratio(tokens, prompt)}, "leg", "{leg}", "", "")'


# kvwatch's own probe sessions' reuse decomposition per route, over all their rounds: of their prompt
# tokens, what a replica holding each conversation would have cached (the ideal kvwatch knows: its
# sessions' available leg) and what the engines delivered; the gap is lost to routing or the engine.
PROBE_REUSE_SHARES = "\n  or ".join(
    _probe_share(counter, leg)
    for counter, leg in (
        ("kvwatch_probe_ideal_cached_tokens_total", "available"),
        ("kvwatch_probe_cached_tokens_total", "delivered"),
    )
)
SESSION_ID_NOT_ECHOED_SHARE = _ratio(
    _sum_rate("kvwatch_probe_session_id_echo_sessions_total", f'{PROBE_SELECTOR}, echoed="false"', ROUTE),
    _sum_rate("kvwatch_probe_session_id_echo_sessions_total", PROBE_SELECTOR, ROUTE),
)
REQUESTS_WITHOUT_SESSION_KEY_SHARE = _ratio(
    _sum_rate("kvwatch_gateway_requests_without_session_key_total", "", "log, listener"),
    _sum_rate("kvwatch_gateway_requests_total", "", "log, listener"),
)
# Real users' median time to first byte by round per gateway listener, from the access log: the
# per-round chart for real traffic (the first token where the gateway times the answer's body, Envoy).
GATEWAY_FIRST_BYTE_BY_ROUND = "max by (log, listener, round) (kvwatch_gateway_first_byte_median_seconds)"
# Each route's probes' share of its cluster's prompt tokens (kvwatch's own share).
PROBE_SHARE_BY_ROUTE = f"{ROUTE_PROBE_SHARE}{{{PROBE_SELECTOR}}}"
PROBE_ERRORS_BY_KIND = _sum_rate("kvwatch_probe_errors_total", PROBE_SELECTOR, "kind")
PROBE_ROUNDS_BY_BACKEND = _sum_rate("kvwatch_probe_backend_rounds_total", PROBE_SELECTOR, "backend")
PROBE_LAST_RUN_AGE = (
    f"time() - max by ({ROUTE}) (kvwatch_probe_last_run_timestamp_seconds{{{PROBE_SELECTOR}}})"
)
FIRING_ALERTS_NOW = 'ALERTS{alertstate="firing", alertname=~"KVWatch.+"}'
FIRING_ALERTS_BY_NAME = f"count by (alertname, severity) ({FIRING_ALERTS_NOW})"
REAL_SESSIONS_SPREAD = GATEWAY_SPREAD_SHARE  # by log, listener and failover


# What the Streamlit app (dashboard/app_pages/) shows besides the boards' panels above.

# Each source's share of the cluster's prompt tokens.
CLUSTER_CACHED_SHARE_BY_SOURCE = (
    f"sum by (source) ({INSTANCE_CACHED_BY_SOURCE})\n"
    f"  / on() group_left() (sum({INSTANCE_PROMPT_TOKENS}) > 0)"
)
# Each LMCache tier's share of the tokens asked of LMCache, over the cluster.
CLUSTER_LMCACHE_HIT_SHARE_BY_TIER = (
    f"sum by (source) ({INSTANCE_LMCACHE_HITS_BY_TIER})\n"
    f"  / on() group_left() (sum({LMCACHE.instance_total}) > 0)"
)
PREFIX_CACHING_CONFIG = "max by (job, instance, enable_prefix_caching) (vllm:cache_config_info)"

# Each LMCache tier's share of the tokens asked of that LMCache (L1: its CPU memory; L2: disk or a remote
# store), per instance: beside the engines' split by source. The engines' job and instance filters pick
# LMCache's multi-process server, a target of its own, as any other.
LMCACHE_HIT_SHARE_BY_TIER = (
    f"{INSTANCE_LMCACHE_HITS_BY_TIER}{{{ENGINE_SELECTOR}}}\n"
    f"  / on({INSTANCE}) group_left() ({LMCACHE.instance_total}{{{ENGINE_SELECTOR}}} > 0)"
)
