"""What `kvwatch init` learns before it writes anything: the models a route serves, how its gateway treats
session ids, which identity convention names the replica, and the engines and routers a Prometheus
already scrapes with their KV block size. Everything is looked at, nothing assumed silently: what could
not be learned is said in `assumed`, for the summary."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx

from kvwatch.collectors import identity, sessionkeys
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.models import list_models, listing_failed
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import ProbeSettings, api_url, run_session
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.core.connections import connect_reason, http_client, request
from kvwatch.core.errors import KVWatchError, UpstreamError
from kvwatch.core.promapi import PrometheusApi
from kvwatch.core.redaction import redact
from kvwatch.prometheus.queries import ENGINE_PRESENCE_SERIES, ENGINE_TARGETS, ROUTER_TARGETS

TIMEOUT_S = 15.0
# A short real conversation: enough rounds to see the id come back and the replica stay or move.
ROUNDS = ("Say hello.", "Say it again.", "Once more.")
# How a router routes where it is not by the usual session affinity; the header it routes on is its
# session key's (collectors.sessionkeys), kvwatch's X-Session-Id for a gateway that has none.
ROUTE_MODES = {"smg": "manual"}  # SMG's manual policy pins a routing key to a worker
DEFAULT_ROUTE_MODE = "affinity"


class SurveyError(KVWatchError, ValueError):
    """The route cannot be looked at: no model list, no answer. Said with what was tried."""


@dataclass(frozen=True)
class Request:
    """What the user told `kvwatch init`."""

    base_url: str
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    prometheus_url: str | None = None
    gateway: str | None = None  # the gateway or router kind, e.g. nginx, envoy, smg
    engines: tuple[str, ...] = ()  # host:port of engines to scrape, besides those Prometheus knows

    @property
    def session_header(self) -> str:
        return sessionkeys.SESSION_KEYS.get(self.gateway or "", sessionkeys.DEFAULT).header

    @property
    def route_mode(self) -> str:
        """How the gateway picks a replica, as far as its kind says; sticky unless told otherwise."""
        return ROUTE_MODES.get(self.gateway or "", DEFAULT_ROUTE_MODE)


@dataclass(frozen=True)
class Target:
    """A scrape target Prometheus already has: its address, job, and the name the pages give it."""

    instance: str
    job: str
    replica: str | None = None  # its `replica` (else `pod`) label, when it has one
    flavour: str | None = None  # vllm or sglang, for an engine


@dataclass
class Survey:
    """What was found, and in `assumed` every guess the config rests on."""

    request: Request
    models: list[str] = field(default_factory=list)
    model: str = ""
    session_mode: str = "client"
    session_echoed: bool | None = None
    session_assigned: bool = False
    identity_header: str | None = None  # the response header that named the replica
    identity_convention: str | None = None
    backends: tuple[str, ...] = ()  # the replicas the probe's rounds landed on
    sticky: bool | None = None
    engines: list[Target] = field(default_factory=list)
    routers: list[Target] = field(default_factory=list)
    block: blocksize.BlockSize | None = None
    assumed: list[str] = field(default_factory=list)


def survey(wanted: Request) -> Survey:
    """Look at the route and at Prometheus; SurveyError when the route gives no model or no answer."""
    return asyncio.run(_survey(wanted))


async def _survey(wanted: Request) -> Survey:
    found = Survey(wanted)
    async with http_client(timeout=TIMEOUT_S) as client:
        found.models = await _models(client, wanted)
        found.model = _pick_model(found, wanted.model)
        settings = ProbeSettings(
            base_url=wanted.base_url,
            model=found.model,
            api_key=wanted.api_key,
            session_header=wanted.session_header,
            timeout_seconds=TIMEOUT_S,
        )
        await _identity(client, settings, found)
    await _sessions(settings, found)
    if wanted.prometheus_url:
        await _scraped(wanted.prometheus_url, found)
    else:
        found.assumed.append("no --prometheus: the engines are only those given with --engine")
    sources = blocksize.sources_for([wanted.base_url], wanted.prometheus_url)
    found.block = await blocksize.learn(sources, [])
    if found.block.source.startswith("default"):
        found.assumed.append(
            f"the KV block size: no engine told it, so {found.block.tokens} tokens; each probe run looks "
            "again (set block_size in the config if your engines use another)"
        )
    return found


async def _models(client: httpx.AsyncClient, wanted: Request) -> list[str]:
    url = redact(api_url(wanted.base_url, "models"))
    try:
        return await list_models(client, wanted.base_url, wanted.api_key, TIMEOUT_S)
    except (httpx.HTTPError, ValueError) as error:
        raise SurveyError(f"GET {url} {listing_failed(error)}") from None


def _pick_model(found: Survey, model: str | None) -> str:
    if model:
        if model not in found.models:
            raise SurveyError(f"model {model} is not among those the route lists: {', '.join(found.models)}")
        return model
    if not found.models:
        raise SurveyError("the route lists no model: name one with --model")
    if len(found.models) > 1:
        found.assumed.append(f"model {found.models[0]}, the first of {len(found.models)} listed (--model)")
    return found.models[0]


async def _identity(client: httpx.AsyncClient, settings: ProbeSettings, found: Survey) -> None:
    """One short answer without a session id: does the gateway assign one, and which header names the
    replica (the first of the identity conventions' headers that the answer carries)."""
    body = {"model": settings.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    url = api_url(settings.base_url, "chat/completions")
    try:
        answer = await request(client, "POST", url, TIMEOUT_S, json=body, headers=headers)
    except httpx.HTTPError as error:
        raise SurveyError(f"POST {redact(url)} failed: {connect_reason(error)}") from None
    if answer.status_code != 200:
        raise SurveyError(f"POST {redact(url)} answered HTTP {answer.status_code} for model {settings.model}")
    found.session_assigned = bool(answer.headers.get(settings.session_header))
    for convention in identity.CONVENTIONS.values():
        present = [name for name in convention.headers if answer.headers.get(name)]
        if present:
            found.identity_header, found.identity_convention = present[0], convention.name
            return
    found.assumed.append(
        f"no response header names the replica ({', '.join(identity.DEFAULT_HEADERS)}): stickiness is "
        "judged from cached tokens; have the gateway add one (nginx: add_header X-Upstream $upstream_addr)"
    )


async def _sessions(settings: ProbeSettings, found: Survey) -> None:
    """A short real session with a client-made id: is the id echoed, does it stay on one replica."""
    async with StreamClient() as streams:
        session = await run_session(streams, settings, Conversation("You are brief.", ROUNDS))
    if not session.ok:
        first = next(r for r in session.rounds if not r.ok)
        hint = f"; {HINTS[first.error_kind]}" if first.error_kind in HINTS else ""
        raise SurveyError(
            f"a probe session failed in round {first.round}: {first.error_kind} ({first.error_detail}){hint}"
        )
    found.session_echoed, found.backends, found.sticky = (
        session.session_id_echoed,
        session.backends,
        session.sticky,
    )
    if found.sticky is False:
        found.assumed.append(
            "the probe session moved between replicas: if this route does not pin sessions, say so with "
            "--route-mode round_robin (or cache_aware, random), else the affinity alert fires at once"
        )
    header = settings.session_header
    if found.session_echoed:
        return
    if found.session_assigned:
        found.session_mode = "server"
        found.assumed.append(f"the gateway sets its own {header}: the probe adopts it (session.mode: server)")
    else:
        found.assumed.append(
            f"{header} is not echoed: kvwatch cannot see whether it reaches the router (check with "
            "`kvwatch doctor`)"
        )


async def _scraped(url: str, found: Survey) -> None:
    """The engines and routers Prometheus scrapes now; said in `assumed` when it cannot be asked."""
    api = PrometheusApi(url, TIMEOUT_S)
    try:
        engines = await asyncio.to_thread(api.query, ENGINE_TARGETS)
        routers = await asyncio.to_thread(api.query, ROUTER_TARGETS)
    except UpstreamError as error:
        found.assumed.append(f"Prometheus at {redact(url)} could not be asked ({error}): no engines listed")
        return
    found.engines = sorted({_target(s["metric"]) for s in engines}, key=lambda t: (t.job, t.instance))
    found.routers = sorted({_target(s["metric"]) for s in routers}, key=lambda t: (t.job, t.instance))
    renamed = sorted({s["metric"].get("__name__", "") for s in engines} - {"", *ENGINE_PRESENCE_SERIES[::2]})
    if renamed:
        found.assumed.append(
            f"the engines' metric names arrive with ':' rewritten ({', '.join(renamed)}): kvwatch's rules "
            "read the names the engines export, so keep them unchanged"
        )
    if not found.engines:
        names = ", ".join(ENGINE_PRESENCE_SERIES[::2])
        found.assumed.append(
            f"Prometheus at {redact(url)} holds no engine series ({names}): list them with --engine"
        )


def _target(labels: dict[str, str]) -> Target:
    name = labels.get("__name__", "")
    flavour = name.split(":")[0].split("_")[0] or None
    return Target(
        labels.get("instance", ""), labels.get("job", ""), labels.get("replica") or labels.get("pod"), flavour
    )
