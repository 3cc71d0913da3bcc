"""The PromQL of the rules and alerts, each expression once: the series the recording rules record and the
expressions they and the alerts build on, the signals the alerts judge, and what kvwatch's own pipeline
check asks. The panel queries of the boards and the Streamlit app, built on these, are in
prometheus/panel_queries.py.

The recording rules are prometheus/rules.py's, the alerts alerts/alerts.py's, the thresholds
prometheus/thresholds.py's; the dashboards read the recorded series by the names defined here, and
their verdicts (alerts/verdicts.py) are the alerts' states.

Conventions: ratios are ratios of summed rates, never averages of ratios; a denominator guarded by
`> 0` makes zero traffic give no sample rather than 0 or NaN. Rules are `level:metric:operations`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.core.labels import CLUSTER_LABEL

WINDOW = "2m"
INSTANCE = "job, instance"
ROUTE = "target, route_mode"
LISTENER = "log, listener"
QUANTILES = ("0.5", "0.9", "0.99")


@dataclass(frozen=True)
class Grouping:
    """The labels the rules and alerts aggregate and match by. Each keeps the cluster label, so that no rule
    merges two clusters, and a Prometheus without the label reads as one cluster. `WHOLE`, without it, is
    the dashboards' grouping: they narrow their queries to the clusters picked instead."""

    cluster: str = CLUSTER_LABEL

    def keeping(self, labels: str = "") -> str:
        """What `by (...)` and `on(...)` list: `labels` and the cluster label (alone for a cluster's sum)."""
        return ", ".join(filter(None, (self.cluster, labels)))

    @property
    def instance(self) -> str:
        return self.keeping(INSTANCE)

    @property
    def route(self) -> str:
        return self.keeping(ROUTE)

    @property
    def listener(self) -> str:
        return self.keeping(LISTENER)


WHOLE = Grouping("")


def first_of(*selectors: str, by: str, window: str = WINDOW) -> str:
    """Sum by `by` of the rate of the first series that exists: one name per engine or engine version."""
    return "\n  or ".join(f"sum by ({by}) (rate({selector}[{window}]))" for selector in selectors)


@dataclass(frozen=True)
class TokenRatio:
    """A token-weighted ratio, hit tokens over all tokens, recorded per instance and for the cluster.

    Each side lists one counter per engine flavour or version, preferred first; an instance's hit rate
    comes from the counter matching its total's. Never above 1: counters that start at different moments
    (start-up, a series created on its first increment) or reset make rate() extrapolate them differently,
    so an instance's hit rate is capped by its own total rate, and only instances with both count.
    """

    ratio: str  # the recorded metric, e.g. "cached_prompt_tokens_per_prompt_tokens"
    hit: str  # its numerator's, e.g. "cached_prompt_tokens"
    total: str  # its denominator's, e.g. "prompt_tokens"
    hit_counters: tuple[str, ...]
    total_counters: tuple[str, ...]
    # A total counter whose engine creates the hit counter on its first hit: until then it hit nothing.
    zero_hits_until_created: str | None = None
    # A ratio gauge of engines with no counters at all (-1: no data), taken per instance as it is.
    gauge: str | None = None

    @property
    def instance_total(self) -> str:
        return f"instance:kvwatch_{self.total}:rate{WINDOW}"

    @property
    def instance_hits(self) -> str:
        return f"instance:kvwatch_{self.hit}:rate{WINDOW}"

    @property
    def instance_ratio(self) -> str:
        return f"instance:kvwatch_{self.ratio}:ratio_rate{WINDOW}"

    @property
    def cluster_ratio(self) -> str:
        return f"cluster:kvwatch_{self.ratio}:ratio_rate{WINDOW}"


V0_HIT_RATE = "vllm:gpu_prefix_cache_hit_rate"
SGLANG_HIT_MODES = 'sglang:prefill_effective_tokens_total{mode=~".+_hit"}'

