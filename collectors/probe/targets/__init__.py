"""Target kinds: how a probe's rounds reach a route. One module per kind behind one small interface
(TargetKind), one registry (KINDS); the config refuses any other kind, naming these.

- openai: an OpenAI-compatible route over HTTP (a gateway or router in front of vLLM / SGLang).
- sagemaker: an Amazon SageMaker endpoint through its runtime API, with stateful sessions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

from kvwatch.collectors.probe.conversation import Exchange, run_conversation
from kvwatch.collectors.probe.records import SessionResult
from kvwatch.collectors.probe.session import ProbeSettings, RoundFailure, failed_run
from kvwatch.collectors.probe.targets import openai, sagemaker
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.core.registry import Registry, unknown


class Client(Protocol):
    """What a kind's sessions share within a run (connections, a thread pool), closed at its end."""

    async def aclose(self) -> None: ...


class TargetKind(Protocol):
    name: str
    # Whether the route's origin serves the engines' /metrics, where the block size may be learned.
    serves_metrics: bool
    # The header a session id travels in unless the target names another (ProbeSettings.session_header).
    session_header: str

    def client_key(self, settings: ProbeSettings) -> Hashable:
        """What tells apart the clients this kind needs: settings with the same key share one."""

    def client(self, settings: ProbeSettings) -> Client:
        """A new client for the settings' route."""

    def exchange(self, client: Client, settings: ProbeSettings) -> Exchange:
        """One conversation's exchange over `client`."""


KINDS: Registry[TargetKind] = Registry("target kind", (openai.KIND, sagemaker.KIND))


class ProbeClients:
    """The clients of a run's (or a service's) sessions: one per kind and route, closed together."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, Hashable], Client] = {}

    async def __aenter__(self) -> ProbeClients:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def for_settings(self, settings: ProbeSettings) -> Client:
        kind = KINDS.lookup(settings.kind)
        key = (kind.name, kind.client_key(settings))
        if key not in self._clients:
            self._clients[key] = kind.client(settings)
        return self._clients[key]

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


async def run_target_session(
    clients: ProbeClients, settings: ProbeSettings, conversation: Conversation, **options
) -> SessionResult:
    """One conversation through the settings' route, whatever its kind (conversation.run_conversation's
    options: think_seconds, stop, on_round...)."""
    kind = KINDS.lookup(settings.kind)
    try:
        client = clients.for_settings(settings)
    except RoundFailure as failure:  # no client to send with (an AWS profile that is not there)
        return failed_run(settings, failure, time.time())
    return await run_conversation(kind.exchange(client, settings), settings, conversation, **options)


async def run_sessions(
    settings: ProbeSettings,
    conversations: Iterable[Conversation],
    concurrency: int = 1,
    on_session: Callable[[SessionResult], None] | None = None,
) -> list[SessionResult]:
    """Every conversation once, `concurrency` at a time, over one client; `on_session` is told of each
    session as it ends (a progress line)."""
    if concurrency < 1:
        raise ValueError("concurrency must be positive")
    gate = asyncio.Semaphore(concurrency)
    async with ProbeClients() as clients:

        async def one(conversation: Conversation) -> SessionResult:
            async with gate:
                session = await run_target_session(clients, settings, conversation)
            if on_session is not None:
                on_session(session)
            return session

        return list(await asyncio.gather(*map(one, conversations)))


def probe_once(
    settings: ProbeSettings,
    conversations: Iterable[Conversation],
    concurrency: int = 1,
    on_session: Callable[[SessionResult], None] | None = None,
) -> list[SessionResult]:
    """run_sessions for synchronous callers (the CLI)."""
    return asyncio.run(run_sessions(settings, conversations, concurrency, on_session))


def metrics_base_urls(settings: ProbeSettings) -> list[str]:
    """Where the engines' /metrics may be read for the block size: the route's origin, for kinds that
    serve them there; none for the others (their sessions' cached tokens tell it)."""
    return [settings.base_url] if KINDS.lookup(settings.kind).serves_metrics else []


def target_problem(
    kind: str, base_url: str, model: str, endpoint: sagemaker.SageMakerEndpoint | None
) -> tuple[str, str] | None:
    """What keeps a configured target of `kind` from working, as (key, message); None when nothing.
    An openai target names its base_url; a sagemaker target its endpoint, whose URL is its base_url."""
    if kind not in KINDS:
        return "kind", unknown("target kind", kind, KINDS)
    if kind == "sagemaker":
        if endpoint is None:
            return "sagemaker", "required for kind sagemaker (endpoint_name, region)"
        if base_url and base_url != endpoint.base_url:
            return "base_url", "a sagemaker target's URL is its endpoint's: set sagemaker.endpoint_url"
    elif endpoint is not None:
        return "sagemaker", f"only for kind sagemaker, not {kind}"
    elif not base_url:
        return "base_url", "required key is missing"
    return None if model else ("model", "required key is missing")
