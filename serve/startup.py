"""What `kvwatch serve` needs before it starts, read and checked in one place that `kvwatch config check`
runs too, so that a config the check passes is one serve starts with: the secrets the config names (API
keys, the webhook token, the store's password), the ShareGPT files, the exporter's address (it must be
free to bind) and, when all of these are right, the store (opened, or created, as serve opens it). Every
problem is reported, each in one line.

`online_problems` adds what only the network can say (`config check --online`; serve itself starts without
it, and its probes and the doctor report an unreachable service as they run): each target lists its model,
Prometheus answers a query, Alertmanager its status.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import httpx

from kvwatch.collectors.probe import workload
from kvwatch.collectors.probe.models import list_models, listing_failed
from kvwatch.collectors.probe.session import api_url
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import (
    Config,
    ExporterSettings,
    Target,
    resolve_api_key,
    resolve_store_password,
    resolve_webhook_token,
)
from kvwatch.core.connections import connect_reason, http_client, request
from kvwatch.core.errors import KVWatchError
from kvwatch.core.promapi import PrometheusApi
from kvwatch.core.redaction import redact
from kvwatch.serve import shard
from kvwatch.store.history import Store, StoreError

ONLINE_DEADLINE_SECONDS = 10.0


class StartRefused(ConfigError):
    """`kvwatch serve` cannot start with this config here: `problems` says why, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass
class Prepared:
    """What serve starts with: each target's API key and ShareGPT conversations (None: synthetic), the
    webhook's token and the open store."""

    api_keys: dict[str, str | None]
    sharegpt: dict[str, list[workload.Conversation] | None]
    webhook_token: str | None
    store: Store


def prepare(config: Config, part: shard.Shard = shard.WHOLE, *, listen: bool = False) -> Prepared:
    """Everything serve reads before it starts, for the targets of shard `part`; StartRefused with every
    problem. With `listen`, the exporter's address is bound and released too (the command does; a
    Service built in a test binds its own when it runs)."""
    problems: list[str] = []

    def attempt(read, *args):
        try:
            return read(*args)
        except (ConfigError, ValueError) as error:
            problems.append(str(error))
            return None

    targets = part.select(config.targets)
    api_keys = {t.name: attempt(resolve_api_key, t) for t in targets}
    sharegpt = {t.name: attempt(_conversations, t) for t in targets}
    webhook_token = attempt(resolve_webhook_token, config.exporter)
    password = attempt(resolve_store_password, config.store)
    if listen and (wrong := listen_problem(config.exporter)):
        problems.append(wrong)
    if problems:  # the store is opened (and created) only for a config that can start
        raise StartRefused(problems)
    try:
        store = Store(config.store.location, config.store.retention_days, password=password)
    except StoreError as error:
        raise StartRefused([str(error)]) from None
    return Prepared(api_keys, sharegpt, webhook_token, store)


def _conversations(target: Target) -> list[workload.Conversation] | None:
    spec = target.workload
    return None if spec.sharegpt is None else workload.load_sharegpt(spec.sharegpt, seed=spec.seed)


def listen_problem(exporter: ExporterSettings) -> str | None:
    """Why the exporter cannot listen on its address (taken, no such local address, a name that does not
    resolve); None when a bind succeeds. The socket is released at once, set up as aiohttp sets its own."""
    try:
        addresses = socket.getaddrinfo(exporter.host, exporter.port, type=socket.SOCK_STREAM)
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
    except OSError as error:
        return cannot_listen(exporter, error)
    return None


def cannot_listen(exporter: ExporterSettings, error: OSError) -> str:
    """The one message for an address the exporter cannot listen on, at the check or at the real bind."""
    return f"cannot listen on {exporter.listen}: {error.strerror or error}"


def online_problems(config: Config, api_keys: dict[str, str | None]) -> list[str]:
    """What the network says: each OpenAI-compatible target (with its key from `api_keys`) lists its model
    (a SageMaker endpoint has no model list), Prometheus and Alertmanager answer. One line per service
    that does not."""
    targets = [t for t in config.targets if t.name in api_keys and t.kind == "openai"]
    problems = asyncio.run(_targets_problems(targets, api_keys))
    if config.prometheus.url and (wrong := _prometheus_problem(config.prometheus.url)):
        problems.append(wrong)
    if config.alertmanager.url and (wrong := _alertmanager_problem(config.alertmanager.url)):
        problems.append(wrong)
    return problems


async def _targets_problems(targets: list[Target], api_keys: dict[str, str | None]) -> list[str]:
    async with http_client(timeout=ONLINE_DEADLINE_SECONDS) as client:
        found = await asyncio.gather(*(_target_problem(client, t, api_keys[t.name]) for t in targets))
    return [problem for problem in found if problem]


async def _target_problem(client: httpx.AsyncClient, target: Target, api_key: str | None) -> str | None:
    url = redact(api_url(target.base_url, "models"))
    try:
        models = await list_models(client, target.base_url, api_key, ONLINE_DEADLINE_SECONDS)
    except (httpx.HTTPError, ValueError) as error:
        reason = listing_failed(error)
    else:
        if target.model in models:
            return None
        reason = f"does not list model {target.model} (it lists: {', '.join(models[:20]) or 'none'})"
    return f"target {target.name}: GET {url} {reason}"


def _prometheus_problem(url: str) -> str | None:
    try:
        PrometheusApi(url, ONLINE_DEADLINE_SECONDS).query("vector(1)")
    except KVWatchError as error:
        return f"prometheus.url: {redact(url)} does not answer a query: {error}"
    return None


def _alertmanager_problem(url: str) -> str | None:
    status = f"{url.rstrip('/')}/api/v2/status"

    async def ask() -> httpx.Response:
        async with http_client(timeout=ONLINE_DEADLINE_SECONDS) as client:
            return await request(client, "GET", status, ONLINE_DEADLINE_SECONDS)

    try:
        answer = asyncio.run(ask())
    except httpx.TimeoutException as error:
        reason = f"failed: {error}"
    except httpx.HTTPError as error:
        reason = f"failed: {connect_reason(error)}"
    else:
        if answer.status_code != 200:
            reason = f"answered HTTP {answer.status_code}"
        elif _is_alertmanager_status(answer):
            return None
        else:
            reason = "answered, but not with Alertmanager's status (no `cluster` in it)"
    return f"alertmanager.url: GET {redact(status)} {reason}"


def _is_alertmanager_status(answer: httpx.Response) -> bool:
    try:
        body = answer.json()
    except ValueError:
        return False
    return isinstance(body, dict) and "cluster" in body
