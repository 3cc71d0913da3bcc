"""`kvwatch doctor`: walk the source article's troubleshooting checklist against one route, name the cause.

The checks run in the order an engineer walks them by hand: can the endpoint be reached, does it accept
the key, does it answer with a completion; then the four silent causes of a hit rate stuck at zero: the
session id does not reach the router, the router hashes something else, the engine caches no prefixes,
the prompts start with dynamic content. Chat requests go through the probe (collectors.probe), so the
doctor sees what `kvwatch probe` and the scheduled probes see, with their error kinds and redaction. A
check whose premise an earlier one disproved is skipped, with the reason.

`diagnose()` is the whole doctor for callers such as the dashboard; `kvwatch doctor` prints its result.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import random
import re
import sys
import textwrap
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from kvwatch.alerts.alerts import Alert, alerts
from kvwatch.collectors import identity
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.blocksize import BlockSize, BlockSizeSources
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.session import (
    HINTS,
    ProbeSettings,
    add_api_key_arguments,
    add_identity_arguments,
    add_model_argument,
    api_url,
    chosen_model,
    list_models,
    resolve_api_key,
    run_session,
    with_block_size,
)
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.workload import Conversation, synthetic
from kvwatch.core.config import label_name_problem
from kvwatch.core.connections import http_client, request
from kvwatch.core.progress import Progress
from kvwatch.core.redaction import redact
from kvwatch.core.tokenizer import TemplateError, message_text, split_words
from kvwatch.doctor import affinity
from kvwatch.prometheus import promql, queries
from kvwatch.prometheus.queries import CLUSTER_LABEL, Grouping
from kvwatch.prometheus.thresholds import THRESHOLDS

STATUSES = ("pass", "warn", "fail", "skipped")
CAUSES = (
    "connection_refused",
    "bad_base_url",
    "unauthorized",
    "forbidden",
    "model_not_found",
    "bad_response",
    "session_id_not_propagated",
    "hash_key_not_session",
    "prefix_cache_disabled",
    "dynamic_prompt_prefix",
    "cluster_not_found",
)
UNREACHABLE = ("connection_refused", "tls_error", "protocol_error", "timeout")

# Sessions run one after another: behind round robin, as many sessions in lockstep as there are replicas
# would look sticky. Three sessions of four rounds leave a gateway that hashes on something else, over n
# replicas, a chance of 1 in n^9 to keep them all on one backend.
SESSIONS = 3
ROUNDS = 4
SYSTEM_TOKENS = 200
TURN_TOKENS = 40
ANSWER_TOKENS = 8
PROMETHEUS_TIMEOUT_S = 10.0
MAX_SAMPLE_REQUESTS = 10_000
MIN_STATIC_TAIL = 16  # one KV block: static content after a varying piece that a cache could have reused
EXCERPT_CHARS = 60

# What the varying piece of a system prompt looks like, most specific first.
DYNAMIC_CONTENT = (
    ("UUID", re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)),
    ("timestamp", re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}|^\d{10}(\d{3})?\b")),
    ("date", re.compile(r"\d{4}-\d{2}-\d{2}|\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b")),
    ("time of day", re.compile(r"\b\d{1,2}:\d{2}(:\d{2})?\b")),
    ("request id", re.compile(r"\b[0-9a-f]{12,}\b", re.IGNORECASE)),
    ("counter", re.compile(r"\d+")),
)
# Seen on the varying piece's line when the piece itself looks like nothing in particular.
ID_LABEL = re.compile(r"\b(request|trace|correlation|session|conversation)[ _-]?id\b", re.IGNORECASE)


@dataclass(frozen=True)
class Check:
    """One finding: what was looked at, what to do about it, and the cause it names when it fails."""

    name: str
    status: str  # pass | warn | fail | skipped
    evidence: str
    fix: str = ""
    cause: str | None = None  # one of CAUSES; set on failures

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}")


@dataclass(frozen=True)
class Diagnosis:
    """Every check in order, skipped ones included."""

    checks: tuple[Check, ...]

    @property
    def causes(self) -> list[str]:
        """The causes of the failed checks, in check order."""
        return list(dict.fromkeys(c.cause for c in self.checks if c.status == "fail" and c.cause))

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    def as_json(self) -> dict:
        return {"checks": [asdict(c) for c in self.checks], "causes": self.causes}


@dataclass(frozen=True)
class Cluster:
    """Which clusters' engines the doctor reads in a Prometheus that holds several, told apart by the
    label `label`: the one whose value is `name`, or without a name every one, each instance named with
    its own."""

    name: str | None
    label: str = CLUSTER_LABEL

    def __post_init__(self) -> None:
        if self.name == "":
            raise ValueError("the cluster needs a name")
        if wrong := label_name_problem(self.label):
            raise ValueError(f"the cluster label {wrong}")

    def __str__(self) -> str:
        """As the evidence names it: `cluster a`, `region eu`."""
        return f"{self.label} {self.name}"

    def narrowed(self, expr: str) -> str:
        return (
            expr
            if self.name is None
            else promql.with_matcher(expr, queries.one_cluster(self.label, self.name))
        )


EVERY_CLUSTER = Cluster(None)


@dataclass
class _Route:
    """What the route's checks share: the base URL may be corrected by reachability, then each check
    reads the first round or the sessions, their ideal cached tokens in the engine's KV blocks."""

    client: httpx.AsyncClient  # for the model list and Prometheus
    streams: StreamClient  # for the rounds
    probe: ProbeSettings
    block_sources: BlockSizeSources
    first: RoundResult | None = None
    sessions: list[SessionResult] = field(default_factory=list)
    block: BlockSize | None = None  # learned once the sessions ran
    gateway: str | None = None  # the system in front of the replicas, as --gateway names it
    systems: tuple[affinity.Affinity, ...] = ()  # whose settings the fixes name, learned on a failure


