"""`kvwatch doctor`: walk the source article's troubleshooting checklist against one route, name the cause.

The checks run in the order an engineer walks them by hand: can the endpoint be reached, does it accept
the key, does it answer with a completion (doctor.route); then the four silent causes of a hit rate stuck
at zero: the session id does not reach the router, the router hashes something else (doctor.route), the
engine caches no prefixes (doctor.caching), the prompts start with dynamic content (doctor.prompts). A
check whose premise an earlier one disproved is skipped, with the reason.

`diagnose()` is the whole doctor for callers such as the dashboard; `kvwatch doctor` prints its result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.blocksize import BlockSizeSources
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.core.connections import http_client
from kvwatch.doctor.caching import EVERY_CLUSTER, Cluster, prefix_caching
from kvwatch.doctor.findings import Check, Diagnosis
from kvwatch.doctor.prompts import prompt_prefix
from kvwatch.doctor.route import ROUTE_CHECKS, Route

ANSWER_TOKENS = 8
CHECKS = len(ROUTE_CHECKS) + 2  # the route's, prefix caching and the prompts' prefix


def diagnose(probe: ProbeSettings, *args, **kwargs) -> Diagnosis:
    """`examine`, with the same arguments, for callers that run no event loop."""
    return asyncio.run(examine(probe, *args, **kwargs))


async def examine(
    probe: ProbeSettings,
    prometheus_url: str | None = None,
    requests_sample: str | Path | None = None,
    block_sources: BlockSizeSources | None = None,
    on_check: Callable[[Check], None] | None = None,
    gateway: str | None = None,
    cluster: Cluster | None = None,
) -> Diagnosis:
    """Examine one route and, optionally, its engines in Prometheus and a sample of real request payloads.

    `probe` names the route as for `kvwatch probe` (base URL, model, API key, session and backend
    headers, timeout per request); its session mode and workload are the doctor's own. `prometheus_url`
    adds the engines' own word on prefix caching. `requests_sample` is a JSONL file of request payloads,
    one {"messages": [...]} per line, to look for dynamic content at the front of the prompts.
    `block_sources` says where the engines' KV block size comes from (by default Prometheus, the base
    URL's origin + /metrics, then the sessions' cached tokens). Never raises for what it finds: a problem
    is a failed check. Takes a few seconds, at most a few timeouts. `on_check` is told of each check
    (CHECKS of them) as it ends. `gateway` (one of affinity.SYSTEMS) is the gateway or router whose
    settings the fixes name; by default the one an answer's headers show, else every one. `cluster`
    narrows what Prometheus is asked (the engines' prefix caching, their block size) to one cluster, or
    names the label that tells them apart; by default every one, by the label `cluster`.
    """
    cluster = cluster or EVERY_CLUSTER
    probe = replace(probe, target="doctor", session_mode="client", max_tokens=ANSWER_TOKENS)
    block_sources = block_sources or blocksize.sources_for([probe.base_url], prometheus_url)
    if cluster.name is not None:
        block_sources = replace(
            block_sources,
            prometheus_query=cluster.narrowed(block_sources.prometheus_query),
            prometheus_cluster=str(cluster),
        )
    checks: list[Check] = []

    def found(check: Check) -> None:
        checks.append(check)
        if on_check is not None:
            on_check(check)

    async with http_client(timeout=probe.timeout_seconds) as client, StreamClient() as streams:
        route = Route(client, streams, probe, block_sources, gateway=gateway)
        blocker = None
        for name, check in ROUTE_CHECKS:
            if blocker:
                found(Check(name, "skipped", f"not meaningful while {blocker.name} fails"))
                continue
            found(await check(route))
            blocker = checks[-1] if _blocks(checks[-1]) else None
        found(await prefix_caching(route, prometheus_url, blocker, cluster))
    found(prompt_prefix(requests_sample))
    return Diagnosis(tuple(checks))


def _blocks(check: Check) -> bool:
    """A failure makes the later route checks meaningless, except a wrong base URL when a variant of it
    works: the later checks use that one."""
    return check.status == "fail" and check.cause != "bad_base_url"
