"""Every PromQL expression kvwatch uses, in one place.

The recording rules in prometheus/rules/ and the alert rules in alerts/ are generated from `RULE_FILES`
(`make generate`; a test fails when the committed files are stale), the dashboards read the recorded
series by the names defined here, and their verdicts are the alerts' states, from the alerts' own
expressions (`Verdict`).

Conventions: ratios are ratios of summed rates, never averages of ratios; a denominator guarded by
`> 0` makes zero traffic give no sample rather than 0 or NaN. Rules are `level:metric:operations`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvwatch.prometheus import promql

WINDOW = "2m"
# The label that tells clusters apart, as the Prometheus (external_labels, remote_write) or kvwatch's own
# exporter (exporter.cluster) sets it; a Prometheus of one cluster without it reads as one cluster.
CLUSTER_LABEL = "cluster"
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


@dataclass(frozen=True)
class Rule:
    record: str
    expr: str
    labels: dict[str, str] | None = None


def _first_of(*selectors: str, by: str, window: str = WINDOW) -> str:
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

    def rules(self, by: Grouping) -> tuple[Rule, ...]:
        total, hits, cluster = self.instance_total, self.instance_hits, by.keeping()
        hit_rate = _first_of(*self.hit_counters, by=by.instance)
        if self.zero_hits_until_created:
            hit_rate += f"\n  or 0 * {_first_of(self.zero_hits_until_created, by=by.instance)}"
        instance_ratio = f"{hits} / ({total} > 0)"
        if self.gauge:
            instance_ratio += f"\n  or max by ({by.instance}) ({self.gauge} >= 0)"
        return (
            Rule(total, _first_of(*self.total_counters, by=by.instance)),
            # min(hit rate, total rate), on instances that have both
            Rule(hits, f"{total} - clamp_min({total} - (\n  {hit_rate}\n), 0)"),
            Rule(self.instance_ratio, instance_ratio),
            Rule(
                self.cluster_ratio,
                f"sum by ({cluster}) ({hits}) / (sum by ({cluster}) ({total} and {hits}) > 0)",
            ),
        )


# vLLM V0 only reports a hit-rate gauge computed by the engine; -1 means no data.
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
    hit_counters=("lmcache:num_hit_tokens_total",),
    total_counters=("lmcache:num_requested_tokens_total",),
)

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
GATEWAY_SPREAD_SHARE = "listener:kvwatch_gateway_spread_sessions_per_returning_sessions:ratio"


def _ttft_buckets(by: str) -> str:
    parts = [f"sum by ({by}, le) (rate({name}[{WINDOW}]))" for name in TTFT_BUCKETS]
    return "\n  or ".join(parts)


def _engine_ttft_buckets(by: Grouping) -> str:
    """TTFT bucket rates summed per engine family, over the bounds every instance of the family in the
    cluster has.

    vLLM and SGLang buckets differ, and so do two vLLM instances' when one sets its own
    (--custom-histogram-buckets): a bound that only some instances have would mix counts of different
    ranges, so only the shared bounds (always at least +Inf) are summed. Exact, only coarser.
    """

    cluster, cluster_le = by.keeping(), by.keeping("le")

    def shared_bounds(name: str) -> str:
        buckets = f"sum by ({by.instance}, le) (rate({name}[{WINDOW}]))"
        instances = f"count by ({cluster}) (count by ({by.instance}) ({buckets}))"
        everywhere = f"count by ({cluster_le}) ({buckets}) == on({cluster}) group_left() {instances}"
        shared = f"sum by ({cluster_le}) ({buckets} and on({cluster_le}) ({everywhere}))"
        return f'label_replace({shared}, "engine", "{name.split(":")[0]}", "", "")'

    return "\n  or ".join(map(shared_bounds, TTFT_BUCKETS))


def _cached_by_source(instance: str) -> str:
    """Each instance's cached-token rate per source, from its engine's finest split only."""

    def by_source(selector: str, label: str, regex: str) -> str:
        rate = f"rate({selector}[{WINDOW}])"
        if label != "source":
            rate = f'label_replace({rate}, "source", "$1", "{label}", "{regex}")'
        return f"sum by ({instance}, source) ({rate})"

    return f"\n  or on({instance}) ".join(by_source(*split) for split in CACHED_BY_SOURCE)


def recording_rules(by: Grouping) -> tuple[Rule, ...]:
    instance, cluster, requests = by.instance, by.keeping(), INSTANCE_REQUESTS
    return (
        *DELIVERED.rules(by),
        *LOCAL.rules(by),
        *LMCACHE.rules(by),
        Rule(INSTANCE_CACHED_BY_SOURCE, _cached_by_source(instance)),
        *(
            Rule(INSTANCE_TTFT, f"histogram_quantile({q}, {_ttft_buckets(instance)})", {"quantile": q})
            for q in QUANTILES
        ),
        *(
            Rule(ENGINE_TTFT, f"histogram_quantile({q}, {_engine_ttft_buckets(by)})", {"quantile": q})
            for q in QUANTILES
        ),
        Rule(requests, _first_of(*FINISHED_REQUESTS, by=instance)),
        Rule(
            INSTANCE_REQUEST_SHARE,
            f"{requests}\n  / on({cluster}) group_left() (sum by ({cluster}) ({requests}) > 0)",
        ),
        Rule(
            CLUSTER_LOAD_IMBALANCE,
            f"max by ({cluster}) ({requests}) / (avg by ({cluster}) ({requests}) > 0)",
        ),
        Rule(
            INSTANCE_CACHE_SERIES,
            f"group by ({instance}, series) ("
            + 'label_replace({__name__=~"'
            + "|".join(ENGINE_CACHE_SERIES)
            + '"}, "series", "$1", "__name__", "(.+)"))',
        ),
    )


RECORDING_RULES = recording_rules(Grouping())


# Real users' sessions, from the gateway access logs (collectors/gatewaylogs/follower.py): of the
# sessions that came back within the spread window, the share served by more than one upstream, by whether
# a failover moved them.
def gateway_rules(by: Grouping) -> tuple[Rule, ...]:
    listener = by.listener
    return (
        Rule(
            GATEWAY_SPREAD_SHARE,
            f"sum by ({listener}, failover) (kvwatch_gateway_session_spread_sessions)\n"
            f"  / on({listener}) group_left()\n"
            f"  (sum by ({listener}) (kvwatch_gateway_returning_sessions) > 0)",
        ),
    )


GATEWAY_RULES = gateway_rules(Grouping())

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


def _share_of(part: str, rest: str, instance: str) -> str:
    """Per instance, the rate of `part` over that of `part` and `rest` together. Routers create a counter
    on its first event, so a missing side counts 0; without traffic on either there is no sample."""
    part_rate, rest_rate = _first_of(part, by=instance), _first_of(rest, by=instance)
    part_or_0 = f"({part_rate}\n  or 0 * {rest_rate})"
    return f"{part_or_0}\n  / ({part_or_0}\n  + ({rest_rate}\n  or 0 * {part_rate}) > 0)"


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


def router_rules(by: Grouping) -> tuple[Rule, ...]:
    instance = by.instance
    predictions, predicted_sums = (
        _first_of(*(f"{name}_{part}" for name in ROUTER_PREDICTED_HIT_RATIOS), by=instance)
        for part in ("count", "sum")
    )
    return (
        Rule(
            INSTANCE_ROUTER_PIN_KEPT,
            _share_of(
                f'{SMG_BRANCHES}{{branch="occupied_hit"}}',
                f'{SMG_BRANCHES}{{branch="occupied_miss"}}',
                instance,
            ),
        ),
        Rule(
            INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS,
            "\nor ".join(_share_of(*pair, instance) for pair in PREFIX_MATCH_DECISIONS),
        ),
        Rule(INSTANCE_ROUTER_PREDICTIONS, predictions),
        Rule(
            INSTANCE_ROUTER_PREDICTED_HIT_RATIO,
            f"({predicted_sums})\n  / ({INSTANCE_ROUTER_PREDICTIONS} > 0)",
        ),
        Rule(
            INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
            f"{CLUSTER_HIT_RATIO}\n  / on({by.keeping()}) group_right()"
            f" ({INSTANCE_ROUTER_PREDICTED_HIT_RATIO} > 0)",
        ),
    )


ROUTER_RULES = router_rules(Grouping())
# The rules that rate over the fixed WINDOW: a panel reading one does not follow the time range.
WINDOWED_RULES = (*RECORDING_RULES, *ROUTER_RULES)


# --- Alerts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thresholds:
    """Every alert threshold, in one place. Durations are for production scrape / evaluation intervals
    of 15 s and a probe interval of 30 s; the lab's --fast mode runs the same rules scaled by 1/10."""

    sticky_ratio_below: float = 0.5  # share of a probe run's sessions that stayed on one replica
    echo_ratio_below: float = 0.5  # share of a probe run's sessions whose id the gateway echoed
    keyless_share_above: float = 0.5  # share of gateway requests that arrived without a session key
    keyless_rise_factor: float = 2.0  # ... and at least this many times the share an hour earlier
    spread_share_above: float = 0.5  # share of returning real sessions moved without a failover
    min_returning_sessions: int = 5  # traffic guard of the spread alert
    warm_cold_ratio_above: float = 0.8  # warm-round TTFT over round-1 TTFT on a sticky route
    hit_ratio_floor: float = 0.1
    hit_ratio_drop_factor: float = 0.5  # below half of its own average over the previous hour
    min_prompt_tokens_per_second: float = 50.0  # traffic guard of the hit-ratio alerts
    router_predicted_above: float = 0.5  # a router's mean predicted hit ratio
    delivered_per_predicted_below: float = 0.5  # ... of which the engines deliver less than this share
    min_router_predictions_per_second: float = 0.1  # traffic guard of the prediction alert
    probe_stale_intervals: float = 3.0
    load_imbalance_above: float = 2.0  # busiest instance over the mean