# The headline: prompt tokens the engine did not compute because their KV was cached, wherever it came
# from (the device's prefix cache, host memory, disk, another instance), over all prompt tokens. A
# replica with prefix caching off counts as 0 %, and decode pods fed by KV transfer count as hits.
DELIVERED = TokenRatio(
    ratio="cached_prompt_tokens_per_prompt_tokens",
    hit="cached_prompt_tokens",
    total="prompt_tokens",
    hit_counters=(
        "vllm:prompt_tokens_cached_total",  # vLLM >= 0.16: local and external hits
        "vllm:prefix_cache_hits_total",  # before 0.16 the local hits are all there is
        "vllm:gpu_prefix_cache_hits_total",  # vLLM V1 0.8 - 0.11, deprecated
        SGLANG_HIT_MODES,  # SGLang >= 0.5.20: without retracted requests counted twice
        "sglang:cached_tokens_total",
    ),
    total_counters=(
        "vllm:prompt_tokens_total",
        "sglang:prefill_effective_tokens_total",
        "sglang:prompt_tokens_total",
    ),
    zero_hits_until_created="sglang:prompt_tokens_total",
    gauge=V0_HIT_RATE,
)
# The local prefix cache's own lookups: tokens found over tokens looked up. vLLM stops looking up when
# prefix caching is off, so such a replica drops out of it instead of counting as 0 %.
LOCAL = TokenRatio(
    ratio="prefix_cache_hit_tokens_per_queried_tokens",
    hit="prefix_cache_hit_tokens",
    total="prefix_cache_queried_tokens",
    hit_counters=(
        "vllm:prefix_cache_hits_total",  # vLLM V1 >= 0.9
        "vllm:gpu_prefix_cache_hits_total",
        'sglang:cached_tokens_total{cache_source!~"host|storage"}',  # SGLang: every prompt is looked up
    ),
    total_counters=(
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
        "sglang:prompt_tokens_total",
    ),
    zero_hits_until_created="sglang:prompt_tokens_total",
    gauge=V0_HIT_RATE,
)
# LMCache's own view next to the engine's: tokens its store held over tokens asked of it.
LMCACHE = TokenRatio(
    ratio="lmcache_hit_tokens_per_requested_tokens",
    hit="lmcache_hit_tokens",
    total="lmcache_requested_tokens",
    # In-process (`lmcache:`), else the multi-process server's own names (OpenTelemetry, `lmcache_mp_`).
    hit_counters=("lmcache:num_hit_tokens_total", "lmcache_mp_lookup_hit_tokens_total"),
    total_counters=("lmcache:num_requested_tokens_total", "lmcache_mp_lookup_requested_tokens_total"),
)
# LMCache's multi-process server's hits by tier (its PR #4962): L1 in CPU memory, L2 on disk or a remote
# store. Divide by LMCACHE's requested tokens for each tier's share of what was asked of it.
LMCACHE_HITS_BY_TIER = (
    ("lmcache_mp_lookup_hit_l1_tokens_total", "l1"),
    ("lmcache_mp_lookup_hit_l2_tokens_total", "l2"),
)
INSTANCE_LMCACHE_HITS_BY_TIER = f"instance_source:kvwatch_lmcache_hit_tokens:rate{WINDOW}"

