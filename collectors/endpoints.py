"""kvwatch serve's HTTP side: /metrics, /-/healthy and the Alertmanager webhook that stores alerts for
the dashboard. A module of its own, imported only by `kvwatch serve`: aiohttp takes about 0.4 s of CPU
to import, which every other kvwatch command (and every lab command a test runs) would pay too.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import Counter as MetricCounter

from kvwatch.collectors.config import ExporterSettings
from kvwatch.collectors.store import WriteDropped

log = logging.getLogger("kvwatch.exporter")

REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
ALERT_SINK_KEY = web.AppKey("alert_sink", object)
WEBHOOK_TOKEN_KEY = web.AppKey("webhook_token", object)
REJECTED_ALERTS_KEY = web.AppKey("rejected_alerts", MetricCounter)
MAX_WEBHOOK_BYTES = 4 * 1024 * 1024
MAX_LOGGED_REJECTIONS = 3  # per post: a post of many bad alerts is one warning line, not thousands


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthy(request: web.Request) -> web.Response:
    return web.Response(text="OK\n")


def _authorized(request: web.Request) -> bool:
    """Whether the post carries the configured bearer token (any post, when none is configured).

    Compared in constant time, so the answer's timing says nothing about how much of a guess was right."""
    token = request.app[WEBHOOK_TOKEN_KEY]
    if token is None:
        return True
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    presented = credentials.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented, token.encode())


async def _alerts(request: web.Request) -> web.Response:
    """Alertmanager's webhook: store the alerts so the dashboard can show them next to the data.

    A malformed alert is skipped and counted, and the post still answers 200: Alertmanager does not
    resend a notification refused with a 4xx, so refusing it whole would lose its good alerts."""
    if not _authorized(request):
        log.warning("refused a webhook post from %s: no or wrong bearer token", request.remote)
        return web.json_response(
            {"error": "POST /alerts needs Authorization: Bearer with the configured webhook token"},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    try:
        payload = json.loads(await request.read())
        added = await asyncio.to_thread(request.app[ALERT_SINK_KEY], payload)  # it waits for the store
    except (ValueError, TypeError) as error:
        log.warning("rejected webhook payload: %s", error)
        return web.json_response({"error": f"bad Alertmanager webhook payload: {error}"}, status=400)
    except WriteDropped as error:  # Alertmanager sends the notification again after a 5xx
        return web.json_response({"error": f"cannot store the alerts now: {error}"}, status=503)
    if added.rejected:
        request.app[REJECTED_ALERTS_KEY].inc(len(added.rejected))
        shown = "; ".join(added.rejected[:MAX_LOGGED_REJECTIONS])
        more = len(added.rejected) - MAX_LOGGED_REJECTIONS
        log.warning(
            "skipped %d malformed alerts of a webhook post (stored %d): %s%s",
            len(added.rejected), added.stored, shown, f"; and {more} more" if more > 0 else "",
        )  # fmt: skip
    return web.json_response({"stored": added.stored, "rejected": len(added.rejected)})


def open_webhook_warning(exporter: ExporterSettings, token: str | None) -> str | None:
    """The warning `kvwatch serve` logs at start when anyone beyond this machine may post alerts."""
    if token is not None or _is_loopback(exporter.host):
        return None
    return (
        f"the webhook POST /alerts on {exporter.listen} stores alerts from anyone who can reach it: set "
        "exporter.webhook_token_file (or webhook_token_env) and the same token in Alertmanager's "
        "http_config.authorization"
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def make_app(registry: CollectorRegistry, alert_sink, webhook_token: str | None = None) -> web.Application:
    """/metrics, /-/healthy and POST /alerts, the Alertmanager webhook: `alert_sink(payload)`, called in a
    thread, returns the store's AlertsAdded. With a `webhook_token`, only posts that carry it as a bearer
    token are taken."""
    app = web.Application(client_max_size=MAX_WEBHOOK_BYTES)
    app[REGISTRY_KEY] = registry
    app[ALERT_SINK_KEY] = alert_sink
    app[WEBHOOK_TOKEN_KEY] = webhook_token
    app[REJECTED_ALERTS_KEY] = MetricCounter(
        "kvwatch_webhook_alerts_rejected",
        "Malformed alerts skipped by the webhook (the well-formed alerts of their post are stored).",
        registry=registry,
    )
    app.add_routes(
        [web.get("/metrics", _metrics), web.get("/-/healthy", _healthy), web.post("/alerts", _alerts)]
    )
    return app
