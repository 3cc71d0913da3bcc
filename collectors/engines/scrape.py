"""Read engine and router /metrics from URLs or files and normalise them: `kvwatch scrape`.

Every source is read on its own: one that cannot be fetched, is too large, is not an exposition or
matches no flavour gives an error naming it, and the others are still reported.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from kvwatch.collectors.engines import (
    ENGINE_FLAVOURS,
    Exposition,
    Flavour,
    Normalised,
    Snapshot,
    UnknownFlavour,
    detect_flavour,
    normalise,
)
from kvwatch.collectors.engines.normalise import LOOKUPS, TOKENS
from kvwatch.core.connections import connect_reason, http_client, url_problem
from kvwatch.core.errors import UpstreamError

DEFAULT_TIMEOUT = 10.0
DEFAULT_MAX_BYTES = 32 * 1024 * 1024  # real expositions are well under 1 MiB; this stops a runaway one
ACCEPT = "text/plain;version=0.0.4"  # the classic text format prometheus_client's parser reads

HIT_RATIO_SOURCES = {
    TOKENS: "cached / prompt tokens, from the engine's counters",
    LOOKUPS: "prefix-cache hits / lookups; the engine has no cached-token counter",
    "v0-gauge": "vLLM V0's own gauge: block hit rate since the engine started",
    "sglang-batch-gauge-fallback": "FALLBACK: SGLang's gauge of the last prefill batch; no token counters",
}


class ScrapeError(UpstreamError):
    """A source could not be read, parsed or recognised; the message says what went wrong."""


@dataclass(frozen=True)
class Result:
    """One source's normalised figures, or the error that kept it from having any."""

    source: str
    record: Normalised | None
    error: str | None = None

    def as_json(self) -> dict:
        """The same keys for every source, all null but `source` and `error` when it failed."""
        figures = asdict(self.record) if self.record else dict.fromkeys(f.name for f in fields(Normalised))
        return {"source": self.source, **figures, "error": self.error}