# Cached prompt tokens by where their KV came from, as each engine names it: vLLM >= 0.33 device, host,
# p2p, disk, external_unspecified; vLLM 0.16 - 0.31 local_cache_hit, external_kv_transfer; SGLang
# device, host, storage. Divide by the instance's prompt tokens for each source's share.
# (counter, the label naming the source, the regex taking the source's name from it unless it is `source`)
CACHED_BY_SOURCE = (
    ("vllm:prompt_tokens_cached_by_source_total", "source", ""),
    ('vllm:prompt_tokens_by_source_total{source!="local_compute"}', "source", ""),
    (SGLANG_HIT_MODES, "mode", "(.+)_hit"),
    ('sglang:cached_tokens_total{cache_source!=""}', "cache_source", "(.+)"),
)
TTFT_BUCKETS = ("vllm:time_to_first_token_seconds_bucket", "sglang:time_to_first_token_seconds_bucket")
FINISHED_REQUESTS = ("vllm:request_success_total", "sglang:num_requests_total")
# Any of these on an instance means its engine exports cache metrics kvwatch can read.
ENGINE_CACHE_SERIES = tuple(
    dict.fromkeys(
        selector.partition("{")[0]
        for selector in (*DELIVERED.hit_counters, *LOCAL.hit_counters, *LOCAL.total_counters)
    )
) + (V0_HIT_RATE, "sglang:cache_hit_rate")
# Every vLLM and SGLang version exports its running-requests gauge from its start, whatever else it
# exports: it tells an engine from any other target, under any job name. Pipelines that rewrite ":" to
# "_" are recognised too (and then every kvwatch rule misses the engine).
ENGINE_PRESENCE_SERIES = tuple(
    spelling
    for name in ("vllm:num_requests_running", "sglang:num_running_reqs")
    for spelling in (name, name.replace(":", "_"))
)
ENGINE_PRESENCE = '{__name__=~"' + "|".join(ENGINE_PRESENCE_SERIES) + '"}'

# The engines and routers a Prometheus scrapes now, one series per target (`kvwatch init` lists them):
# engines by their running-requests gauge, routers by the prefix of their metrics' names.
ENGINE_TARGETS = (
    'group by (__name__, job, instance, replica, pod) ({__name__=~"'
    + "|".join(ENGINE_PRESENCE_SERIES)
    + '"})'
)
ROUTER_METRIC_PREFIXES = ("smg_", "sgl_router_", "vllm_router_", "llm_d_epp_", "inference_extension_",
                          "dynamo_component_router_", "aibrix_prefix_cache_routing_")  # fmt: skip
ROUTER_TARGETS = 'group by (job, instance) ({__name__=~"(' + "|".join(ROUTER_METRIC_PREFIXES) + ').+"})'

INSTANCE_HIT_RATIO = DELIVERED.instance_ratio
CLUSTER_HIT_RATIO = DELIVERED.cluster_ratio
CLUSTER_LOCAL_HIT_RATIO = LOCAL.cluster_ratio  # the second, labelled figure beside the headline
INSTANCE_PROMPT_TOKENS = DELIVERED.instance_total
INSTANCE_CACHED_BY_SOURCE = f"instance_source:kvwatch_cached_prompt_tokens:rate{WINDOW}"
INSTANCE_TTFT = "instance_quantile:kvwatch_ttft_seconds:histogram_quantile"
ENGINE_TTFT = "engine_quantile:kvwatch_ttft_seconds:histogram_quantile"
INSTANCE_REQUESTS = f"instance:kvwatch_requests:rate{WINDOW}"
INSTANCE_REQUEST_SHARE = f"instance:kvwatch_requests_per_cluster_requests:ratio_rate{WINDOW}"
CLUSTER_LOAD_IMBALANCE = f"cluster:kvwatch_requests_max_per_mean:ratio_rate{WINDOW}"
INSTANCE_CACHE_SERIES = "instance:kvwatch_engine_cache_series:present"
# 1 for a cluster where an engine restarted, went down or came back within the thresholds'
# replica_change_window (engines_changed): recorded, so that the lab's time scale applies to it.
CLUSTER_ENGINES_CHANGED = "cluster:kvwatch_engines_changed:present"
GATEWAY_SPREAD_SHARE = "listener:kvwatch_gateway_spread_sessions_per_returning_sessions:ratio"
# Real users' returning requests (a session's request after its previous one): over a minute, how many come
# back, and the share served by another replica than their session's previous request, by whether a
# failover explains it. A break shows as soon as sessions come back, not after half the spread window.
MOVED_WINDOW = "1m"
GATEWAY_RETURNING_REQUESTS = f"listener:kvwatch_gateway_returning_requests:rate{MOVED_WINDOW}"
GATEWAY_MOVED_SHARE = (
    f"listener:kvwatch_gateway_moved_requests_per_returning_requests:ratio_rate{MOVED_WINDOW}"
)


