"""The doctor's checks of the route, in the order an engineer walks them by hand: can the endpoint be
reached, does it accept the key, does it answer with a completion; then where sessions land: does the
session id reach the router, and is it the router's hash key. Chat requests go through the probe
(collectors.probe), so the doctor sees what `kvwatch probe` and the scheduled probes see, with their
error kinds and redaction."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial

import httpx

from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.blocksize import BlockSize, BlockSizeSources, with_block_size
from kvwatch.collectors.probe.models import NO_COMPLETION, Server, list_models, what_answers
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import ProbeSettings, api_url, run_session
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.workload import Conversation, synthetic
from kvwatch.core.connections import request
from kvwatch.core.redaction import redact
from kvwatch.doctor import affinity, session_keys
from kvwatch.doctor.affinity import dynamo
from kvwatch.doctor.findings import Check

# The error kinds of a round that reached no HTTP server; each is the cause the doctor names.
UNREACHABLE = ("connection_refused", "dns_error", "tls_mismatch", "tls_error", "protocol_error", "timeout")

# Sessions run one after another: behind round robin, as many sessions in lockstep as there are replicas
# would look sticky. Three sessions of four rounds leave a gateway that hashes on something else, over n
# replicas, a chance of 1 in n^9 to keep them all on one backend.
SESSIONS = 3
ROUNDS = 4
SYSTEM_TOKENS = 200
TURN_TOKENS = 40


@dataclass
class Route:
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
    server: Server | None = None  # what answers at the base URL, asked when round 1 got no completion


# --- reachability, auth, response shape -----------------------------------------------------------


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

    They cover a doubled /v1 (…/v1/v1) and a path the server does not serve (…/api when the API is at
    /v1); a pasted endpoint (…/v1/chat/completions) is refused before, by ProbeSettings. A missing /v1
    needs none: kvwatch appends it.
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


async def reachability(route: Route) -> Check:
    """Does an OpenAI-compatible API answer at the base URL? A 404 there tries the variants; a server that
    is no such API is named."""
    name, probe = "reachability", route.probe
    route.first = first = await _one_round(route.streams, probe)
    url = redact(api_url(probe.base_url, "chat/completions"))
    if first.error_kind in UNREACHABLE:
        fix = f"{HINTS[first.error_kind]}; `curl -v {url}` shows which hop fails"
        return Check(name, "fail", first.error_detail, fix, first.error_kind)
    if first.status is None:  # no answer, for a reason that says nothing of the route (a kvwatch bug)
        return Check(name, "skipped", f"not judged: {first.error_kind} ({first.error_detail})")
    if first.error_kind not in NO_COMPLETION:  # a completion, or an answer only an API gives
        return Check(name, "pass", f"HTTP {first.status} from {url}")
    route.server = server = await what_answers(route.client, probe)
    models_url = redact(api_url(probe.base_url, "models"))
    if server.models is not None:
        evidence = f"GET {models_url} {server.models_answer}: the base URL is the API root"
        return Check(name, "pass", f"{evidence} (HTTP {first.status} from {url})")
    if first.error_kind == "not_found" and (moved := await _working_variant(route)):
        return moved
    if problem := server.not_an_api():
        fix = (
            "set the base URL to the API root of the gateway or engine that serves /v1/chat/completions "
            "and /v1/models (vLLM, SGLang, or a gateway in front of them)"
        )
        return Check(name, "fail", problem, fix, "not_openai_api")
    if first.error_kind == "not_found":
        evidence = (
            f"{url} answers HTTP 404, and so does every shorter base URL; GET "
            f"{models_url} {server.models_answer}: the base URL or the model id is wrong"
        )
        return Check(
            name, "warn", evidence, "find the API root: what precedes /chat/completions in a URL that works"
        )
    return Check(name, "pass", f"HTTP {first.status} from {url}, with an OpenAI error object")


async def _working_variant(route: Route) -> Check | None:
    """The failure naming the shorter base URL that works, which the later checks then use; None when
    none does."""
    probe = route.probe
    url = redact(api_url(probe.base_url, "chat/completions"))
    for variant in _base_url_variants(probe.base_url):
        candidate = replace(probe, base_url=variant)
        answer = await _one_round(route.streams, candidate)
        if answer.error_kind not in (*UNREACHABLE, "not_found") or await _models(route.client, candidate):
            route.probe, route.first, route.server = candidate, answer, None
            root = redact(api_url(variant, ""))
            works = redact(api_url(variant, "chat/completions"))
            evidence = (
                f"{url} answers HTTP 404; {works} answers HTTP {answer.status} (the later checks use it)"
            )
            fix = f"set the base URL to {root}, the API root under which /chat/completions and /models live"
            return Check("reachability", "fail", evidence, fix, "bad_base_url")
    return None


async def auth(route: Route) -> Check:
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
    if first.ok:
        return Check("auth", "pass", f"a completion came back {sent} an API key")
    if route.server is not None and route.server.models is not None:
        models_url = redact(api_url(route.probe.base_url, "models"))
        return Check("auth", "pass", f"GET {models_url} {route.server.models_answer} {sent} an API key")
    evidence = f"not judged: no request {sent} an API key got an answer of the API ({first.error_kind})"
    return Check("auth", "skipped", evidence)


async def response_shape(route: Route) -> Check:
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
    server = route.server or await what_answers(route.client, probe)
    models_url = redact(api_url(probe.base_url, "models"))
    if server.models and probe.model in server.models:
        evidence = f"{first.error_detail}; yet GET {models_url} lists {probe.model}"
        return Check(name, "fail", evidence, "route /chat/completions to the engines", "bad_base_url")
    unserved = server.unserved_model(probe.model) or f"GET {models_url} {server.models_answer}"
    evidence = f"{first.error_detail}; {unserved}"
    return Check(name, "fail", evidence, "use a model id exactly as the server lists it", "model_not_found")


# --- where sessions land ----------------------------------------------------------------------------


def _path(session: SessionResult) -> str:
    """The backends a session's rounds landed on, e.g. `r1 x4` or `r1 > r3 > r2 > r1`."""
    backends = session.backends
    if len(set(backends)) == 1:
        return f"{backends[0]} x{len(backends)}"
    return " > ".join(backends) or "unknown"


