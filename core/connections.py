"""Why a URL cannot be requested, or why a connection failed, in one line: what the probe and the
scrape say where the HTTP client would raise a traceback or give a generic or misleading reason. And
one HTTP exchange bounded as a whole, for every kvwatch request that is no probe round nor scrape."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import ssl

import httpx

from kvwatch.core.redaction import redact


def url_problem(url: str) -> str | None:
    """Why `url` cannot be requested (httpx accepts a port of 99999 and fails on it only when it
    connects, with a traceback); None when nothing is wrong with it."""
    try:
        parsed = httpx.URL(url)
        host, port = parsed.host, parsed.port  # reading the host decodes it (IDNA)
    except (httpx.InvalidURL, ValueError) as error:  # a port that is no number, a malformed IDNA name
        return str(error)
    if not host:
        return "no host"
    if port is not None and not 0 < port < 65536:
        return f"port {port} is not 1 to 65535"
    return None


# What a base URL may end in by mistake: an endpoint pasted from a client's code or a curl line.
ENDPOINTS = ("/chat/completions", "/completions", "/models")


def endpoint_problem(base_url: str) -> str | None:
    """Why `base_url` is no API root: it ends in an endpoint, under which kvwatch would append its own
    (…/v1/chat/completions/v1/chat/completions, a plain 404). None when it ends in none."""
    parsed = httpx.URL(base_url)
    path = parsed.path.rstrip("/")
    ending = next((end for end in ENDPOINTS if path.endswith(end)), None)
    if ending is None:
        return None
    root = parsed.copy_with(path=path.removesuffix(ending) or "/")
    return (
        f"ends in {ending}, an endpoint: give the API root, {redact(str(root).rstrip('/'))} (kvwatch appends "
        "/chat/completions and /models to it)"
    )


def connect_reason(error: BaseException) -> str:
    """The operating system's or TLS's reason under httpx's generic "All connection attempts failed"."""
    while (cause := error.__cause__ or error.__context__) is not None:
        error = cause
    if isinstance(error, socket.gaierror):  # "Name or service not known" reads like a missing service
        return f"the host name does not resolve ({error.strerror})"
    if isinstance(error, ssl.SSLCertVerificationError):  # OpenSSL's why: self-signed, hostname mismatch
        return f"TLS handshake failed: certificate verify failed: {error.verify_message}"
    if isinstance(error, ssl.SSLError):  # an OSError whose errno 1 would read "Operation not permitted"
        if error.reason == "WRONG_VERSION_NUMBER":  # the answer to its hello was no TLS record
            return "TLS handshake failed: is the server speaking plain HTTP?"
        return f"TLS handshake failed: {error.reason or error}"
    if isinstance(error, OSError) and error.errno:
        return os.strerror(error.errno) if error.errno > 0 else str(error.strerror)
    return str(error)


async def request(
    client: httpx.AsyncClient, method: str, url: str, deadline_s: float, **options
) -> httpx.Response:
    """`client.request` ended after `deadline_s` in all, the body included: httpx's timeouts bound each
    read, so a server that sends a byte now and then would hold it open forever. Raises
    httpx.TimeoutException, as for a read timeout, so that callers need no other handler."""
    try:
        async with asyncio.timeout(deadline_s):
            return await client.request(method, url, **options)
    except TimeoutError:
        raise httpx.TimeoutException(f"no complete answer within {deadline_s:g} s") from None


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One verifying TLS context for the whole process. httpx would build one per client, loading the
    CA bundle each time (about 50 ms of CPU), and a lab poll, a dashboard query or a probe run each
    makes a client (the probe's own, collectors.streaming, uses it too)."""
    return httpx.create_ssl_context()


def http_client(**options) -> httpx.AsyncClient:
    """An httpx.AsyncClient (the options are its own) that shares the process's TLS context and connects
    where it is told: HTTP(S)_PROXY and ALL_PROXY are not read, as the probe's own client and Prometheus
    (without proxy_from_environment) do not, so that a proxy set for pip or curl cannot send kvwatch's
    loopback and in-cluster requests through itself."""
    return httpx.AsyncClient(verify=tls_context(), trust_env=False, **options)


def request_sync(method: str, url: str, deadline_s: float, **options) -> httpx.Response:
    """`request` for code that runs no event loop (the dashboard, the lab, the board preview)."""

    async def exchange() -> httpx.Response:
        async with http_client(timeout=deadline_s) as http:
            return await request(http, method, url, deadline_s, **options)

    return asyncio.run(exchange())