# What routers predict they will reuse, next to what the engines delivered (CLUSTER_HIT_RATIO): the mean
# of a router's per-request predicted hit ratios (histograms of ratios: _sum over _count), from llm-d's
# prefix indexer (its current and its deprecated name) and Dynamo's KV router. The router's guess from
# its own index, not an engine hit. Delivered per predicted near 1: the prediction holds; near 0: the
# router sends requests where it believes their prefix cached, and the engines compute it all again.
ROUTER_PREDICTED_HIT_RATIOS = (
    "llm_d_epp_prefix_indexer_hit_ratio",
    "inference_extension_prefix_indexer_hit_ratio",
    "dynamo_component_router_kv_hit_rate",
    "smg_cache_aware_match_ratio",  # SMG's cache_aware policy: its radix tree's best match per request
)
INSTANCE_ROUTER_PREDICTIONS = f"instance:kvwatch_router_predictions:rate{WINDOW}"
INSTANCE_ROUTER_PREDICTED_HIT_RATIO = f"instance:kvwatch_router_predicted_hit_ratio:mean_rate{WINDOW}"
INSTANCE_ROUTER_DELIVERED_PER_PREDICTED = (
    f"instance:kvwatch_router_delivered_per_predicted_hit_ratio:ratio_rate{WINDOW}"
)


@dataclass(frozen=True)
class ReuseLegs:
    """One router flavour's token-weighted legs of the reuse decomposition, as counters (or sums of
    histograms of token counts) of the tokens each leg covers."""

    prompt: str  # prompt tokens the router routed
    available: str  # the most any candidate replica held of each prompt when the router chose
    routed: str  # what the chosen replica held, as the router predicted
    delivered: str  # what the engines reused (cached tokens of the answers' usage) ...
    delivered_of: str  # ... out of these prompt tokens: the ratio is applied to `prompt`
    # For a router that exports `delivered` at zero before any worker reports reuse to it: the cached and
    # prompt tokens whose ratio stands in for the delivered one while `delivered` has never moved.
    until_reported: tuple[str, str] | None = None


# The reuse decomposition: of the prompt tokens a router routed, the share the best replica held when it
# chose (available), the share the chosen replica held as the router predicted (routed), and the share the
# engines reused (delivered). Each step down is a named loss: workload (nothing held anywhere), routing
# (the router chose a replica holding less than the best), engine / index (the router predicted reuse the
# engine did not deliver: caching off, evicted, a stale index). Token-weighted only: the routers' means of
# per-request ratios stay with KVWatchRouterPredictionMiss, whose series says it is a mean.
REUSE_LEGS = (
    ReuseLegs(  # llm-d's EPP: prefix-plugin histograms (llm-d-router PR #2897) and the engines' usage
        prompt="llm_d_epp_prefix_prompt_tokens_sum",
        available="llm_d_epp_prefix_best_available_cached_tokens_sum",
        routed="llm_d_epp_prefix_predicted_cached_tokens_sum",
        delivered="llm_d_epp_request_cached_tokens_sum",
        delivered_of="llm_d_epp_request_input_tokens_sum",
    ),
    ReuseLegs(  # Dynamo's KV router: its cache-reuse funnel F0, F2, F3, F4 (dynamo PR #14103)
        prompt="dynamo_component_router_input_sequence_tokens_sum",
        available="dynamo_component_router_kv_best_eligible_cached_prefix_tokens_total",
        routed="dynamo_component_router_kv_selected_cached_prefix_tokens_total",
        delivered="dynamo_component_router_kv_worker_reused_tokens_total",
        delivered_of="dynamo_component_router_input_sequence_tokens_sum",
        # The frontend's usage, as collectors.engines.dynamo falls back to (Dynamo 1.6.1's mocker reports
        # no reuse to the router, though its answers carry cached tokens).
        until_reported=("dynamo_frontend_cached_tokens_sum", "dynamo_frontend_input_sequence_tokens_sum"),
    ),
)
REUSE_LEG_NAMES = ("available", "routed", "delivered")  # the shares of the prompt, in order
REUSE_LOSSES = {  # each loss: the leg above it minus the leg below it (the prompt above "available")
    "workload": (None, "available"),
    "routing": ("available", "routed"),
    "engine": ("routed", "delivered"),
}
INSTANCE_ROUTER_REUSE_TOKENS = f"instance:kvwatch_router_reuse_tokens:rate{WINDOW}"  # by leg, with prompt
INSTANCE_ROUTER_REUSE_SHARE = f"instance:kvwatch_router_reuse_tokens_per_prompt_tokens:ratio_rate{WINDOW}"
CLUSTER_ROUTER_REUSE_SHARE = f"cluster:kvwatch_router_reuse_tokens_per_prompt_tokens:ratio_rate{WINDOW}"
INSTANCE_ROUTER_REUSE_LOSS = f"instance:kvwatch_router_lost_tokens_per_prompt_tokens:ratio_rate{WINDOW}"
CLUSTER_ROUTER_REUSE_LOSS = f"cluster:kvwatch_router_lost_tokens_per_prompt_tokens:ratio_rate{WINDOW}"


