"""`kvwatch doctor --setup`: kvwatch's own pipeline end to end, one link at a time, the way `promtool` and
`amtool config routes test` check theirs: `kvwatch serve` answers, Prometheus scrapes it and the engines,
evaluates kvwatch's rules and sends alerts to Alertmanager (prometheus.pipeline), Alertmanager routes a
kvwatch alert to kvwatch's webhook with its token, and the store the dashboard reads opens.

A link is OK only on evidence; one that could not be judged is UNKNOWN, never OK."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import Config, resolve_store_password, resolve_webhook_token
from kvwatch.core.connections import connect_reason, request_sync
from kvwatch.core.promapi import PrometheusApi
from kvwatch.core.redaction import redact
from kvwatch.prometheus.pipeline import BROKEN, OK, UNKNOWN, Link, links
from kvwatch.store.databases import ERRORS as STORE_ERRORS
from kvwatch.store.history import Store, StoreError

WEBHOOK_PATH = "/alerts"
# The labels of the alert whose route is tested: kvwatch's page-worthy one.
ROUTED_ALERT = {"alertname": "KVWatchSessionAffinityBroken", "severity": "critical"}
AMTOOL = "amtool"
ANY_INTERFACE = ("0.0.0.0", "::", "")
STORED_SINCE_S = 86400  # the store holds a probe session of the last day


def check_setup(config: Config, timeout_s: float) -> tuple[Link, ...]:
    """Every link of kvwatch's pipeline as `config` sets it up, in pipeline order."""
    return (
        serve_answers(config, timeout_s),
        *prometheus_links(config, timeout_s),
        alertmanager_routes(config, timeout_s),
        store_readable(config),
    )


def serve_answers(config: Config, timeout_s: float) -> Link:
    """`kvwatch serve` answers its health check and serves its series on exporter.listen."""
    name = "kvwatch serve answers"
    host = "127.0.0.1" if config.exporter.host in ANY_INTERFACE else config.exporter.host
    base = f"http://{host}:{config.exporter.port}"
    try:
        request_sync("GET", f"{base}/-/healthy", timeout_s).raise_for_status()
        metrics = request_sync("GET", f"{base}/metrics", timeout_s)
        metrics.raise_for_status()
    except httpx.HTTPStatusError as error:
        return Link(
            name,
            BROKEN,
            f"{error.request.url} answered HTTP {error.response.status_code}.",
            "Is another program listening on exporter.listen? Stop it, or move kvwatch's.",
        )
    except httpx.HTTPError as error:
        return Link(
            name,
            BROKEN,
            f"Nothing answers at {base}: {connect_reason(error)}.",
            "Start `kvwatch serve --config FILE` (exporter.listen is where it listens).",
        )
    if "kvwatch_probe_route_info" not in metrics.text and "kvwatch_gateway_" not in metrics.text:
        return Link(
            name,
            BROKEN,
            f"{base}/metrics serves none of kvwatch's series.",
            "Another program listens on exporter.listen: stop it, or move kvwatch's.",
        )
    return Link(name, OK, f"{base}/-/healthy answers and {base}/metrics serves kvwatch's series.")


def prometheus_links(config: Config, timeout_s: float) -> tuple[Link, ...]:
    """The links Prometheus tells of (prometheus.pipeline); UNKNOWN without a Prometheus URL."""
    if config.prometheus.url is None:
        return (
            Link(
                "Prometheus answers",
                UNKNOWN,
                "No prometheus.url in the config: not asked.",
                "Set prometheus.url to the Prometheus that scrapes kvwatch serve.",
            ),
        )
    store = config.prometheus
    return links(PrometheusApi(store.url, timeout_s, store.rules_url), config.exporter.port)


def alertmanager_routes(config: Config, timeout_s: float) -> Link:
    """Alertmanager's running configuration routes a kvwatch alert to a receiver that posts it to
    kvwatch's webhook, with kvwatch's token when the webhook requires one."""
    name = "Alertmanager routes kvwatch's alerts to its webhook"
    if config.alertmanager.url is None:
        return Link(
            name,
            UNKNOWN,
            "No alertmanager.url in the config: not asked.",
            "Set alertmanager.url to the Alertmanager Prometheus sends alerts to.",
        )
    status_url = f"{config.alertmanager.url.rstrip('/')}/api/v2/status"
    shown_url = redact(status_url)
    try:
        response = request_sync("GET", status_url, timeout_s)
        response.raise_for_status()
        original = response.json()["config"]["original"]
    except httpx.HTTPError as error:
        return Link(
            name,
            BROKEN,
            f"Alertmanager at {shown_url} did not answer: {connect_reason(error)}.",
            "Start Alertmanager, or set alertmanager.url to where it listens.",
        )
    except (ValueError, KeyError, TypeError):
        return Link(name, UNKNOWN, f"{shown_url} did not answer like Alertmanager's v2 API.")
    routed = routed_receivers(name, original, timeout_s)
    if isinstance(routed, Link):
        return routed
    return webhook_link(name, yaml.safe_load(original), routed, config)


