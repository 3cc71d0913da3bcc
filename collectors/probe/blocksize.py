"""The engine's KV block size, learned rather than assumed, with where it came from; and a round's ideal
cached tokens, counted in its whole blocks.

A probe round's ideal cached tokens (what a replica holding the conversation would reuse) count whole
KV blocks, so a wrong block size makes cached / ideal wrong: vLLM uses 16-token blocks on GPUs and 128
on CPUs, SGLang's radix cache is token-granular by default. The first source that knows wins:

1. an explicit setting (`--block-size`, a target's `block_size` in the config);
2. `vllm:cache_config_info{block_size}` in Prometheus, else in an engine's /metrics (a gateway's
   origin + /metrics usually reaches one engine);
3. the granularity of the cached_tokens the engine reported in the sessions just run: their GCD;
4. the default of 16 tokens.

Where several engines report different sizes, the smallest is used and the source says so: the ideal
is then never below what any of them could reuse, so efficiency is never overstated. Looking never
raises: a source that fails or does not answer in time is just not available.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import httpx

from kvwatch.collectors.engines import Exposition
from kvwatch.collectors.engines.base import Reader
from kvwatch.collectors.engines.scrape import DEFAULT_MAX_BYTES, ScrapeError, fetch
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.core.connections import http_client
from kvwatch.core.errors import UpstreamError
from kvwatch.core.redaction import redact

DEFAULT_TOKENS = 16  # vLLM's default on GPUs
MAX_TOKENS = 1 << 20  # far above any engine's block; a larger number is a typo
TIMEOUT_S = 3.0  # per source: learning the block must not hold up the probe's report
SERIES = "vllm:cache_config_info"
PROMETHEUS_QUERY = f"count by (block_size) ({SERIES})"  # one series per distinct block size


def problem(tokens: int) -> str | None:
    """What is wrong with `tokens` as a block size, or None: the one check of options and config."""
    if tokens < 1:
        return f"must be >= 1, got {tokens}"
    if tokens > MAX_TOKENS:
        return f"must be <= {MAX_TOKENS} (1 << 20), got {tokens}"
    return None


@dataclass(frozen=True)
class BlockSize:
    """A KV block size in tokens and where it came from, e.g. "vllm:cache_config_info at URL"."""

    tokens: int
    source: str

    def __post_init__(self) -> None:
        if wrong := problem(self.tokens):
            raise ValueError(f"block size {wrong}")

    def describe(self) -> str:
        """What every report prints: the block its ideal cached tokens were aligned to, and why."""
        return f"KV block: {self.tokens} tokens ({self.source})"

    def as_json(self) -> dict:
        return {"tokens": self.tokens, "source": self.source}


@dataclass(frozen=True)
class BlockSizeSources:
    """Where to look, in order; the granularity of the sessions and the default come after these."""

    override: BlockSize | None = None
    prometheus_url: str | None = None
    metrics_urls: tuple[str, ...] = ()
    prometheus_query: str = PROMETHEUS_QUERY  # narrowed to one cluster where a caller reads one
    prometheus_cluster: str | None = None  # that cluster, as the source names it: "region eu"


def sources_for(
    base_urls: Iterable[str],
    prometheus_url: str | None = None,
    override: BlockSize | None = None,
    metrics_url: str | None = None,
) -> BlockSizeSources:
    """The sources of routes at `base_urls`: without `metrics_url`, each one's origin + /metrics, where
    a gateway usually passes /metrics on to one engine."""
    urls = (metrics_url,) if metrics_url else tuple(dict.fromkeys(map(_origin_metrics, base_urls)))
    return BlockSizeSources(override, prometheus_url, urls)


def _origin_metrics(base_url: str) -> str:
    url = httpx.URL(base_url)
    return f"{url.scheme}://{url.netloc.decode()}/metrics"


async def learn(sources: BlockSizeSources, sessions: Iterable[SessionResult]) -> BlockSize:
    """The block size from the first source that knows it (see the module's docstring); never raises."""
    if sources.override is not None:
        return sources.override
    async with http_client(timeout=TIMEOUT_S) as client:
        if sources.prometheus_url and (found := await _from_prometheus(sources)):
            return found
        for url in sources.metrics_urls:
            if found := await _from_metrics(client, url):
                return found
    return from_granularity(sessions) or BlockSize(DEFAULT_TOKENS, "default; no engine evidence")


async def _from_prometheus(sources: BlockSizeSources) -> BlockSize | None:
    # Imported here: requests and prometheus-api-client would cost every kvwatch command that never asks
    # Prometheus (each lab replica and simulated user is one) a sixth of a second of CPU at start.
    from kvwatch.core.promapi import PrometheusApi

    url = sources.prometheus_url
    try:
        series = await asyncio.to_thread(PrometheusApi(url, TIMEOUT_S).query, sources.prometheus_query)
    except UpstreamError:
        return None
    of = f"of {sources.prometheus_cluster} " if sources.prometheus_cluster else ""
    return _smallest(
        (s["metric"].get("block_size", "") for s in series), f"{of}in Prometheus at {redact(url)}"
    )


async def _from_metrics(client: httpx.AsyncClient, url: str) -> BlockSize | None:
    try:
        text = await fetch(client, url, TIMEOUT_S, DEFAULT_MAX_BYTES)
        sizes = Reader(Exposition(text)).label_values(SERIES, "block_size", optional=True)
    except (ScrapeError, ValueError):  # ValueError: what the text parser raises on junk
        return None
    return _smallest(sizes or (), f"at {redact(url)}")


def _smallest(labels: Iterable[str], where: str) -> BlockSize | None:
    """The smallest valid block size among label values, its source naming the others if any."""
    sizes = sorted({int(v) for v in labels if v.isdecimal() and not problem(int(v))})
    if not sizes:
        return None
    if len(sizes) == 1:
        return BlockSize(sizes[0], f"{SERIES} {where}")
    return BlockSize(sizes[0], f"smallest of {', '.join(map(str, sizes))} in {SERIES} {where}")


def from_granularity(sessions: Iterable[SessionResult]) -> BlockSize | None:
    """The GCD of the distinct positive cached_tokens the engine reported; None with fewer than two.

    An engine caches whole blocks, so every count is a multiple of the block; one value (or one value
    seen twice) would say nothing about the block, two distinct ones bound it, more pin it down.
    """
    counts = {r.cached_tokens for s in sessions for r in s.rounds if r.ok and (r.cached_tokens or 0) > 0}
    gcd = math.gcd(*counts)
    if len(counts) < 2 or problem(gcd):
        return None
    return BlockSize(gcd, f"granularity of {len(counts)} distinct reported cached_tokens")


def ideal_cached(previous: RoundResult | None, prompt_tokens: int | None, block: int) -> int | None:
    """What a pinned replica would reuse: the previous round's prompt and answer, in whole blocks.

    Capped below this round's prompt, since an engine always computes at least its last token. A
    reasoning model's thinking is in the cache but not in the history resent (the answer text only), so
    after an answer that thought first the previous prompt is all a pinned replica can reuse.
    """
    if previous is None:
        return 0
    if prompt_tokens is None or previous.prompt_tokens is None or previous.completion_tokens is None:
        return None
    thought_first = (previous.first_content_seconds or 0) > (previous.ttft_seconds or 0)
    held = (previous.prompt_tokens + previous.completion_tokens * (not thought_first)) // block * block
    return max(0, min(held, (prompt_tokens - 1) // block * block))


def with_block_size(sessions: Iterable[SessionResult], block: int) -> list[SessionResult]:
    """The sessions with every round's ideal cached tokens aligned to `block`-token blocks.

    For a block learned after the sessions ran (from their own cached tokens, say); records are frozen,
    so these are new ones. A round run in a new session after a loss stays cold: nothing before it.
    """

    def aligned(session: SessionResult) -> tuple[RoundResult, ...]:
        reopened = {number for number, _ in session.session_losses}
        return tuple(
            replace(
                r,
                ideal_cached_tokens=ideal_cached(
                    None if r.round in reopened else previous, r.prompt_tokens, block
                ),
            )
            for previous, r in zip((None, *session.rounds[:-1]), session.rounds, strict=True)
        )

    return [replace(session, rounds=aligned(session)) for session in sessions]
