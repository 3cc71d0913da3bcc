"""kvwatch's one exception tree and its one Prometheus client: every exception class kvwatch defines
derives from KVWatchError; only core/promapi.py speaks Prometheus' HTTP API, and it turns each way
Prometheus can fail into one error of the tree."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import pkgutil
import re

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from loopback import QuietHandler, loopback_http

from conftest import behind_a_dead_proxy
from kvwatch.core.connections import request_sync
from kvwatch.core.errors import KVWatchError, QueryRefused, UnexpectedAnswer, Unreachable
from kvwatch.core.promapi import PrometheusApi
from paths import REPO

PACKAGES = sorted(
    p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name not in {"tests", "tools"}
)


def every_module() -> list:
    """Every module of the installed kvwatch packages, imported."""
    modules = []
    for package in PACKAGES:
        top = importlib.import_module(f"kvwatch.{package}")
        modules.append(top)
        for found in pkgutil.walk_packages(top.__path__, f"kvwatch.{package}."):
            if not found.name.endswith("__main__"):
                modules.append(importlib.import_module(found.name))
    return modules


def test_every_exception_kvwatch_defines_derives_from_kvwatch_error():
    defined = {
        cls
        for module in every_module()
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == module.__name__
    }
    assert len(defined) > 15
    assert [c.__qualname__ for c in defined if not issubclass(c, KVWatchError)] == []


def test_only_the_client_speaks_prometheus_http_api():
    """Prometheus' read API, not its remote-write receiver nor an OpenAI-style /api/v1/ of a gateway."""
    endpoint = re.compile(r"/api/v1/(query|series|labels?\b|targets|rules|alerts|metadata|status)")
    speaking = {
        str(path.relative_to(REPO))
        for path in REPO.rglob("*.py")
        if path.relative_to(REPO).parts[0] not in {"tests", ".venv"} and endpoint.search(path.read_text())
    }
    assert speaking == {"core/promapi.py"}


def ask(handler, call):
    """`call(PrometheusApi)` against a server on 127.0.0.1 answering every GET with `handler`."""

    async def scenario():
        app = web.Application()
        app.router.add_get("/{path:.*}", handler)
        async with TestServer(app, host="127.0.0.1") as server:
            prometheus = PrometheusApi(f"http://127.0.0.1:{server.port}/", 5)
            return await asyncio.to_thread(call, prometheus)

    return asyncio.run(scenario())


def answering(body, status: int = 200):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    return handler


def test_a_query_gives_the_series_prometheus_answers():
    series = [{"metric": {"job": "a"}, "value": [1.5, "2"]}]
    found = ask(
        answering({"status": "success", "data": {"resultType": "vector", "result": series}}),
        lambda prometheus: prometheus.query("up", at=1.5),
    )
    assert found == series


@pytest.mark.parametrize(
    ("handler", "error", "message"),
    [
        (
            answering({"status": "error", "errorType": "bad_data", "error": "parse error"}, 400),
            QueryRefused,
            "parse error",
        ),
        (
            answering({"status": "error", "errorType": "execution", "error": "too many"}),
            QueryRefused,
            "too many",
        ),
        (answering({"status": "success", "data": {"result": []}}, 503), QueryRefused, "HTTP 503"),
        (lambda request: web.Response(text="<html>login</html>"), UnexpectedAnswer, "HTTP 200 with no JSON"),
        (answering({"status": "success", "data": {}}), UnexpectedAnswer, "no result"),
        (answering({"status": "success", "data": {"result": [1]}}), UnexpectedAnswer, "not a list of series"),
    ],
    ids=["bad-promql", "error-status", "http-error", "not-json", "no-result", "no-series"],
)
def test_each_failure_is_one_error_of_the_tree(handler, error, message):
    with pytest.raises(error, match=message):
        ask(handler, lambda prometheus: prometheus.query("up"))


def test_a_proxy_in_the_environment_is_not_taken_by_either_client():
    """A machine's HTTP(S)_PROXY (set for pip) would otherwise carry kvwatch's loopback and in-cluster
    requests: the Prometheus client and the httpx clients of core.connections connect directly."""
    series = [{"metric": {}, "value": [1.5, "2"]}]

    def both(prometheus: PrometheusApi) -> tuple[list[dict], int]:
        status = request_sync("GET", f"{prometheus.url}/-/ready", 5).status_code
        return prometheus.query("up"), status

    with behind_a_dead_proxy():
        found = ask(answering({"status": "success", "data": {"result": series}}), both)
    assert found == (series, 200)


class Ready(QuietHandler):
    def do_GET(self) -> None:
        self.answer(200, json.dumps({"status": "success", "data": {"result": []}}).encode())


def test_prometheus_over_tls_is_trusted_by_the_ca_that_every_kvwatch_connection_trusts(
    server_tls, certificate, monkeypatch
):
    """SSL_CERT_FILE names the CA for the probe, the scrapes and Prometheus alike."""
    with loopback_http(Ready, tls=server_tls) as url:
        with pytest.raises(Unreachable, match="certificate verify failed"):
            PrometheusApi(url, 5).query("up")
        monkeypatch.setenv("SSL_CERT_FILE", certificate[0])
        assert PrometheusApi(url, 5).query("up") == []


def test_a_refused_query_keeps_prometheus_error_type():
    refusing = answering({"status": "error", "errorType": "bad_data", "error": "parse error"}, 400)
    with pytest.raises(QueryRefused) as refused:
        ask(refusing, lambda prometheus: prometheus.query_range("up{", 0, 60, 15))
    assert refused.value.error_type == "bad_data"


def test_a_prometheus_that_is_not_there_is_unreachable_with_the_reason():
    with pytest.raises(Unreachable, match="^Connection refused$"):
        PrometheusApi("http://127.0.0.1:1", 5).query("up")
