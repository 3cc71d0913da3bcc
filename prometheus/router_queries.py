"""PromQL of routers and KV caches that continues prometheus/queries.py where that module's size stops
it (its conventions hold here): AIBrix's counters of how its prefix-cache router chose, and LMCache's
hit tiers per instance. Each string is here once; rules.py records them, the boards and pages read them.
"""

from __future__ import annotations

from kvwatch.prometheus.queries import (
    ENGINE_SELECTOR,
    INSTANCE,
    INSTANCE_LMCACHE_HITS_BY_TIER,
    LMCACHE,
    WINDOW,
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

# Each LMCache tier's share of the tokens asked of that LMCache (L1: its CPU memory; L2: disk or a remote
# store), per instance: beside the engines' split by source. The engines' job and instance filters pick
# LMCache's multi-process server, a target of its own, as any other.
LMCACHE_HIT_SHARE_BY_TIER = (
    f"{INSTANCE_LMCACHE_HITS_BY_TIER}{{{ENGINE_SELECTOR}}}\n"
    f"  / on({INSTANCE}) group_left() ({LMCACHE.instance_total}{{{ENGINE_SELECTOR}}} > 0)"
)