THRESHOLDS = Thresholds()
RUNBOOK = "alerts/runbook.md"  # in the repository
# Where the alerts, the boards and the dashboard link the runbook: a page that opens from Slack, PagerDuty,
# Alertmanager and Grafana, which a repository path does not. `make generate RUNBOOK_URL=...` and the
# config's dashboard.runbook_url move it (to a wiki, an internal mirror).
RUNBOOK_URL = f"https://github.com/kvwatch/kvwatch/blob/main/{RUNBOOK}"


def _watched_routes(by: Grouping) -> str:
    """Routes whose sessions must stay on one replica (the config's expect_sticky, exported by kvwatch
    serve): the affinity alerts watch only these."""
    return f'on({by.keeping("target")}) kvwatch_probe_route_info{{expect_sticky="true"}}'


def _watched_listeners(by: Grouping) -> str:
    """Gateway logs whose sessions must stay on one replica."""
    return f'on({by.keeping("log")}) kvwatch_gateway_log_info{{expect_sticky="true"}}'


def _per_route(aggregation: str, metric: str, by: Grouping = WHOLE) -> str:
    """A probe gauge per route, without the exporter's `job` and `instance`: the alert is about the route."""
    return f"{aggregation} by ({by.route}) ({metric})"


# What the alerts judge, one series per route, listener or the cluster: the alerts compare these with
# their thresholds, and the pages and boards show them beside the alerts' verdicts.
def _sticky_ratio(by: Grouping) -> str:
    return _per_route("min", "kvwatch_probe_sticky_ratio", by)  # the last probe run's