async def _fixes(route: Route, setting: str) -> str:
    """One setting's fix in the words of the system in front of the replicas: the one --gateway names,
    else the one whose marks an answer's headers carry, else every system's, each named."""
    if not route.systems:
        route.systems = tuple(affinity.SYSTEMS.values())
        if route.gateway:
            route.systems = (affinity.SYSTEMS[route.gateway],)
        elif found := affinity.recognised(await _answer_headers(route)):
            route.systems = (found,)
    return "; ".join(system.fix(setting, route.probe.session_header) for system in route.systems)


async def _answer_headers(route: Route) -> httpx.Headers:
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


async def _sessions(route: Route, probe: ProbeSettings) -> list[SessionResult]:
    """SESSIONS conversations of ROUNDS rounds through the route, one after another, with `probe`'s
    session settings; their ideal cached tokens in the engine's blocks once the block size is known."""
    conversations = synthetic(ROUNDS, SYSTEM_TOKENS, TURN_TOKENS, random.randrange(2**32), SESSIONS)
    sessions = [await run_session(route.streams, probe, c) for c in conversations]
    return with_block_size(sessions, route.block.tokens) if route.block else sessions


async def session_propagation(route: Route) -> Check:
    """Rounds carrying a fixed session id: does the gateway give back the id it was sent?

    It runs the sessions that the hash-key and prefix-caching checks read too.
    """
    name, header = "session id propagation", route.probe.session_header
    sessions = await _sessions(route, route.probe)
    route.block = await blocksize.learn(route.block_sources, sessions)
    route.sessions = with_block_size(sessions, route.block.tokens)
    answered = [r for s in route.sessions for r in s.rounds if r.status is not None]
    failed = [f"{r.error_kind} in round {r.round}" for r in answered if not r.ok]
    errors = f" ({len(failed)} rounds failed: {', '.join(dict.fromkeys(failed))})" if failed else ""
    changed = [r for r in answered if r.session_id_returned not in (None, r.session_id_sent)]
    missing = [r for r in answered if r.session_id_returned is None]
    if not answered:
        return Check(name, "skipped", f"not judged: no round of {SESSIONS} sessions was answered{errors}")
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
    if missing and _behind_dynamo(route):
        evidence = f"not judged: Dynamo returns no {header}; the hash key check judges where sessions landed"
        return Check(name, "skipped", evidence + errors)
    if missing and not any(s.sticky is False for s in route.sessions):
        evidence = (
            f"not judged: {header} is not echoed, and no backend header or cached tokens say where the "
            f"sessions landed{errors}"
        )
        return Check(name, "skipped", evidence, "name the header that names the replica: --backend-header H")
    if missing:
        evidence = (
            f"{header} is not echoed on {len(missing)} of {len(answered)} rounds and sessions changed "
            f"backend: {'; '.join(map(_path, route.sessions))}{errors}"
        )
        fix = f"make every hop forward {header} unchanged: {await _fixes(route, 'forward')}"
        return Check(name, "fail", evidence, fix, "session_id_not_propagated")
    return Check(name, "pass", f"{header} came back unchanged on all {len(answered)} rounds{errors}")


