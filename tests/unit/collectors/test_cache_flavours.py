"""LMCache's multi-process server and AIBrix's newer prefix-cache counters, from recorded expositions whose
headers say where their names come from (tests/testdata/caches, tests/testdata/routers)."""

from __future__ import annotations

from kvwatch.collectors.engines import Exposition, detect_flavour, normalise
from kvwatch.collectors.engines.base import Snapshot
from kvwatch.collectors.engines.scrape import Result, format_result
from paths import TESTDATA

LMCACHE = TESTDATA / "caches" / "lmcache-mp-server.prom"
AIBRIX = TESTDATA / "routers" / "aibrix-gateway-0.7-fallbacks.prom"


def read(text: str, scraped_at: float = 0.0) -> Snapshot:
    exposition = Exposition(text)
    return detect_flavour(exposition).read(exposition, scraped_at)


def shown(snapshot: Snapshot, before: Snapshot | None = None) -> str:
    return format_result(Result("http://cache:9090/metrics", normalise(snapshot, before)))


def test_lmcache_mp_server_lookups_and_their_tiers():
    """Summed over models and cache salts: 4,096 tokens asked, 3,072 found, 2,560 in L1 and 512 in L2."""
    snapshot = read(LMCACHE.read_text())
    assert snapshot.flavour == "lmcache-mp"
    assert (snapshot.queries, snapshot.hits) == (4096, 3072)
    assert snapshot.cache_tiers == {"l1": 2560, "l2": 512}
    assert snapshot.missing == ()
    text = shown(snapshot)
    assert "lookup hit ratio     75.0%" in text
    assert "tokens               4,096 asked, 3,072 found" in text
    assert "found by tier        l1 62.5%, l2 12.5%" in text


def test_lmcache_mp_tiers_over_a_window_and_without_the_split():
    """Two scrapes give the window's figures; a server before the per-tier split shows no tier line."""
    before = read(LMCACHE.read_text(), scraped_at=0.0)
    later = LMCACHE.read_text().replace(" 3584\n", " 4608\n").replace(" 2304\n", " 3072\n")
    later = later.replace(" 2816\n", " 3584\n")
    record = normalise(read(later, scraped_at=30.0), before)
    assert (record.local_lookups, record.local_hits, record.cache_tiers) == (1024, 768, {"l1": 768, "l2": 0})
    untiered = "".join(line for line in LMCACHE.read_text().splitlines(True) if "_hit_l" not in line)
    snapshot = read(untiered)
    assert snapshot.cache_tiers == {} and "found by tier" not in shown(snapshot)


def test_aibrix_decisions_taken_without_its_prefix_index():
    snapshot = read(AIBRIX.read_text())
    assert snapshot.flavour == "aibrix-gateway"
    record = normalise(snapshot)
    assert record.policy_decisions == {"prefix_match": 12, "least_request_fallback": 8}
    fallbacks = {"error:tokenize_failed": 2, "error:no_target_pod": 1, "load_imbalance": 5}
    assert record.router_fallbacks == fallbacks
    said = "without its index    error:no_target_pod 1, error:tokenize_failed 2, load_imbalance 5"
    assert said in shown(snapshot)


def test_aibrix_without_the_newer_counters_has_no_fallbacks():
    older = (TESTDATA / "routers" / "aibrix-gateway-0.7.prom").read_text()
    record = normalise(read(older))
    assert record.router_fallbacks == {} and "without its index" not in shown(read(older))