def _warm_cold_ratio(by: Grouping) -> str:
    return _per_route("max", "kvwatch_probe_warm_cold_ttft_ratio", by)  # the last probe run's


def _gateway_spread(by: Grouping) -> str:
    return f'max by ({by.listener}) ({GATEWAY_SPREAD_SHARE}{{failover="false"}})'


def _replica_ids(by: Grouping) -> str:
    """The replica id of each scraped instance, from a `replica` target label (the lab's scrape config sets
    one; set one in yours): the pages and the alerts name a replica by id and address together."""
    return f'group by ({by.keeping("instance, replica")}) (up{{replica!=""}})'


def _instance_name(by: Grouping) -> str:
    """An alert description's name for the instance it is about, as the pages give it: `r2 (127.0.0.1:20812)`
    where the replica ids know the instance's id (a template query at notification time), else its address.
    The instance is looked up in its own cluster: "" matches a Prometheus without the label."""
    labels = by.keeping("instance").split(", ")
    matchers = ", ".join(f"{label}=%q" for label in labels)
    values = " ".join(f"$labels.{label}" for label in labels)
    lookup = f"{_replica_ids(by)} and on({by.keeping('instance')}) up{{{matchers}}}"
    return (
        "{{ $name := $labels.instance }}"
        f"{{{{ range printf `{lookup}` {values} | query }}}}"
        '{{ $name = printf "%s (%s)" .Labels.replica $labels.instance }}{{ end }}{{ $name }}'
    )