def _pins_reported(sessions: list[SessionResult]) -> str:
    """What the router itself said of the sessions' pins (collectors.sessionkeys: olla's hit, miss,
    repin), to read beside where the rounds landed; "" where no response said."""
    pins = Counter(r.pin_outcome for s in sessions for r in s.rounds if r.pin_outcome)
    counted = ", ".join(f"{outcome} {n}" for outcome, n in sorted(pins.items()))
    return f" (the router reported its pins: {counted})" if pins else ""


async def hash_key(route: Route) -> Check:
    """The id arrives, so rounds of one session landing on different backends mean the key is another:
    maybe another header of the session-key family, which the check then tries (doctor.session_keys)."""
    name, sessions = "hash key", route.sessions
    paths = "; ".join(map(_path, sessions)) + _pins_reported(sessions)
    moved = sum(s.sticky is False for s in sessions)
    run = partial(_sessions, route)
    if moved:
        evidence = f"{moved} of {len(sessions)} sessions changed backend within {ROUNDS} rounds: {paths}"
        if dynamo_sessions := _dynamo_affinity_off(route, evidence):
            return dynamo_sessions
        found = await session_keys.kept_by_another(run, route.probe)
        evidence = f"{evidence}; {found.evidence()}"
        if found.header is not None:
            fix = f"send the session id in {session_keys.named(found.header)}, the header the route keeps"
            return Check(name, "fail", evidence, fix, "session_header_not_the_routes")
        fix = f"hash on the session id: {await _fixes(route, 'hash_on')}"
        return Check(name, "fail", evidence, fix, "hash_key_not_session")
    if any(s.sticky is None for s in sessions):
        headers = ", ".join(route.probe.backend_headers)
        evidence = (
            f"not judged: no response header ({headers}) named the backend and no cached tokens were reported"
        )
        return Check(name, "skipped", evidence, "name the header that names the replica: --backend-header H")
    found = await session_keys.kept_by_sent(run, route.probe)
    kept_by = f"; {found.evidence()}" if found else ""
    return Check(name, "pass", f"each of {len(sessions)} sessions stayed on one backend: {paths}{kept_by}")


def _behind_dynamo(route: Route) -> bool:
    """The route sends Dynamo's session header, or is named as Dynamo (`--gateway`, `router`)."""
    named = "dynamo" in (route.gateway, route.probe.router)
    return named or dynamo.sends_session_header(route.probe.session_header)


def _dynamo_affinity_off(route: Route, evidence: str) -> Check | None:
    """Sessions that moved although they carried Dynamo's session header: its frontend keeps them only
    with an affinity TTL, and treats the header as trace identity without one."""
    header = route.probe.session_header
    if not _behind_dynamo(route):
        return None
    evidence = (
        f"{evidence}; they carried {header}, which Dynamo's frontend honours only when it runs "
        f"{dynamo.TTL_FLAG}: session affinity is off"
    )
    return Check("hash key", "fail", evidence, dynamo.hash_on(header), "dynamo_session_affinity_off")


ROUTE_CHECKS: tuple[tuple[str, Callable[[Route], Awaitable[Check]]], ...] = (
    ("reachability", reachability),
    ("auth", auth),
    ("response shape", response_shape),
    ("session id propagation", session_propagation),
    ("hash key", hash_key),
)
