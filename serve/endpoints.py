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
import time
from collections import Counter

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import Counter as MetricCounter

from kvwatch.config.settings import ExporterSettings
from kvwatch.store.history import WriteDropped

log = logging.getLogger("kvwatch.exporter")

REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
ALERT_SINK_KEY = web.AppKey("alert_sink", object)
WEBHOOK_TOKEN_KEY = web.AppKey("webhook_token", object)
REJECTED_ALERTS_KEY = web.AppKey("rejected_alerts", MetricCounter)
MAX_WEBHOOK_BYTES = 4 * 1024 * 1024
MAX_LOGGED_REJECTIONS = 3  # per post: a post of many bad alerts is one warning line, not thousands
# Why a post is refused whole, the reason label of kvwatch_webhook_posts_refused_total.
REFUSALS = ("unauthorized", "too_large", "bad_payload", "store_unavailable")
REFUSAL_LOG_INTERVAL_S = 60.0


class RefusedPosts:
    """Counts every refused webhook post by reason, and logs the first, then at most one line a minute
    with how many were refused since: a sender that retries a bad post cannot flood the log."""

    def __init__(self, registry: CollectorRegistry, clock=time.monotonic) -> None:
        self.counter = MetricCounter(
            "kvwatch_webhook_posts_refused",
            "Webhook posts refused whole (none of their alerts stored), by reason.",
            ["reason"],
            registry=registry,
        )
        for reason in REFUSALS:
            self.counter.labels(reason)
        self.clock = clock
        self.logged_at: float | None = None
        self.since: Counter[str] = Counter()  # refused since the last line, by reason

    def refused(self, reason: str, request: web.Request, detail: str) -> None:
        self.counter.labels(reason).inc()
        self.since[reason] += 1
        now = self.clock()
        if self.logged_at is not None and now - self.logged_at < REFUSAL_LOG_INTERVAL_S:
            return
        count = self.since.total()
        if count == 1:
            log.warning("refused a webhook post from %s: %s", request.remote, detail)
        else:
            reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(self.since.items()))
            log.warning(
                "refused %d webhook posts in the last %.0f s (%s); the latest from %s: %s",
                count, now - self.logged_at, reasons, request.remote, detail,
            )  # fmt: skip
        self.logged_at = now
        self.since.clear()


REFUSED_POSTS_KEY = web.AppKey("refused_posts", RefusedPosts)


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


def _parsed(body: bytes) -> object:
    """The post's JSON. Python's parser recurses, so a document nested deeper than its recursion limit
    is refused as bad JSON (ValueError) rather than escaping as a RecursionError."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError(
            "JSON nested too deep to parse (an Alertmanager payload is a few levels deep)"
        ) from None


async def _alerts(request: web.Request) -> web.Response:
    """Alertmanager's webhook: store the alerts so the dashboard can show them next to the data.

    A malformed alert is skipped and counted, and the post still answers 200: Alertmanager does not
    resend a notification refused with a 4xx, so refusing it whole would lose its good alerts."""
    refused = request.app[REFUSED_POSTS_KEY].refused
    if not _authorized(request):
        refused("unauthorized", request, "no or wrong bearer token")
        return web.json_response(
            {"error": "POST /alerts needs Authorization: Bearer with the configured webhook token"},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    try:
        payload = _parsed(await request.read())
        added = await asyncio.to_thread(request.app[ALERT_SINK_KEY], payload)  # it waits for the store
    except web.HTTPRequestEntityTooLarge:
        refused("too_large", request, f"a body over {MAX_WEBHOOK_BYTES} bytes")
        raise
    except (ValueError, TypeError) as error:
        refused("bad_payload", request, f"bad Alertmanager webhook payload: {error}")
        return web.json_response({"error": f"bad Alertmanager webhook payload: {error}"}, status=400)
    except WriteDropped as error:  # Alertmanager sends the notification again after a 5xx
        refused("store_unavailable", request, f"cannot store the alerts now: {error}")
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
    app[REFUSED_POSTS_KEY] = RefusedPosts(registry)
    app.add_routes(
        [web.get("/metrics", _metrics), web.get("/-/healthy", _healthy), web.post("/alerts", _alerts)]
    )
    return app