WATCHED_ROUTES, WATCHED_LISTENERS = _watched_routes(WHOLE), _watched_listeners(WHOLE)
STICKY_RATIO, WARM_COLD_RATIO = _sticky_ratio(WHOLE), _warm_cold_ratio(WHOLE)
GATEWAY_SPREAD = _gateway_spread(WHOLE)
REPLICA_IDS = _replica_ids(WHOLE)


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


def alerts(t: Thresholds, by: Grouping) -> tuple[Alert, ...]:
    def baseline(ratio: str) -> str:
        """The ratio's own average over the hour before the last 10 minutes."""
        return f"avg_over_time({ratio}[1h] offset 10m)"

    def probe_errors(auth_match: str) -> str:
        selector = f'kind{auth_match}"unauthorized|forbidden"'
        return f"sum by ({by.route}, kind) (increase(kvwatch_probe_errors_total{{{selector}}}[3m]))"

    instance, cluster, name = by.instance, by.keeping(), _instance_name(by)
    keyless_share = (
        f"sum by ({by.listener}) (rate(kvwatch_gateway_requests_without_session_key_total[5m]))\n"
        f"  / (sum by ({by.listener}) (rate(kvwatch_gateway_requests_total[5m])) > 0)"
    )
    keyless_share_an_hour_ago = keyless_share.replace("[5m]", "[5m] offset 1h")
    # A minute of prompt tokens without a single lookup: prefix caching is off (a restart gives no lookups
    # to the window from the moment the samples before it are a minute old).
    prompt_rate = _first_of("vllm:prompt_tokens_total", by=instance, window="1m")
    lookup_rate = _first_of(
        "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total", by=instance, window="1m"
    )
    cluster_prompt_tokens = f"sum by ({cluster}) ({INSTANCE_PROMPT_TOKENS})"
    engines = '{__name__=~"' + "|".join(ENGINE_PRESENCE_SERIES) + '"}'
    judged = (
        Alert(
            "KVWatchSessionAffinityBroken",
            f"{_sticky_ratio(by)} < {t.sticky_ratio_below}\nand {_watched_routes(by)}",
            "critical",
            "Probe sessions through a sticky route change replica between rounds.",
            "Only {{ $value | humanizePercentage }} of the last probe run's sessions through "
            "{{ $labels.target }} stayed on one replica: the gateway no longer pins sessions, so rounds 2+ "
            "pay a full prefill.",
            keep_firing_for="2m",
        ),
        Alert(
            "KVWatchSessionIdNotPropagated",
            f"{_per_route('min', 'kvwatch_probe_session_id_echo_ratio', by)} < {t.echo_ratio_below}",
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
            f"{_gateway_spread(by)} > {t.spread_share_above}\n"
            f"and on({by.listener}) sum by ({by.listener}) (kvwatch_gateway_returning_sessions)"
            f" >= {t.min_returning_sessions}\n"
            f"and {_watched_listeners(by)}",
            "critical",
            "Real sessions through a sticky gateway listener are served by several replicas.",
            "{{ $value | humanizePercentage }} of the sessions that came back to {{ $labels.log }} / "
            "{{ $labels.listener }} within the spread window were served by more than one replica, with no "
            "failover to explain it: the gateway no longer pins sessions to the replica holding their cache.",
            for_="1m",
        ),
        Alert(
            "KVWatchPrefixCacheHitRateDrop",
            f"({CLUSTER_HIT_RATIO} < {t.hit_ratio_drop_factor} * {baseline(CLUSTER_HIT_RATIO)}\n"
            f"  or {CLUSTER_HIT_RATIO} < {t.hit_ratio_floor})\n"
            f"and on({cluster}) {cluster_prompt_tokens} > {t.min_prompt_tokens_per_second}",
            "warning",
            "The cluster's prefix-cache hit ratio dropped.",
            "The cluster serves only {{ $value | humanizePercentage }} of its prompt tokens from cached KV, "
            "well below its own average of the previous hour or under the floor.",
            for_="5m",
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
            for_="5m",
            labels={"scope": "instance"},
        ),
        Alert(
            "KVWatchWarmRoundNoGain",
            f"{_warm_cold_ratio(by)} > {t.warm_cold_ratio_above}\nand {_watched_routes(by)}",
            "warning",
            "Warm rounds are not faster than the first round on a sticky route.",
            "Through {{ $labels.target }}, rounds 2+ take {{ $value | humanizePercentage }} of round 1's "
            "time to first token: their history is not reused.",
            for_="2m",
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
            f"group by ({instance}) ({engines})\nunless on({instance}) {INSTANCE_CACHE_SERIES}",
            "warning",
            "An engine exports none of the prefix-cache series kvwatch reads.",
            f"{name} ({{{{ $labels.job }}}}) is a vLLM or SGLang engine but exports none of the "
            "prefix-cache series kvwatch reads: a renamed metric, or a pipeline that rewrote ':' to '_', "
            "would make the hit-ratio panels empty.",
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
            f"time() - {_per_route('max', 'kvwatch_probe_last_run_timestamp_seconds', by)}\n"
            f"  > {t.probe_stale_intervals} * {_per_route('max', 'kvwatch_probe_interval_seconds', by)}",
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
            f"{{{{ $labels.job }}}} / {name} has not answered Prometheus's scrapes.",
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
            for_="5m",
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
    return tuple(dataclasses.replace(alert, cluster=by.cluster) for alert in judged)


ALERTS = alerts(THRESHOLDS, Grouping())


def rule_files(cluster_label: str = CLUSTER_LABEL) -> dict[str, tuple[str, tuple[Rule | Alert, ...]]]:
    """Repository path -> (group, rules) of every rule file, aggregating by `cluster_label`: the committed
    files use the default, `generate --cluster-label` writes them for another."""
    by = Grouping(cluster_label)
    return {
        "prometheus/rules/kvwatch-engines.yml": ("kvwatch-engines", recording_rules(by)),
        "prometheus/rules/kvwatch-gateway.yml": ("kvwatch-gateway", gateway_rules(by)),
        "prometheus/rules/kvwatch-routers.yml": ("kvwatch-routers", router_rules(by)),
        "alerts/kvwatch.rules.yml": ("kvwatch-alerts", alerts(THRESHOLDS, by)),
    }


RULE_FILES = rule_files()


# --- Verdicts -------------------------------------------------------------------------------------
# What the Streamlit pages and the Grafana boards say of a route, a gateway listener or the cluster is
# the state of the alert that watches it, computed from the alert's own expression: a page is red
# exactly when the alert fires, never by a threshold of its own.

OK, PENDING, FIRING = 0, 1, 2


@dataclass(frozen=True)
class Verdict:
    """What the alert watching `signal` says of each thing it judges, as one query for every page."""

    alert: Alert
    signal: str  # what the alert compares with its threshold, one series per `by`
    by: str  # the labels naming what is judged; "" for the cluster
    watched: str | None = None  # the `and` filter keeping only what the alert watches

    def alerts(self, alertstate: str) -> str:
        """The alert's own series in Prometheus in that state (firing also while `keep_firing_for`
        holds it): the page reads the rule's evaluation instead of repeating its expression, so it
        agrees with the alert under any rule windows (the lab scales them)."""
        labels = {"alertname": self.alert.name, "alertstate": alertstate, **(self.alert.labels or {})}
        return "ALERTS{" + ", ".join(f'{name}="{value}"' for name, value in labels.items()) + "}"

    @property
    def state(self) -> str:
        """FIRING while the alert fires; PENDING while its condition holds for less than its `for`; OK
        where it judges the signal and finds nothing wrong; no sample where it has nothing to judge."""
        group = f"group by ({self.by})"  # by () for the cluster, so that the boards can add their label
        judged = f"{self.signal}\nand {self.watched}" if self.watched else self.signal
        return (
            f"{FIRING} * {group} ({self.alerts('firing')})\n"
            f"or {PENDING} * {group} ({self.alerts('pending')})\n"
            f"or {OK} * {group} ({judged})"
        )


def _alert(name: str, **labels: str) -> Alert:
    """The alert of that name, and of those labels where one name has several rules."""
    (found,) = (a for a in ALERTS if a.name == name and labels.items() <= (a.labels or {}).items())
    return found


ROUTE_STICKY = Verdict(_alert("KVWatchSessionAffinityBroken"), STICKY_RATIO, ROUTE, WATCHED_ROUTES)
ROUTE_WARM_ROUNDS = Verdict(_alert("KVWatchWarmRoundNoGain"), WARM_COLD_RATIO, ROUTE, WATCHED_ROUTES)
LISTENER_SPREAD = Verdict(_alert("KVWatchGatewaySessionsSpread"), GATEWAY_SPREAD, LISTENER, WATCHED_LISTENERS)
CLUSTER_HIT_RATIO_DROP = Verdict(
    _alert("KVWatchPrefixCacheHitRateDrop", scope="cluster"), CLUSTER_HIT_RATIO, ""
)
INSTANCE_HIT_RATIO_DROP = Verdict(
    _alert("KVWatchPrefixCacheHitRateDrop", scope="instance"), INSTANCE_HIT_RATIO, INSTANCE
)
LOAD_IMBALANCE = Verdict(_alert("KVWatchReplicaLoadImbalance"), CLUSTER_LOAD_IMBALANCE, "")
ROUTER_PREDICTION_MISS = Verdict(
    _alert("KVWatchRouterPredictionMiss"), INSTANCE_ROUTER_DELIVERED_PER_PREDICTED, INSTANCE
)
VERDICTS = (
    ROUTE_STICKY,
    ROUTE_WARM_ROUNDS,
    LISTENER_SPREAD,
    CLUSTER_HIT_RATIO_DROP,
    INSTANCE_HIT_RATIO_DROP,
    LOAD_IMBALANCE,
    ROUTER_PREDICTION_MISS,
)


# --- Dashboard queries ----------------------------------------------------------------------------
# One expression per panel, shared by the Grafana boards (grafana/boards.py) and the Streamlit app.
# They use Grafana's variables: `$job`, `$instance` and `$target` are label regexes, `$__rate_interval`
# is the rate window and `$__range` the whole time range; outside Grafana, `fill_variables()` sets them.
# Panels on recording rules keep the rules' fixed WINDOW; probe panels rate kvwatch_probe_* counters.

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
WARM_COLD_TTFT_RATIO = _per_route("max", f"kvwatch_probe_warm_cold_ttft_ratio{{{PROBE_SELECTOR}}}")
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
FIRING_ALERTS_NOW = 'ALERTS{alertstate="firing", alertname=~"KVWatch.+"}'
FIRING_ALERTS_BY_NAME = f"count by (alertname, severity) ({FIRING_ALERTS_NOW})"
REAL_SESSIONS_SPREAD = GATEWAY_SPREAD_SHARE  # by log, listener and failover


# --- Streamlit queries ----------------------------------------------------------------------------
# What the Streamlit app (dashboard/app_pages/) shows besides the dashboard queries above.

# Each source's share of the cluster's prompt tokens.
CLUSTER_CACHED_SHARE_BY_SOURCE = (
    f"sum by (source) ({INSTANCE_CACHED_BY_SOURCE})\n"
    f"  / on() group_left() (sum({INSTANCE_PROMPT_TOKENS}) > 0)"
)
PREFIX_CACHING_CONFIG = "max by (job, instance, enable_prefix_caching) (vllm:cache_config_info)"