# SMG's manual (routing-key) policy: of the requests whose key was already pinned to a worker, the share
# that reached it (`occupied_hit`) rather than respilling to another (`occupied_miss`: the pinned worker
# was gone or overloaded). The router's own stickiness, next to the probe's.
SMG_BRANCHES = "smg_manual_policy_branch_total"
INSTANCE_ROUTER_PIN_KEPT = f"instance:kvwatch_router_pin_kept_per_pinned_requests:ratio_rate{WINDOW}"
# Cache-aware routers: the share of their routing decisions that followed a cached prefix their own
# index matched, as each flavour counts them (decisions that matched, the others). A guess from the
# router's index, not an engine hit; falling while the traffic is unchanged: the index lost the prefixes.
PREFIX_MATCH_DECISIONS = (
    # SMG's cache_aware policy: sent where its radix tree matched, not by load (spill) or a fallback
    (
        'smg_cache_aware_policy_branch_total{branch="tree_match"}',
        'smg_cache_aware_policy_branch_total{branch!="tree_match"}',
    ),
    # vllm-router's cache_aware policy, then its and sglang-router <= 0.2's cache hit / miss counters
    (
        'vllm_router_prefix_routing_decisions_total{outcome="prefix_hit"}',
        'vllm_router_prefix_routing_decisions_total{outcome!="prefix_hit"}',
    ),
    ("vllm_router_cache_hits_total", "vllm_router_cache_misses_total"),
    ("sgl_router_cache_hits_total", "sgl_router_cache_misses_total"),
    # AIBrix's prefix-cache router: the chosen pod matched more than 0 % of the prompt
    (
        'aibrix_prefix_cache_routing_decisions_total{match_percent_bucket!="0"}',
        'aibrix_prefix_cache_routing_decisions_total{match_percent_bucket="0"}',
    ),
)
INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS = (
    f"instance:kvwatch_router_prefix_match_decisions_per_decisions:ratio_rate{WINDOW}"
)


# AIBrix's prefix-cache router (vllm-project/aibrix#2334) counts each routing decision by how it chose the
# pod: `prefix_match` (a pod its index matched), `prefix_match_skipped` (the matched pods were too loaded:
# the least loaded pod instead), `least_request_fallback` (nothing matched). The decisions that followed
# its index against the others, as queries.PREFIX_MATCH_DECISIONS pairs them: rules.py puts it ahead of
# AIBrix's match-percent buckets, which gateways before that change count alone.
AIBRIX_SELECTIONS = (
    'aibrix_prefix_cache_routing_selection_total{selection="prefix_match"}',
    'aibrix_prefix_cache_routing_selection_total{selection!="prefix_match"}',
)
AIBRIX_DECISIONS = "aibrix_prefix_cache_routing_selection_total"
# Routing attempts its index did not decide, beside those decisions: the load-imbalance gate fired (the
# pods' running requests too far apart: the choice narrowed to the least loaded pods; named
# ..._prefix_cache_load_imbalance_total, then aibrix_load_imbalance_total once the gate applied to every
# strategy), or routing failed, by reason (tokenize_failed, no_target_pod, load_imbalance_no_target, ...).
AIBRIX_ERRORS = "aibrix_prefix_cache_routing_errors_total"
AIBRIX_LOAD_IMBALANCE = ("aibrix_prefix_cache_load_imbalance_total", "aibrix_load_imbalance_total")
# Per router, such attempts per routed decision, by reason: `load_imbalance`, or `error:<its reason>`.
INSTANCE_ROUTER_FALLBACKS = f"instance_reason:kvwatch_router_fallbacks_per_decisions:ratio_rate{WINDOW}"