def routed_receivers(name: str, original: str, timeout_s: float) -> list[str] | Link:
    """The receivers Alertmanager's configuration routes ROUTED_ALERT to, as `amtool` tests them; the
    link `name`, UNKNOWN, when amtool cannot tell."""
    labels = [f"{key}={value}" for key, value in ROUTED_ALERT.items()]
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as file:
        file.write(original)
        file.flush()
        try:
            tested = subprocess.run(
                [AMTOOL, "config", "routes", "test", f"--config.file={file.name}", *labels],
                capture_output=True,
                text=True,
                timeout=timeout_s * 4,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return Link(
                name,
                UNKNOWN,
                f"Cannot run amtool to test the route: {error}.",
                "Install amtool (Debian: prometheus-alertmanager) on this machine.",
            )
    if tested.returncode != 0:
        said = (tested.stderr or tested.stdout).strip()
        return Link(name, UNKNOWN, f"amtool could not test Alertmanager's configuration: {said}.")
    return [receiver.strip() for receiver in tested.stdout.strip().split(",") if receiver.strip()]


def webhook_link(name: str, alertmanager: dict, routed: list[str], config: Config) -> Link:
    """Whether one of the `routed` receivers posts to kvwatch's webhook, with its token."""
    port, said = config.exporter.port, " ".join(f"{k}={v}" for k, v in ROUTED_ALERT.items())
    hooks = [
        hook
        for receiver in alertmanager.get("receivers") or []
        if receiver.get("name") in routed
        for hook in receiver.get("webhook_configs") or []
        if _is_webhook(str(hook.get("url", "")), port)
    ]
    if not hooks:
        return Link(
            name,
            BROKEN,
            f"Alertmanager routes {said} to {', '.join(routed) or 'no receiver'}, and none posts to "
            f"kvwatch's webhook (port {port}, {WEBHOOK_PATH}): the dashboard never hears of an alert.",
            f"Add a webhook_configs entry with url http://HOST:{port}{WEBHOOK_PATH} to the receiver "
            "the route picks (alerts/alertmanager.yml).",
        )
    try:
        token = resolve_webhook_token(config.exporter)
    except ConfigError as error:
        return Link(name, UNKNOWN, f"Cannot read kvwatch's webhook token: {error}.")
    where = f"receiver {', '.join(routed)}, which posts to {hooks[0]['url']}"
    if token is None:
        return Link(name, OK, f"Alertmanager routes {said} to {where}; the webhook asks no token.")
    return _token_link(name, hooks, token, f"Alertmanager routes {said} to {where}")


def _token_link(name: str, hooks: list[dict], token: str, where: str) -> Link:
    """Whether the webhooks send kvwatch's token: read from their credentials_file where this machine can."""
    fix = (
        "Give the webhook http_config.authorization.credentials_file, a file holding kvwatch's webhook "
        "token (exporter.webhook_token_file)."
    )
    authorizations = [(hook.get("http_config") or {}).get("authorization") or {} for hook in hooks]
    files = [auth["credentials_file"] for auth in authorizations if auth.get("credentials_file")]
    if not files and not any(auth.get("credentials") for auth in authorizations):
        return Link(name, BROKEN, f"{where} without a token: kvwatch's webhook refuses it (401).", fix)
    for path in files:
        try:
            if Path(path).read_text(encoding="utf-8").strip() == token:
                return Link(name, OK, f"{where} with kvwatch's token (from {path}).")
        except OSError:
            continue
    if files and all(Path(path).is_file() for path in files):
        return Link(name, BROKEN, f"{where} with a token that is not kvwatch's ({', '.join(files)}).", fix)
    return Link(
        name,
        UNKNOWN,
        f"{where} with a token this machine cannot read to compare with kvwatch's.",
        "Check that the webhook's credentials hold kvwatch's webhook token.",
    )


def _is_webhook(url: str, port: int) -> bool:
    try:
        parts = urlsplit(url)
        return parts.port == port and parts.path.rstrip("/") == WEBHOOK_PATH
    except ValueError:
        return False


def store_readable(config: Config) -> Link:
    """The store the dashboard reads opens, read-only as the dashboard opens it, and holds probe sessions."""
    name = "The dashboard reads the store"
    settings = config.store
    where = redact(str(settings.location))
    try:
        password = resolve_store_password(settings)
        with Store(settings.location, readonly=True, password=password) as store:
            sessions = store.sessions(since=time.time() - STORED_SINCE_S)
    except (ConfigError, StoreError, *STORE_ERRORS) as error:
        return Link(
            name,
            BROKEN,
            f"Cannot read the store {where}: {error}.",
            "Start `kvwatch serve` with the same config: it creates the store.",
        )
    if config.targets and not sessions:
        return Link(
            name,
            UNKNOWN,
            f"The store {where} opens but holds no probe session of the "
            "last day yet: run this again after the first probe interval.",
        )
    return Link(
        name, OK, f"The store {where} opens and holds {len(sessions)} probe sessions of the last day."
    )
