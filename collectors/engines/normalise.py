"""From snapshots to the engine-agnostic record kvwatch reports: lifetime from one, windowed from two."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvwatch.collectors.engines.base import Buckets, Snapshot
from kvwatch.collectors.engines.router_state import (
    IndexHealth,
    SessionTable,
    windowed,
)

# hit_ratio_source of the token-weighted ratios of counter increases: cached prompt tokens over prompt
# tokens (what the engine delivered, 0 % with caching off), or, without token counters, prefix-cache
# hits over lookups (the local cache's own view, which an engine with caching off does not count at all).
TOKENS = "tokens"
LOOKUPS = "lookups"


@dataclass(frozen=True)
class Normalised:
    """What one source says about cache reuse and load, over its lifetime or over a window.

    `window_seconds` is None for lifetime figures (cumulative since the process started); otherwise
    counters are increases between two scrapes. A counter that went down means the process restarted:
    it counts from zero, as PromQL's increase() does, and `counter_reset` says so. A ratio or quantile
    with no traffic under it is None, never 0 or NaN, and so is every figure of an `invalid` series
    (named with its first bad value: NaN, an infinity, a negative count). `hit_ratio_source` says where
    the ratio came from: "tokens" (cached / prompt tokens), "lookups" (hits / lookups, when there are no
    token counters), or an engine-computed gauge ("v0-gauge", "sglang-batch-gauge-fallback") that covers
    a window the engine chose, not this one. `local_hit_ratio` is hits / lookups beside it (`local_hits`,
    `local_lookups`: prefix-cache tokens found and looked up), None when nothing was looked up or either
    count is unknown. More cached than prompt tokens is no measurement: the ratio is unknown.
    Router cache predictions and `predicted_hit_ratio` (the mean of the router's per-request predicted
    hit ratios) are the router's guess of where a prefix is cached, not what any engine found; a router
    that forwards the engines' usage also has a delivered `hit_ratio`, as its clients saw it.
    """

    flavour: str
    window_seconds: float | None
    hit_ratio: float | None
    hit_ratio_source: str | None
    local_hit_ratio: float | None
    local_hits: float | None
    local_lookups: float | None
    prompt_tokens: float | None
    cached_tokens: float | None
    ttft_p50_seconds: float | None
    ttft_p90_seconds: float | None
    ttft_p99_seconds: float | None
    requests_running: float | None
    requests_waiting: float | None
    kv_cache_usage: float | None
    prefix_caching_enabled: bool | None
    missing: tuple[str, ...]
    invalid: Mapping[str, str] = field(default_factory=dict)
    per_worker: Mapping[str, float] = field(default_factory=dict)
    policy_decisions: Mapping[str, float] = field(default_factory=dict)
    router_cache_predictions: Mapping[str, float] = field(default_factory=dict)
    predicted_hit_ratio: float | None = None
    # The reuse decomposition's shares of the router's prompt tokens (token-weighted): the most any replica
    # held (available), what the chosen one held (routed), what the engines reused (delivered).
    available_share: float | None = None
    routed_share: float | None = None
    delivered_share: float | None = None
    sticky_outcomes: Mapping[str, float] = field(default_factory=dict)
    routing_key_sources: Mapping[str, float] = field(default_factory=dict)
    session_table: SessionTable | None = None  # a router's session table: bindings now, counters' increases
    index_health: IndexHealth | None = (
        None  # a router's KV-event index: lag now, gaps' and resyncs' increases
    )
    router_fallbacks: Mapping[str, float] = field(default_factory=dict)
    cache_tiers: Mapping[str, float] = field(default_factory=dict)
    counter_reset: bool = False


def normalise(now: Snapshot, before: Snapshot | None = None) -> Normalised:
    """Lifetime figures from `now` alone, or the window between `before` and `now` (same source)."""
    if before is not None and before.flavour != now.flavour:
        raise ValueError(f"cannot window a {before.flavour} snapshot against a {now.flavour} one")
    change = _Change(before)
    prompt_tokens = change.counter("prompt_tokens", now.prompt_tokens)
    cached_tokens = change.counter("cached_tokens", now.cached_tokens)
    hits, queries = change.counter("hits", now.hits), change.counter("queries", now.queries)
    local = _ratio(hits, queries)
    ratio, source = None, None
    if prompt_tokens is not None and cached_tokens is not None:
        ratio, source = _ratio(cached_tokens, prompt_tokens), TOKENS
    elif hits is not None and queries is not None:
        ratio, source = local, LOOKUPS
    elif now.hit_ratio_gauge is not None:
        value = now.hit_ratio_gauge.value
        # vLLM V0 says -1 when it has no data: unknown, not a 0 % hit ratio. A window without prompt
        # tokens has no traffic under the gauge, whatever it still shows.
        idle = before is not None and prompt_tokens == 0
        ratio, source = (value if value >= 0 and not idle else None), now.hit_ratio_gauge.source
    predicted = _ratio(
        change.counter("predicted_ratio_sum", now.predicted_ratio_sum),
        change.counter("predictions", now.predictions),
    )
    routed_prompt = change.counter("routed_prompt_tokens", now.routed_prompt_tokens)
    reused = change.counter("reused_tokens", now.reused_tokens)
    delivered = ratio if source == TOKENS else None
    if now.reused_tokens is not None:
        delivered = _ratio(reused, routed_prompt)
    ttft = change.histogram(now.ttft_buckets)
    p50, p90, p99 = (histogram_quantile(q, ttft) for q in (0.5, 0.9, 0.99))
    return Normalised(
        flavour=now.flavour,
        window_seconds=None if before is None else now.scraped_at - before.scraped_at,
        hit_ratio=ratio,
        hit_ratio_source=source,
        local_hit_ratio=local,
        local_hits=hits,
        local_lookups=queries,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        ttft_p50_seconds=p50,
        ttft_p90_seconds=p90,
        ttft_p99_seconds=p99,
        requests_running=now.requests_running,
        requests_waiting=now.requests_waiting,
        kv_cache_usage=now.kv_cache_usage,
        prefix_caching_enabled=now.prefix_caching_enabled,
        missing=now.missing,
        invalid={**(before.invalid if before else {}), **now.invalid},
        per_worker=change.counters("per_worker", now.per_worker),
        policy_decisions=change.counters("policy_decisions", now.policy_decisions),
        router_cache_predictions=change.counters("router_cache_predictions", now.router_cache_predictions),
        predicted_hit_ratio=predicted,
        available_share=_ratio(change.counter("available_tokens", now.available_tokens), routed_prompt),
        routed_share=_ratio(change.counter("routed_tokens", now.routed_tokens), routed_prompt),
        delivered_share=delivered if routed_prompt is not None else None,
        sticky_outcomes=change.counters("sticky_outcomes", now.sticky_outcomes),
        routing_key_sources=change.counters("routing_key_sources", now.routing_key_sources),
        session_table=windowed(now.session_table, before and before.session_table, change.increase),
        index_health=windowed(now.index_health, before and before.index_health, change.increase),
        router_fallbacks=change.counters("router_fallbacks", now.router_fallbacks),
        cache_tiers=change.counters("cache_tiers", now.cache_tiers),
        counter_reset=change.reset,
    )


def _ratio(part: float | None, whole: float | None) -> float | None:
    """part / whole of token counts: unknown without traffic, and when the part exceeds the whole."""
    if part is None or whole is None or whole <= 0 or part > whole:
        return None
    return part / whole


def histogram_quantile(q: float, buckets: Buckets | None) -> float | None:
    """The q-quantile of cumulative buckets, interpolated linearly inside a bucket as PromQL does.

    Ranks that fall in the +Inf bucket give the highest finite bound; no observations give None.
    """
    if not buckets or len(buckets) < 2 or buckets[-1][0] != math.inf or buckets[-1][1] <= 0:
        return None
    bounds = [bound for bound, _ in buckets]
    counts = [count for _, count in buckets]
    for i in range(1, len(counts)):  # as PromQL does, repair buckets a partial reset left non-monotonic
        counts[i] = max(counts[i], counts[i - 1])
    rank = q * counts[-1]
    i = next(i for i, count in enumerate(counts) if count >= rank)
    if bounds[i] == math.inf:
        return bounds[-2]
    lower, below = (0.0, 0.0) if i == 0 else (bounds[i - 1], counts[i - 1])
    if i == 0 and bounds[0] <= 0:
        return bounds[0]
    return lower + (bounds[i] - lower) * (rank - below) / (counts[i] - below)


class _Change:
    """Counter values for a record: as they are (lifetime), or their increase since `before`."""

    def __init__(self, before: Snapshot | None) -> None:
        self.before = before
        self.reset = False
        # A series absent at the window's start may have been an invalid one: its increase is unknown.
        self.unknown_start = before is not None and bool(before.invalid)

    def counter(self, name: str, now: float | None) -> float | None:
        old = None if self.before is None else getattr(self.before, name)
        return self._increase(now, old)

    def counters(self, name: str, now: Mapping[str, float]) -> dict[str, float]:
        old = {} if self.before is None else getattr(self.before, name)
        increases = {key: self._increase(value, old.get(key)) for key, value in now.items()}
        return {key: increase for key, increase in increases.items() if increase is not None}

    def histogram(self, now: Buckets | None) -> Buckets | None:
        old = None if self.before is None else self.before.ttft_buckets
        if now is None or not old:
            return None if self.unknown_start else now
        if [bound for bound, _ in old] != [bound for bound, _ in now] or now[-1][1] < old[-1][1]:
            self.reset = True  # restarted, possibly with other buckets: everything is new
            return now
        return tuple(
            (bound, self._increase(count, was)) for (bound, count), (_, was) in zip(now, old, strict=True)
        )

    def increase(self, now: float | None, old: float | None) -> float | None:
        """One counter's value (lifetime) or increase (window); None when unknown."""
        return self._increase(now, old)

    def _increase(self, now: float | None, old: float | None) -> float | None:
        if now is None or old is None:  # lifetime, or a series that appeared within the window
            return None if self.unknown_start else now
        if now < old:
            self.reset = True
            return now
        return now - old