async def scrape(
    sources: list[str],
    interval: float | None = None,
    flavour: Flavour | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[Result]:
    """Lifetime figures of every source from one scrape, or windowed ones from two `interval` s apart.

    The flavour is detected from each source's first exposition unless given.
    """
    async with http_client(timeout=timeout, headers={"Accept": ACCEPT}, follow_redirects=True) as client:

        async def observe(source: str) -> Result:
            try:
                first = await read_snapshot(client, source, flavour, timeout, max_bytes)
                if interval is None:
                    return Result(source, normalise(first))
                await asyncio.sleep(interval)
                second = await read_snapshot(
                    client, source, ENGINE_FLAVOURS.lookup(first.flavour), timeout, max_bytes
                )
                return Result(source, normalise(second, first))
            except ScrapeError as error:
                return Result(source, None, f"{source}: {error}")

        return list(await asyncio.gather(*(observe(metrics_url(source)) for source in sources)))


def metrics_url(source: str) -> str:
    """A bare host's URL (`http://host:8000`) with /metrics, Prometheus' default metrics path, as an
    engine or router serves it; a URL with a path or a query, and a file, are read as given."""
    if "://" not in source:
        return source
    try:
        parts = urlsplit(source)
    except ValueError:  # e.g. an unclosed IPv6 bracket: `fetch` names what is wrong with it
        return source
    if parts.path not in ("", "/") or parts.query:
        return source
    return urlunsplit(parts._replace(path="/metrics"))


async def read_snapshot(
    client: httpx.AsyncClient, source: str, flavour: Flavour | None, timeout: float, max_bytes: int
) -> Snapshot:
    """Fetch, parse and read one exposition of `source`."""
    text = await fetch(client, source, timeout, max_bytes)
    scraped_at = time.monotonic()
    try:
        exposition = Exposition(text)
        return (flavour or detect_flavour(exposition)).read(exposition, scraped_at)
    except UnknownFlavour as error:
        raise ScrapeError(f"unknown flavour: {error}") from error
    except ValueError as error:  # what the text parser raises on junk
        raise ScrapeError(f"not a Prometheus text exposition ({error})") from error


async def fetch(client: httpx.AsyncClient, source: str, timeout: float, max_bytes: int) -> str:
    """The text of a /metrics URL or a file, refusing more than `max_bytes` before reading them all."""
    try:
        if "://" in source:
            if problem := url_problem(source):
                raise ScrapeError(f"not a valid URL: {problem}")
            async with asyncio.timeout(timeout):  # the whole body, not each read: a slow drip ends too
                body = await _read_url(client, source, max_bytes)
        else:
            with Path(source).open("rb") as file:
                body = file.read(max_bytes + 1)
    except (TimeoutError, httpx.TimeoutException) as error:
        raise ScrapeError(f"no complete answer within {timeout:g} s") from error
    except httpx.ConnectError as error:
        raise ScrapeError(f"cannot connect: {connect_reason(error)}") from error
    except httpx.HTTPError as error:
        raise ScrapeError(f"HTTP request failed: {error}") from error
    except OSError as error:
        raise ScrapeError(f"cannot read the file: {error.strerror}") from error
    if len(body) > max_bytes:
        raise ScrapeError(f"more than {_size(max_bytes)} (the size cap; see --max-bytes)")
    try:
        return body.decode()
    except UnicodeDecodeError as error:
        raise ScrapeError(f"not a Prometheus text exposition (not UTF-8 text: {error.reason})") from error


async def _read_url(client: httpx.AsyncClient, url: str, max_bytes: int) -> bytes:
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise ScrapeError(f"HTTP {response.status_code} {response.reason_phrase}")
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                break
        return bytes(body)


def _size(count: int) -> str:
    return f"{count / 2**20:g} MiB" if count >= 2**20 else f"{count} bytes"


# The human-readable report.


def format_result(result: Result) -> str:
    """A compact block per source: what an SRE needs at a glance, unknowns said as such."""
    if result.record is None:
        return f"{result.source}\n  ERROR  {result.error}"
    record = result.record
    if record.window_seconds is None:
        scope = "lifetime: cumulative since the process started"
    else:
        scope = f"window of {record.window_seconds:.1f} s"
    kind = ENGINE_FLAVOURS.lookup(record.flavour).kind
    rows = {"engine": _engine_rows, "cache": _cache_rows}.get(kind, _router_rows)(record)
    if record.counter_reset:
        rows.append(("counter reset", "a counter went down: the source restarted within the window"))
    if record.missing:
        rows.append(("missing series", ", ".join(record.missing)))
    if record.invalid:
        bad = ", ".join(f"{name} = {value}" for name, value in sorted(record.invalid.items()))
        rows.append(("invalid series", f"{bad} (no measurement: not counted)"))
    lines = [f"{result.source}  [{record.flavour}, {scope}]"]
    lines += [f"  {label:<20} {value}" for label, value in rows]
    return "\n".join(lines)


def _engine_rows(record: Normalised) -> list[tuple[str, str]]:
    ttft = (record.ttft_p50_seconds, record.ttft_p90_seconds, record.ttft_p99_seconds)
    caching = {True: "on", False: "OFF", None: "unknown"}[record.prefix_caching_enabled]
    return [
        ("hit ratio", _hit_ratio(record)),
        ("local lookups", _local_hit_ratio(record)),
        ("tokens", f"{_count(record.prompt_tokens)} prompt, {_count(record.cached_tokens)} cached"),
        (
            "TTFT p50/p90/p99",
            "n/a" if ttft[0] is None else " / ".join(f"{t:.3g}" for t in ttft) + " s",
        ),
        ("requests", f"{_count(record.requests_running)} running, {_count(record.requests_waiting)} waiting"),
        ("KV cache usage", "n/a" if record.kv_cache_usage is None else f"{record.kv_cache_usage:.1%}"),
        ("prefix caching", caching),
    ]


def _cache_rows(record: Normalised) -> list[tuple[str, str]]:
    """A KV cache store's lookups: what it found of the tokens asked of it, and in which tier."""
    found = record.local_hit_ratio
    rows = [
        ("lookup hit ratio", "unknown: no lookups " + _scope(record) if found is None else f"{found:.1%}"),
        ("tokens", f"{_count(record.local_lookups)} asked, {_count(record.local_hits)} found"),
    ]
    if record.cache_tiers and record.local_lookups:
        tiers = {tier: count / record.local_lookups for tier, count in record.cache_tiers.items()}
        rows.append(("found by tier", ", ".join(f"{tier} {share:.1%}" for tier, share in tiers.items())))
    return rows


def _router_rows(record: Normalised) -> list[tuple[str, str]]:
    total = sum(record.per_worker.values())
    width = max(map(len, record.per_worker), default=0)
    workers = [
        f"{worker:<{width}}  {_count(count):>7}" + (f"  ({count / total:.0%})" if total else "")
        for worker, count in sorted(record.per_worker.items())
    ] or ["unknown: see invalid series" if record.invalid else "none counted by this router"]
    # One line per worker; the label only on the first.
    rows = [("requests per worker" if i == 0 else "", line) for i, line in enumerate(workers)]
    if record.requests_running is not None:
        rows.append(("requests in flight", _count(record.requests_running)))
    if record.policy_decisions:
        rows.append(("policy decisions", _pairs(record.policy_decisions)))
    if record.router_cache_predictions:
        rows.append(("router cache guesses", _pairs(record.router_cache_predictions) + "  (not engine hits)"))
    if record.predicted_hit_ratio is not None:
        rows.append(("predicted hit ratio", f"{record.predicted_hit_ratio:.1%}  (the router's guess)"))
    if record.routed_share is not None:
        legs = (record.available_share, record.routed_share, record.delivered_share)
        shown = " -> ".join("n/a" if share is None else f"{share:.1%}" for share in legs)
        rows.append(("reuse of the prompt", f"{shown}  (available -> routed -> delivered)"))
    if record.hit_ratio is not None:
        rows.append(("delivered hit ratio", f"{record.hit_ratio:.1%}  (cached / prompt tokens it forwarded)"))
    if record.sticky_outcomes:
        rows.append(("sticky outcomes", _pairs(record.sticky_outcomes)))
    if record.routing_key_sources:
        rows.append(("routing key from", _pairs(record.routing_key_sources)))
    if record.router_fallbacks:
        rows.append(("without its index", _pairs(record.router_fallbacks) + "  (sent by load)"))
    return rows + _router_state_rows(record)


def _router_state_rows(record: Normalised) -> list[tuple[str, str]]:
    """A router's session table and KV-event index health, when it exports them."""
    rows = []
    if (table := record.session_table) is not None:
        rows.append(("session bindings", _count(table.bindings)))
        rows.append(("sessions refused", _count(table.bind_rejections) + "  (table full)"))
        if table.invalidations:
            rows.append(("bindings dropped", _pairs(table.invalidations)))
    if (index := record.index_health) is not None:
        lag = "n/a" if index.lag_seconds is None else f"{index.lag_seconds:g} s"
        rows.append(("KV-event index lag", f"{lag}  (its worst worker)"))
        rows.append(("KV-event gaps", f"{_count(index.gaps)}, resyncs {_count(index.resyncs)}"))
        rows.append(("degraded ranks", _count(index.degraded_ranks)))
    return rows


def _hit_ratio(record: Normalised) -> str:
    if record.hit_ratio is not None:
        return f"{record.hit_ratio:.1%}  ({HIT_RATIO_SOURCES[record.hit_ratio_source]})"
    if record.hit_ratio_source in (TOKENS, LOOKUPS):
        if (record.cached_tokens or 0) > (record.prompt_tokens or 0) > 0:
            return "unknown: more cached than prompt tokens, which no engine counts"
        return "unknown: no prompt tokens " + _scope(record)
    if record.hit_ratio_source is not None:
        return f"unknown: the engine's gauge has no data ({record.hit_ratio_source})"
    gaps = "missing and invalid series" if record.invalid else "missing series"
    return f"unknown: no usable hit-ratio series (see {gaps})"


def _local_hit_ratio(record: Normalised) -> str:
    """The local cache's own lookups: an engine with prefix caching off looks nothing up. "None" only when
    a usable counter says so: a missing or invalid one is no evidence of zero."""
    if record.local_hit_ratio is not None:
        return f"{record.local_hit_ratio:.1%}  (prefix-cache hits / lookups)"
    if record.local_lookups is None:
        return "unknown: no usable lookup counter"
    if record.local_lookups == 0:
        return "none " + _scope(record)
    if record.local_hits is None:
        return "unknown: no usable hit counter"
    return "unknown: more hits than lookups, which no engine counts"


def _scope(record: Normalised) -> str:
    return "since start" if record.window_seconds is None else "in the window"


def _count(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _pairs(values: dict[str, float]) -> str:
    return ", ".join(f"{key} {_count(value)}" for key, value in sorted(values.items()))