def diagnose(
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
    return asyncio.run(
        examine(probe, prometheus_url, requests_sample, block_sources, on_check, gateway, cluster)
    )


async def examine(
    probe: ProbeSettings,
    prometheus_url: str | None = None,
    requests_sample: str | Path | None = None,
    block_sources: BlockSizeSources | None = None,
    on_check: Callable[[Check], None] | None = None,
    gateway: str | None = None,
    cluster: Cluster | None = None,
) -> Diagnosis:
    """`diagnose` for callers that run an event loop."""
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
        route = _Route(client, streams, probe, block_sources, gateway=gateway)
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


# --- the route: reachability, auth, response shape ------------------------------------------------


def _blocks(check: Check) -> bool:
    """A failure makes the later route checks meaningless, except a wrong base URL when a variant of it
    works: the later checks use that one."""
    return check.status == "fail" and check.cause != "bad_base_url"


async def _one_round(client: StreamClient, probe: ProbeSettings) -> RoundResult:
    session = await run_session(client, probe, Conversation("You are brief.", ("Say hello.",)))
    return session.rounds[0]


async def _models(client: httpx.AsyncClient, probe: ProbeSettings) -> list[str] | None:
    """The model ids GET <base URL>/models lists; None when it lists none (no such route, an error)."""
    try:
        return await list_models(client, probe.base_url, probe.api_key, probe.timeout_seconds)
    except (httpx.HTTPError, ValueError):
        return None


def _base_url_variants(base_url: str) -> list[str]:
    """The obvious fixes of a base URL: each shorter prefix of its path, down to the bare origin.

    They cover a doubled /v1 (…/v1/v1), a pasted endpoint (…/v1/chat/completions) and a path the
    server does not serve (…/api when the API is at /v1). A missing /v1 needs none: kvwatch appends it.
    """
    url = httpx.URL(base_url)
    origin = f"{url.scheme}://{url.netloc.decode()}"
    parts = [part for part in url.path.split("/") if part]
    roots, variants = {api_url(base_url, "")}, []
    for variant in (
        origin + "".join(f"/{part}" for part in parts[:i]) for i in range(len(parts) - 1, -1, -1)
    ):
        if api_url(variant, "") not in roots:  # e.g. …/api and …/api/v1 are the same API root
            roots.add(api_url(variant, ""))
            variants.append(variant)
    return variants


async def reachability(route: _Route) -> Check:
    """Does anything answer at the base URL, and is it the API root? A 404 there tries the variants."""
    name, probe = "reachability", route.probe
    route.first = first = await _one_round(route.streams, probe)
    url = redact(api_url(probe.base_url, "chat/completions"))
    if first.error_kind in UNREACHABLE:
        fix = f"{HINTS[first.error_kind]}; `curl -v {url}` shows which hop fails"
        return Check(name, "fail", first.error_detail, fix, "connection_refused")
    if first.error_kind != "not_found" or await _models(route.client, probe) is not None:
        return Check(name, "pass", f"HTTP {first.status} from {url}")
    for variant in _base_url_variants(probe.base_url):
        candidate = replace(probe, base_url=variant)
        answer = await _one_round(route.streams, candidate)
        if answer.error_kind not in (*UNREACHABLE, "not_found") or await _models(route.client, candidate):
            route.probe, route.first = candidate, answer
            root = redact(api_url(variant, ""))
            works = redact(api_url(variant, "chat/completions"))
            evidence = (
                f"{url} answers HTTP 404; {works} answers HTTP {answer.status} (the later checks use it)"
            )
            fix = f"set the base URL to {root}, the API root under which /chat/completions and /models live"
            return Check(name, "fail", evidence, fix, "bad_base_url")
    evidence = (
        f"{url} answers HTTP 404, and so does every shorter base URL; GET "
        f"{redact(api_url(probe.base_url, 'models'))} lists no models: the base URL or the model id is wrong"
    )
    return Check(
        name, "warn", evidence, "find the API root: what precedes /chat/completions in a URL that works"
    )


async def auth(route: _Route) -> Check:
    """401 and 403 come before anything else can be judged."""
    first, sent = route.first, "with" if route.probe.api_key else "without"
    if first.error_kind == "unauthorized":
        evidence = f"{first.error_detail}; the request was sent {sent} an API key"
        return Check("auth", "fail", evidence, HINTS["unauthorized"], "unauthorized")
    if first.error_kind == "forbidden":
        if first.error_detail.startswith("token expired"):
            fix = "renew the token where the key comes from; refresh OAuth tokens before they expire"
        else:
            fix = (
                f"the key may not use {route.probe.model}: have it scoped to the model, or use one it covers"
            )
        return Check("auth", "fail", first.error_detail, fix, "forbidden")
    return Check("auth", "pass", f"no 401 or 403 {sent} an API key")


async def response_shape(route: _Route) -> Check:
    """A completion with `choices`, streamed as asked, for a model the server knows."""
    name, first, probe = "response shape", route.first, route.probe
    if first.ok:
        cached = "no cached_tokens" if first.cached_tokens is None else f"{first.cached_tokens} cached"
        usage = f"usage: {first.prompt_tokens} prompt tokens, {cached}"
        return Check(name, "pass", f"a streamed completion with `choices`; {usage}")
    if first.error_kind != "not_found":
        fix = HINTS[first.error_kind]
        if "whole completion" in first.error_detail:
            fix = "the server ignored `stream: true` (or a proxy collected the stream): make both sides agree"
        return Check(name, "fail", first.error_detail, fix, "bad_response")
    offered = await _models(route.client, probe)
    models_url = redact(api_url(probe.base_url, "models"))
    if offered and probe.model in offered:
        evidence = f"{first.error_detail}; yet GET {models_url} lists {probe.model}"
        return Check(name, "fail", evidence, "route /chat/completions to the engines", "bad_base_url")
    listing = f"offers: {', '.join(offered[:20])}" if offered else "lists no models"
    evidence = f"{first.error_detail}; GET {models_url} {listing}"
    return Check(name, "fail", evidence, "use a model id exactly as the server lists it", "model_not_found")


# --- the route: where sessions land -----------------------------------------------------------------


def _path(session: SessionResult) -> str:
    """The backends a session's rounds landed on, e.g. `r1 x4` or `r1 > r3 > r2 > r1`."""
    backends = session.backends
    if len(set(backends)) == 1:
        return f"{backends[0]} x{len(backends)}"
    return " > ".join(backends) or "unknown"


async def _fixes(route: _Route, setting: str) -> str:
    """One setting's fix in the words of the system in front of the replicas: the one --gateway names,
    else the one whose marks an answer's headers carry, else every system's, each named."""
    if not route.systems:
        route.systems = tuple(affinity.SYSTEMS.values())
        if route.gateway:
            route.systems = (affinity.SYSTEMS[route.gateway],)
        elif found := affinity.recognised(await _answer_headers(route)):
            route.systems = (found,)
    return "; ".join(system.fix(setting, route.probe.session_header) for system in route.systems)


async def _answer_headers(route: _Route) -> httpx.Headers:
    """The headers of one short answer through the route; none when it gives no answer."""
    probe = route.probe
    body = {"model": probe.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {probe.api_key}"} if probe.api_key else {}
    url = api_url(probe.base_url, "chat/completions")
    try:
        return (
            await request(route.client, "POST", url, probe.timeout_seconds, json=body, headers=headers)
        ).headers
    except httpx.HTTPError:
        return httpx.Headers()


async def session_propagation(route: _Route) -> Check:
    """Rounds carrying a fixed session id: does the gateway give back the id it was sent?

    It runs the sessions that the hash-key and prefix-caching checks read too.
    """
    name, header = "session id propagation", route.probe.session_header
    conversations = synthetic(ROUNDS, SYSTEM_TOKENS, TURN_TOKENS, random.randrange(2**32), SESSIONS)
    sessions = [await run_session(route.streams, route.probe, c) for c in conversations]
    route.block = await blocksize.learn(route.block_sources, sessions)
    route.sessions = with_block_size(sessions, route.block.tokens)
    answered = [r for s in route.sessions for r in s.rounds if r.status is not None]
    failed = [f"{r.error_kind} in round {r.round}" for r in answered if not r.ok]
    errors = f" ({len(failed)} rounds failed: {', '.join(dict.fromkeys(failed))})" if failed else ""
    changed = [r for r in answered if r.session_id_returned not in (None, r.session_id_sent)]
    missing = [r for r in answered if r.session_id_returned is None]
    if not answered:
        return Check(name, "warn", f"no round of {SESSIONS} sessions was answered{errors}")
    if changed:
        example = changed[0]
        evidence = (
            f"{len(changed)} of {len(answered)} rounds came back with another {header} (sent "
            f"{example.session_id_sent}, got {example.session_id_returned}): the gateway did not see the "
            f"client's id and made its own{errors}"
        )
        fix = f"make every hop forward {header} unchanged: {await _fixes(route, 'forward')}"
        return Check(name, "fail", evidence, fix, "session_id_not_propagated")
    if missing and all(s.sticky for s in route.sessions):
        evidence = (
            f"{header} is not echoed, but every session stayed on one backend: the id probably reaches "
            f"the router{errors}"
        )
        fix = f"echo it so that clients can check: {await _fixes(route, 'echo')}"
        return Check(name, "warn", evidence, fix)
    if missing:
        evidence = (
            f"{header} is not echoed on {len(missing)} of {len(answered)} rounds and sessions changed "
            f"backend: {'; '.join(map(_path, route.sessions))}{errors}"
        )
        fix = f"make every hop forward {header} unchanged: {await _fixes(route, 'forward')}"
        return Check(name, "fail", evidence, fix, "session_id_not_propagated")
    return Check(name, "pass", f"{header} came back unchanged on all {len(answered)} rounds{errors}")


async def hash_key(route: _Route) -> Check:
    """The id arrives, so rounds of one session landing on different backends mean the key is another."""
    name, sessions = "hash key", route.sessions
    paths = "; ".join(map(_path, sessions))
    moved = sum(s.sticky is False for s in sessions)
    if moved:
        evidence = f"{moved} of {len(sessions)} sessions changed backend within {ROUNDS} rounds: {paths}"
        fix = f"hash on the session id: {await _fixes(route, 'hash_on')}"
        return Check(name, "fail", evidence, fix, "hash_key_not_session")
    if any(s.sticky is None for s in sessions):
        headers = ", ".join(route.probe.backend_headers)
        evidence = f"no response header ({headers}) named the backend and no cached tokens were reported"
        return Check(name, "warn", evidence, "name the header that names the replica: --backend-header H")
    return Check(name, "pass", f"each of {len(sessions)} sessions stayed on one backend: {paths}")


ROUTE_CHECKS: tuple[tuple[str, Callable[[_Route], Awaitable[Check]]], ...] = (
    ("reachability", reachability),
    ("auth", auth),
    ("response shape", response_shape),
    ("session id propagation", session_propagation),
    ("hash key", hash_key),
)
CHECKS = len(ROUTE_CHECKS) + 2  # the route's, prefix caching and the prompts' prefix


# --- the engines: prefix caching --------------------------------------------------------------------


def caching_off_alerts(cluster_label: str = CLUSTER_LABEL) -> list[Alert]:
    """The alert rules' two kinds of evidence, queried as they are, so that the doctor and the alerts
    agree; aggregated by `cluster_label`, so that each instance keeps its cluster."""
    every_alert = alerts(THRESHOLDS, Grouping(cluster_label))
    return [a for a in every_alert if a.name == "KVWatchPrefixCachingDisabled"]


CACHING_OFF_EVIDENCE = {
    "lookups": "serves prompt tokens while its prefix-cache lookups stay flat",
    "config": "reports enable_prefix_caching=False",
}


class NoEngineSeries(ValueError):
    """Prometheus holds no engine series that the caching-off queries could read (in the cluster named):
    their silence would say nothing of the engines."""


async def _query(client: httpx.AsyncClient, url: str, expr: str) -> list[dict]:
    """The series of an instant query; raises httpx.HTTPError or ValueError."""
    query = f"{url.rstrip('/')}/api/v1/query"
    response = await request(client, "GET", query, PROMETHEUS_TIMEOUT_S, params={"query": expr})
    response.raise_for_status()
    answer = response.json()
    if answer.get("status") != "success":
        raise ValueError(answer.get("error", "the query failed"))
    return answer["data"]["result"]


async def _engines_there(client: httpx.AsyncClient, url: str, cluster: Cluster) -> None:
    """Raises NoEngineSeries, naming the clusters that do hold engines, when Prometheus holds none of the
    series the caching-off queries read, or none in `cluster`."""
    alerts = caching_off_alerts(cluster.label)
    names = list(dict.fromkeys(name for alert in alerts for name in promql.series_names(alert.expr)))
    expr = f"group by ({cluster.label}) ({{__name__=~{promql.string('|'.join(names))}}})"
    values = {series["metric"].get(cluster.label, "") for series in await _query(client, url, expr)}
    if not values:
        raise NoEngineSeries(f"holds no engine series ({', '.join(names)}) to judge")
    if cluster.name is None or cluster.name in values:
        return
    named = sorted(values - {""})
    there = (
        f"its engines' {cluster.label} values are {', '.join(named)}"
        if named
        else f"no engine series there carries the label {cluster.label}"
    )
    raise NoEngineSeries(
        f"no engine series has {queries.one_cluster(cluster.label, cluster.name)}, so none is judged; {there}"
    )


async def _caching_off_in_prometheus(
    client: httpx.AsyncClient, url: str, cluster: Cluster = EVERY_CLUSTER
) -> list[str]:
    """Instances Prometheus sees without prefix caching, in `cluster` alone when it names one; raises
    httpx.HTTPError or ValueError, NoEngineSeries when the queries would read no engine."""
    await _engines_there(client, url, cluster)
    found = []
    for alert in caching_off_alerts(cluster.label):
        what = CACHING_OFF_EVIDENCE[alert.labels["evidence"]]
        found += [
            f"{_instance_in_cluster(series['metric'], cluster.label)} {what}"
            for series in await _query(client, url, cluster.narrowed(alert.expr))
        ]
    return found


def _instance_in_cluster(labels: dict[str, str], cluster_label: str) -> str:
    """An instance as the alerts name it; with its cluster where Prometheus holds several."""
    instance, cluster = labels.get("instance", "an instance"), labels.get(cluster_label)
    return f"{instance} in {cluster_label} {cluster}" if cluster else instance


async def prefix_caching(
    route: _Route, prometheus_url: str | None, blocker: Check | None, cluster: Cluster = EVERY_CLUSTER
) -> Check:
    """A session pinned to one backend that reuses nothing of its history means the engine caches nothing.

    Prometheus, when given, adds the engines' own word and covers replicas no session landed on: those
    of `cluster` alone, when it names one, which its evidence names then. A cluster Prometheus holds no
    engine of fails as cluster_not_found: its empty answer would otherwise pass.
    """
    name, off, seen = "prefix caching", [], []
    pinned = [s for s in route.sessions if s.sticky]
    reported = [s for s in pinned if all(r.cached_tokens is not None for r in s.rounds[1:] if r.ok)]
    reuse: dict[str, list[int]] = {}  # backend: [cached, ideal] tokens of the warm rounds pinned to it
    for session in reported:
        figures = reuse.setdefault(session.backends[0] if session.backends else "a backend", [0, 0])
        for r in session.rounds[1:]:
            if r.ok and r.ideal_cached_tokens:
                figures[0] += r.cached_tokens
                figures[1] += r.ideal_cached_tokens
    ratios = [cached / ideal for cached, ideal in reuse.values() if cached and ideal]
    off += [
        f"{b} reused 0 of {ideal} history tokens"
        for b, (cached, ideal) in reuse.items()
        if ideal and not cached
    ]
    if ratios:
        seen.append(f"pinned sessions reused their history (cached / ideal tokens: lowest {min(ratios):.0%})")
    elif not route.sessions:
        seen.append(f"not meaningful while {blocker.name} fails")
    elif not pinned:
        seen.append("no session stayed on one backend")
    elif not reported:
        seen.append("the engine reports no cached_tokens in usage")
    if reuse:  # the blocks its cached / ideal tokens count
        seen.append(route.block.describe())
    flagged, selects_nothing = None, False  # the engines Prometheus names, once it answered
    said = "Prometheus" if cluster.name is None else f"Prometheus ({cluster})"
    if prometheus_url:
        try:
            flagged = await _caching_off_in_prometheus(route.client, prometheus_url, cluster)
        except NoEngineSeries as error:
            seen.append(f"{said}: {error}")
            selects_nothing = cluster.name is not None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            seen.append(
                redact(f"Prometheus at {prometheus_url} cannot be queried ({type(error).__name__}: {error})")
            )
    off += [f"{said}: {line}" for line in flagged or []]
    seen += [f"{said}: no engine has prefix caching off"] if flagged == [] else []
    evidence = "; ".join(off + seen)
    if off:
        fix = (
            "start the engines with prefix caching on: vLLM V1 has it on by default (drop "
            "--no-enable-prefix-caching), V0 needs --enable-prefix-caching, SGLang must not get "
            "--disable-radix-cache"
        )
        return Check(name, "fail", evidence, fix, "prefix_cache_disabled")
    if selects_nothing:
        fix = (
            "name a cluster that holds engines (--cluster, the dashboard's cluster picker), or the label "
            "that tells clusters apart (--cluster-label, cluster_label in kvwatch.yaml)"
        )
        return Check(name, "fail", evidence, fix, "cluster_not_found")
    if ratios and min(ratios) < 0.5:
        return Check(name, "warn", evidence, "a cache too small for the working set evicts: check KV usage")
    if ratios or flagged is not None:
        return Check(name, "pass", evidence)
    if pinned:
        fix = "have the engine report them: vLLM --enable-prompt-tokens-details, SGLang --enable-cache-report"
        return Check(name, "warn", evidence, fix)
    if prometheus_url:
        return Check(name, "warn", evidence, "check the --prometheus URL")
    return Check(name, "skipped", f"{evidence}; --prometheus reads the engines themselves")


# --- the prompts: dynamic content at the front ------------------------------------------------------


@dataclass(frozen=True)
class _Prompt:
    """A distinct system prompt: its text, its tokens (words and punctuation, as the lab's tokenizer
    counts them) and where each token starts in the text."""

    text: str
    tokens: list[str]
    starts: list[int]

    @classmethod
    def of(cls, text: str) -> _Prompt:
        tokens, starts, position = split_words(text), [], 0
        for token in tokens:
            position = text.index(token, position)
            starts.append(position)
            position += len(token)
        return cls(text, tokens, starts)

    def varying(self, index: int) -> tuple[int, str, str]:
        """About the token at `index`: the index of the first token of the text between spaces around it,
        what that text looks like (a kind of DYNAMIC_CONTENT, or "") and its line."""
        at = self.starts[index]
        start = at - len(re.search(r"\S*$", self.text[:at]).group())
        chunk = self.text[start:].split(None, 1)[0]
        line = self.text[self.text.rfind("\n", 0, at) + 1 :].split("\n", 1)[0].strip()
        kind = next((kind for kind, pattern in DYNAMIC_CONTENT if pattern.search(chunk)), "")
        kind = kind or ("request id" if ID_LABEL.search(line) else "")
        excerpt = line if len(line) <= EXCERPT_CHARS else line[: EXCERPT_CHARS - 1] + "…"
        return bisect.bisect_left(self.starts, start), kind, excerpt


def _front_variation(a: _Prompt, b: _Prompt) -> int | None:
    """Where two system prompts differ, when they are one prompt with a short varying piece followed by
    static content that a cache could have reused; None when they are different prompts or differ only
    at the end."""
    shorter = min(len(a.tokens), len(b.tokens))
    same = next((i for i in range(shorter) if a.tokens[i] != b.tokens[i]), shorter)
    tail = 0
    while tail < shorter - same and a.tokens[-1 - tail] == b.tokens[-1 - tail]:
        tail += 1
    piece = max(len(a.tokens), len(b.tokens)) - same - tail
    return same if tail >= MIN_STATIC_TAIL and piece <= tail else None


def _system_prompts(path: Path) -> tuple[list[str], int]:
    """The system prompt of each request payload in a JSONL file ("" when it has none), and how many lines
    were no request payload. At most MAX_SAMPLE_REQUESTS are read."""
    prompts, malformed = [], 0
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                head = []
                for message in messages:
                    if message.get("role") not in ("system", "developer"):
                        break
                    head.append(message_text(message))
                prompts.append("\n".join(head))
            except (ValueError, TypeError, KeyError, AttributeError, TemplateError):
                malformed += 1
            if len(prompts) >= MAX_SAMPLE_REQUESTS:
                break
    return prompts, malformed


def prompt_prefix(requests_sample: str | Path | None) -> Check:
    """A timestamp or an id at the top of the system prompt makes every conversation's prompt unique from
    there on, so none reuses the static rest that the cache holds from another."""
    name = "prompt-prefix stability"
    if requests_sample is None:
        return Check(name, "skipped", "no --requests-sample FILE.jsonl of real request payloads to look at")
    try:
        prompts, malformed = _system_prompts(Path(requests_sample))
    except (OSError, UnicodeDecodeError) as error:
        return Check(name, "skipped", f"cannot read {requests_sample}: {error}")
    unread = f"; {malformed} lines were no request payload with `messages`" if malformed else ""
    if len(prompts) < 2:
        return Check(
            name, "skipped", f"{len(prompts)} requests in {requests_sample}: too few to compare{unread}"
        )
    groups = Counter(prompts)
    if not any(groups):
        return Check(name, "pass", f"none of {len(prompts)} requests starts with a system prompt{unread}")
    if len(groups) == 1:
        size = len(split_words(prompts[0]))
        return Check(
            name, "pass", f"all {len(prompts)} requests share one system prompt of {size} tokens{unread}"
        )
    largest = groups.most_common(1)[0][1]
    summary = (
        f"{len(prompts)} requests, {len(groups)} distinct system prompts; the most common is shared by "
        f"{largest} ({largest / len(prompts):.0%}){unread}"
    )
    distinct = sorted(map(_Prompt.of, groups), key=lambda p: p.tokens)
    found = []  # (first varying token, kind, line) of each prompt that is another one but for a piece
    for a, b in zip(distinct, distinct[1:], strict=False):
        index = _front_variation(a, b)
        if index is not None:
            found += [a.varying(index), b.varying(index)]
    if not found:
        return Check(name, "pass", f"{summary}; no two differ only in a piece before static content")
    token = Counter(index for index, _, _ in found).most_common(1)[0][0]
    kinds = Counter(kind for _, kind, _ in found if kind)
    examples = " vs ".join(f"'{line}'" for line in dict.fromkeys(line for _, _, line in found[:4]))
    what = f"a {kinds.most_common(1)[0][0]}" if kinds else "a piece"
    evidence = (
        f"{summary}; they are one prompt with {what} that varies from token {token} on (words and "
        f"punctuation as the lab counts them; a real tokenizer's index differs somewhat): {examples}"
    )
    fix = (
        "put static content first and dynamic content last: move what changes out of the top of the system "
        "prompt, into the last user message or the end of the system prompt"
    )
    if not kinds:
        return Check(name, "warn", evidence, fix)
    return Check(name, "fail", evidence, fix, "dynamic_prompt_prefix")


# --- the command line -------------------------------------------------------------------------------


def format_diagnosis(diagnosis: Diagnosis) -> str:
    """One block per check, fixes under failures and warnings, then the causes."""
    lines = []
    for check in diagnosis.checks:
        head = f"{check.status.upper():<8} {check.name}: "
        lines += textwrap.wrap(check.evidence, 110, initial_indent=head, subsequent_indent=" " * 9) or [head]
        if check.fix and check.status in ("fail", "warn"):
            lines += textwrap.wrap(
                check.fix, 110, initial_indent=" " * 9 + "fix: ", subsequent_indent=" " * 14
            )
    causes = diagnosis.causes
    lines += ["", f"causes: {', '.join(causes)}" if causes else "no cause found"]
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="find why session affinity or the prefix cache does not work, and say how to fix it",
        description="Walk the troubleshooting checklist against one route: reachability and the base URL, "
        "auth, the response's shape, whether the session id reaches the router and is its hash key, "
        "prefix caching in the engines and, from a sample of request payloads, dynamic content at the "
        "front of the prompts. Each check prints its evidence and fix.",
    )
    parser.add_argument("--base-url", required=True, help="API root, with or without /v1")
    add_model_argument(parser)
    add_api_key_arguments(parser)
    parser.add_argument(
        "--session-header",
        default=ProbeSettings.session_header,
        metavar="H",
        help="session id header, e.g. x-smg-routing-key for SMG (default %(default)s)",
    )
    add_identity_arguments(parser)
    parser.add_argument(
        "--gateway",
        choices=list(affinity.SYSTEMS),
        help="the gateway or router in front of the replicas, whose settings the fixes name "
        "(envoy: Envoy and Istio); by default the one an answer's headers show, else every one",
    )
    blocksize.add_arguments(parser)
    parser.add_argument(
        "--requests-sample",
        metavar="FILE",
        help='JSONL file of real request payloads, one {"messages": [...]} per line',
    )
    parser.add_argument(
        "--timeout", type=float, default=15.0, metavar="S", help="seconds per request (default %(default)g)"
    )
    parser.add_argument(
        "--cluster",
        metavar="NAME",
        help="in a --prometheus of several clusters, read this cluster's engines only (default: every "
        "cluster, each instance named with its own)",
    )
    parser.add_argument(
        "--cluster-label",
        default=CLUSTER_LABEL,
        metavar="LABEL",
        help="the label that tells clusters apart, as cluster_label in kvwatch.yaml (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help='print {"checks": [...], "causes": [...]}')
    parser.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    """`kvwatch doctor`: 1 when a check fails, 2 on bad arguments."""
    try:
        block_sources = blocksize.sources_from_args(args, [args.base_url])
        if args.requests_sample and not Path(args.requests_sample).is_file():
            raise ValueError(f"--requests-sample {args.requests_sample}: no such file")
        if args.cluster is not None and not args.prometheus:
            raise ValueError("--cluster names a cluster in --prometheus: give --prometheus too")
        cluster = Cluster(args.cluster, args.cluster_label)
        api_key = resolve_api_key(args.api_key_env, args.api_key_file)
        probe = ProbeSettings(
            base_url=args.base_url,
            model=chosen_model(args.model, args.base_url, api_key, args.timeout, "doctor"),
            api_key=api_key,
            session_header=args.session_header,
            backend_headers=tuple(args.backend_headers or identity.DEFAULT_HEADERS),
            router=args.router,
            timeout_seconds=args.timeout,
        )
    except ValueError as error:
        print(f"kvwatch doctor: {error}", file=sys.stderr)
        return 2
    with Progress.on_terminal("doctor", "checks", json=args.json) as progress:
        progress.start(CHECKS)
        diagnosis = diagnose(
            probe,
            args.prometheus,
            args.requests_sample,
            block_sources,
            progress.advance,
            args.gateway,
            cluster,
        )
    if args.json:
        print(json.dumps(diagnosis.as_json(), indent=2))
    else:
        print(f"kvwatch doctor: {redact(api_url(probe.base_url, 'chat/completions'))}, model {probe.model}\n")
        print(format_diagnosis(diagnosis))
    return 1 if diagnosis.failed else 0
