"""LMCache's multi-process server: its own /metrics, apart from the engine's.

In multi-process mode LMCache runs as a cache daemon the engines ask for KV (vLLM's LMCacheMPConnector)
and exports `lmcache_mp_*` names over OpenTelemetry, not the in-process `lmcache:` ones: tokens asked of
it (`lookup_requested_tokens_total`) and found in L1 (CPU memory) or L2 (disk, a remote store)
(`lookup_hit_tokens_total`), both chunk-aligned and counted per finished lookup, and per tier
(`lookup_hit_l1_tokens_total`, `..._l2_...`, LMCache PR #4962). Its hits are what the engine could load
instead of computing; the engine's own prefix cache (L0) is not in them.
"""

from __future__ import annotations

from kvwatch.collectors.engines.base import Exposition, Flavour, Reader, Snapshot

PREFIX = "lmcache_mp_lookup_"
TIERS = ("l1", "l2")


def detect(exposition: Exposition) -> int:
    return exposition.count_prefixed("lmcache_mp_")


def read(exposition: Exposition, scraped_at: float) -> Snapshot:
    reader = Reader(exposition)
    tiers = {tier: reader.total(f"{PREFIX}hit_{tier}_tokens_total", optional=True) for tier in TIERS}
    return Snapshot(
        flavour="lmcache-mp",
        scraped_at=scraped_at,
        hits=reader.total(f"{PREFIX}hit_tokens_total"),
        queries=reader.total(f"{PREFIX}requested_tokens_total"),
        cache_tiers={tier: count for tier, count in tiers.items() if count is not None},
        missing=tuple(reader.missing),
        invalid=dict(reader.invalid),
    )


FLAVOUR = Flavour(name="lmcache-mp", kind="cache", detect=detect, read=read)