# Routers' session tables (llm-d's session binding tracker; Dynamo's affinity table exports no series, a
# full one answers 503): sessions bound now, new sessions refused per second, bindings dropped per second
# by reason (idle past the TTL and close are the table working; pod_delete and error lose sessions early).
SESSION_BINDINGS = "llm_d_epp_session_control_bindings"
SESSION_BIND_REJECTIONS = "llm_d_epp_session_control_bind_rejections_total"
SESSION_INVALIDATIONS = "llm_d_epp_session_control_invalidations_total"
SESSION_LIFECYCLE_REASONS = "idle|close"
INSTANCE_ROUTER_SESSION_BINDINGS = "instance:kvwatch_router_session_bindings:sum"
INSTANCE_ROUTER_SESSION_BIND_REJECTIONS = f"instance:kvwatch_router_session_bind_rejections:rate{WINDOW}"
INSTANCE_ROUTER_SESSION_INVALIDATIONS = f"instance_reason:kvwatch_router_session_invalidations:rate{WINDOW}"
# A router's KV-event index (SMG): how far it trails the engines' events (its worst worker), the event
# gaps and resyncs per second, the ranks it cannot trust. Lagging or gapping, it predicts stale reuse.
KV_EVENT_LAG = "smg_kv_event_lag_seconds"
KV_EVENT_GAPS = "smg_kv_event_gaps_total"
KV_EVENT_RESYNCS = "smg_kv_event_resyncs_total"
KV_EVENT_DEGRADED_RANKS = "smg_kv_event_degraded_ranks"
INSTANCE_ROUTER_KV_EVENT_LAG = "instance:kvwatch_router_kv_event_lag_seconds:max"
INSTANCE_ROUTER_KV_EVENT_GAPS = f"instance:kvwatch_router_kv_event_gaps:rate{WINDOW}"
INSTANCE_ROUTER_KV_EVENT_RESYNCS = f"instance:kvwatch_router_kv_event_resyncs:rate{WINDOW}"
INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS = "instance:kvwatch_router_kv_event_degraded_ranks:sum"
# kvwatch's own share: its probes are traffic the engines count too. Every probe request's tokens as the
# engine counted them (its usage, failed rounds included, kvwatch_probe_engine_*_tokens_total), per route
# and over the cluster's engines; and the engines' delivered ratio without them, real traffic's alone. The
# engines' counters carry no route, so real traffic's ratio is per cluster (a route with engines of its
# own gets a cluster of its own).
PROBE_ENGINE_PROMPT_TOKENS = "kvwatch_probe_engine_prompt_tokens_total"
PROBE_ENGINE_CACHED_TOKENS = "kvwatch_probe_engine_cached_tokens_total"
ROUTE_PROBE_PROMPT_TOKENS = f"route:kvwatch_probe_engine_prompt_tokens:rate{WINDOW}"
ROUTE_PROBE_CACHED_TOKENS = f"route:kvwatch_probe_engine_cached_tokens:rate{WINDOW}"
ROUTE_PROBE_SHARE = f"route:kvwatch_probe_prompt_tokens_per_prompt_tokens:ratio_rate{WINDOW}"
CLUSTER_PROBE_SHARE = f"cluster:kvwatch_probe_prompt_tokens_per_prompt_tokens:ratio_rate{WINDOW}"
CLUSTER_REAL_HIT_RATIO = (
    f"cluster:kvwatch_real_cached_prompt_tokens_per_real_prompt_tokens:ratio_rate{WINDOW}"
)


