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

RULE_FILES = {"prometheus/rules/kvwatch-engines.yml": ("kvwatch-engines", RECORDING_RULES)}