def cluster_engine_tokens(by: Grouping) -> tuple[str, str]:
    """The cluster's prompt and cached prompt token rates as its delivered ratio sums them (instances
    with both)."""
    cluster, hits, total = by.keeping(), DELIVERED.instance_hits, DELIVERED.instance_total
    return f"sum by ({cluster}) ({total} and {hits})", f"sum by ({cluster}) ({hits})"


def watched_routes(by: Grouping) -> str:
    """Routes whose sessions must stay on one replica (the config's expect_sticky, exported by kvwatch
    serve): the affinity alerts watch only these."""
    return f'on({by.keeping("target")}) kvwatch_probe_route_info{{expect_sticky="true"}}'


def watched_listeners(by: Grouping) -> str:
    """Gateway logs whose sessions must stay on one replica."""
    return f'on({by.keeping("log")}) kvwatch_gateway_log_info{{expect_sticky="true"}}'


def per_route(aggregation: str, metric: str, by: Grouping = WHOLE) -> str:
    """A probe gauge per route, without the exporter's `job` and `instance`: the alert is about the route."""
    return f"{aggregation} by ({by.route}) ({metric})"


# What the alerts judge, one series per route, listener or the cluster: the alerts compare these with
# their thresholds, and the pages and boards show them beside the alerts' verdicts.
def sticky_ratio(by: Grouping) -> str:
    """The last probe run's share of sessions that stayed on one replica, on routes whose rounds name
    their replica (a series without the evidence label is an older exporter's: judged so too)."""
    return per_route("min", 'kvwatch_probe_sticky_ratio{evidence!="reuse"}', by)


def engines_changed(by: Grouping, window: str) -> str:
    """Clusters where an engine restarted (its prompt-token counter went back), went down or came back
    within `window`. A gateway moves the sessions of a replica that is gone to another one, and back
    once it returns: a probe session that changed replica then says nothing of the pinning."""
    present = " or ".join(f"last_over_time({name}[{window}])" for name in ENGINE_PRESENCE_SERIES)
    engines = f"group by ({by.instance}) ({present})"  # one name at a time: `or` takes the first spelling
    restarted = " or ".join(f"resets({counter}[{window}]) > 0" for counter in DELIVERED.total_counters)
    # Down or back: up was both 0 and 1 in the window. Not changes(), which VictoriaMetrics also counts
    # for every series that began in the window (all of them, after it starts).
    went = f"min_over_time(up[{window}]) == 0 and max_over_time(up[{window}]) == 1"
    return (
        f"group by ({by.keeping()}) ({restarted})\n"
        f"  or group by ({by.keeping()}) ({went} and on({by.instance}) {engines})"
    )


def sticky_routes_judged(by: Grouping) -> str:
    """The routes KVWatchSessionAffinityBroken judges now: those expected to be sticky, in a cluster
    whose engines stayed as they were (CLUSTER_ENGINES_CHANGED)."""
    return f"{watched_routes(by)}\nunless on({by.keeping()}) {CLUSTER_ENGINES_CHANGED}"


def reused_sessions_ratio(by: Grouping) -> str:
    """The last probe run's share of sessions whose every warm round kept its reuse, on routes judged by
    reuse alone: no round named its replica (SageMaker, which names none)."""
    return per_route("min", 'kvwatch_probe_sticky_ratio{evidence="reuse"}', by)


def warm_cold_ratio(by: Grouping) -> str:
    return per_route("max", "kvwatch_probe_warm_cold_ttft_ratio", by)  # the last probe run's


def warm_reuse_ratio(by: Grouping) -> str:
    """The last probe run's warm-round reuse (cached over ideal tokens) on routes judged by reuse alone:
    the tokens behind reused_sessions_ratio."""
    return per_route("min", 'kvwatch_probe_warm_reuse_ratio{evidence="reuse"}', by)


def route_warm_reuse(by: Grouping) -> str:
    """An alert description's warm reuse of the route it is about (a template query at notification
    time), as `, and their warm rounds had 74% of the tokens ...`; nothing where Prometheus holds none."""
    matchers, values = _alert_labels(by.route)
    lookup = per_route("min", f'kvwatch_probe_warm_reuse_ratio{{evidence="reuse", {matchers}}}', by)
    return (
        f"{{{{ with printf `{lookup}` {values} | query }}}}, and their warm rounds had "
        "{{ . | first | value | humanizePercentage }} of the tokens a pinned session holds cached{{ end }}"
    )


def gateway_spread(by: Grouping) -> str:
    return f'max by ({by.listener}) ({GATEWAY_SPREAD_SHARE}{{failover="false"}})'


def gateway_moved(by: Grouping) -> str:
    return f'max by ({by.listener}) ({GATEWAY_MOVED_SHARE}{{failover="false"}})'


def replica_ids(by: Grouping) -> str:
    """The replica id of each scraped instance, from a `replica` target label (the lab's scrape config sets
    one; set one in yours): the pages and the alerts name a replica by id and address together."""
    return f'group by ({by.keeping("instance, replica")}) (up{{replica!=""}})'


def _alert_labels(labels: str) -> tuple[str, str]:
    """A template query's matchers of these labels (`label=%q`, for printf) and the alert's values of
    them to fill in. An absent label is "" to Prometheus's templates but nil to vmalert's, which `printf
    %q` renders as `%!q(<nil>)`: `or` makes it "" in both."""
    names = labels.split(", ")
    matchers = ", ".join(f"{name}=%q" for name in names)
    return matchers, " ".join(f'(or $labels.{name} "")' for name in names)


def instance_name(by: Grouping) -> str:
    """An alert description's name for the instance it is about, as the pages give it: `r2 (127.0.0.1:20812)`
    where the replica ids know the instance's id (a template query at notification time), else its address.
    The instance is looked up in its own cluster: "" matches a Prometheus without the label."""
    matchers, values = _alert_labels(by.keeping("instance"))
    lookup = f"{replica_ids(by)} and on({by.keeping('instance')}) up{{{matchers}}}"
    return (
        "{{ $name := $labels.instance }}"
        f"{{{{ range printf `{lookup}` {values} | query }}}}"
        '{{ $name = printf "%s (%s)" .Labels.replica $labels.instance }}{{ end }}{{ $name }}'
    )


WATCHED_ROUTES, WATCHED_LISTENERS = watched_routes(WHOLE), watched_listeners(WHOLE)
STICKY_ROUTES_JUDGED = sticky_routes_judged(WHOLE)
STICKY_RATIO, WARM_COLD_RATIO = sticky_ratio(WHOLE), warm_cold_ratio(WHOLE)
REUSED_SESSIONS_RATIO, WARM_REUSE_RATIO = reused_sessions_ratio(WHOLE), warm_reuse_ratio(WHOLE)
GATEWAY_SPREAD = gateway_spread(WHOLE)
REPLICA_IDS = replica_ids(WHOLE)


# --- kvwatch's own pipeline ----------------------------------------------------------------------------
# What prometheus/pipeline.py asks to tell whether kvwatch can see: the engines Prometheus scrapes, and the
# series of kvwatch serve's exporter (every name it exports starts with kvwatch_; the recorded series have
# a level and colons before theirs).
ENGINES_SCRAPED = f"group by (job, instance) ({ENGINE_PRESENCE})"
EXPORTER_SERIES = 'group by (job, instance) ({__name__=~"kvwatch_.+"})'
# Where vmalert, which has no /api/v1/alertmanagers, sent its alerts: its own counter, where it is scraped.
RULE_ENGINE_NOTIFIERS = "sum by (addr) (vmalert_alerts_sent_total)"
