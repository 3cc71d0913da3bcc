"""The probe's HTTP/1.1 client, built so that its own overhead stays out of the TTFT it measures.

Every received chunk is stamped with the time it arrived, in the event loop's read callback, before any
parsing: a round's first token is dated by its bytes, not by when a busy loop got round to parsing them.
The request goes out as one write of bytes prepared before the clock starts, on a kept-alive connection
of the client's pool, so a round pays no set-up either. h11 does the HTTP/1.1 framing.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import select
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import h11
import httpx

from kvwatch.collectors.connections import connect_reason, tls_context

READ_BYTES = 64 << 10  # how much h11 hands over at once: a streamed chunk is a few hundred bytes
MAX_HEADER_BYTES = 64 << 10  # of the status line and headers; more is no HTTP server kvwatch probes


class ConnectFailed(Exception):
    """No connection to the origin; the message is the operating system's or TLS's reason."""


class StreamBroken(Exception):
    """The server broke HTTP/1.1 or the connection before the response was complete."""


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int


class _Connection(asyncio.Protocol):
    """One connection: what arrived, each piece with its arrival time, and h11's view of the exchange."""

    def __init__(self) -> None:
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.transport: asyncio.Transport | None = None
        self.arrived: deque[tuple[float, bytes]] = deque()
        self.ended: BaseException | None = None  # why no more bytes will come
        self.fed_at = 0.0  # when the bytes h11 parses now arrived
        self._end_fed = False  # h11 was told that no more bytes will come
        self._wakeup = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.arrived.append((time.perf_counter(), data))
        self._wakeup.set()

    def eof_received(self) -> bool:
        self.ended = self.ended or StreamBroken("the server closed the connection")
        self._wakeup.set()
        return False

    def connection_lost(self, error: Exception | None) -> None:
        reason = f"the connection was lost: {connect_reason(error)}" if error else "the connection was closed"
        self.ended = self.ended or StreamBroken(reason)
        self._wakeup.set()

    @property
    def reusable(self) -> bool:
        """Idle and quiet: a server that closed a kept-alive connection (or sent something unasked) has
        made its socket readable, which the loop may not have told this protocol yet."""
        if self.ended is not None or self.arrived or self.http.our_state is not h11.IDLE:
            return False
        readable, _, _ = select.select([self.transport.get_extra_info("socket")], [], [], 0)
        return not readable

    async def next_event(self) -> tuple[h11.Event, float]:
        """h11's next event of the response, with the arrival time of the bytes that completed it."""
        while True:
            try:
                event = self.http.next_event()
            except h11.RemoteProtocolError as error:
                if self._end_fed:  # h11 found the answer incomplete at the close
                    raise self.ended from None
                raise StreamBroken(f"not HTTP/1.1: {error}") from None
            if event is not h11.NEED_DATA:
                return event, self.fed_at
            if self.arrived:
                self.fed_at, data = self.arrived.popleft()
                self.http.receive_data(data)
            elif self.ended is not None:
                self.http.receive_data(b"")  # h11 tells a complete close-delimited body from a cut one
                self._end_fed = True
            else:
                self._wakeup.clear()
                await self._wakeup.wait()


class Response:
    """A response whose status and headers have arrived; its body comes as it arrives."""

    def __init__(self, connection: _Connection, head: h11.Response, sent_at: float) -> None:
        self.status = head.status_code
        self.headers = httpx.Headers(
            [(name.decode("latin-1"), value.decode("latin-1")) for name, value in head.headers]
        )
        self.sent_at = sent_at  # perf_counter when the request was written
        self._connection = connection

    async def chunks(self) -> AsyncIterator[tuple[bytes, float]]:
        """The body's pieces, each with the perf_counter time its bytes arrived."""
        while True:
            event, arrived_at = await self._connection.next_event()
            if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return
            if isinstance(event, h11.Data):
                yield bytes(event.data), arrived_at

    async def finish(self) -> None:
        """Read the rest of the body, unseen, so that the connection can take the next request."""
        async for _ in self.chunks():
            pass


class StreamClient:
    """Kept-alive HTTP/1.1 connections per origin, shared by every session of a run; the callers bound
    how many are in flight. Verifies TLS with the process's one context (collectors.connections)."""

    def __init__(self) -> None:
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for connection in self._open:
            connection.transport.close()
        self._open.clear()
        self._idle.clear()

    @asynccontextmanager
    async def stream(self, url: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[Response]:
        """POST `body` to `url` and yield the response once its head has arrived.

        The clock (Response.sent_at) starts when the prepared request is written, on a connection that
        is already open. Raises ConnectFailed or StreamBroken; a timeout is the caller's to set."""
        origin, target, fields = _request_line(url)
        fields = {**fields, **headers, "Content-Length": str(len(body))}  # an API key's beats the URL's
        connection = await self._connection(origin)
        try:
            request = connection.http.send(
                h11.Request(method="POST", target=target, headers=list(fields.items()))
            )
            request += connection.http.send(h11.Data(data=body)) + connection.http.send(h11.EndOfMessage())
            sent_at = time.perf_counter()
            connection.transport.write(request)
            head, _ = await connection.next_event()
            while isinstance(head, h11.InformationalResponse):  # 100 Continue and the like
                head, _ = await connection.next_event()
            if not isinstance(head, h11.Response):  # h11.ConnectionClosed
                raise connection.ended or StreamBroken("the server closed the connection")
            yield Response(connection, head, sent_at)
        finally:
            self._release(origin, connection)

    async def _connection(self, origin: _Origin) -> _Connection:
        idle = self._idle.get(origin, [])
        while idle:
            connection = idle.pop()
            if connection.reusable:
                return connection
            self._discard(connection)
        loop = asyncio.get_running_loop()
        tls = tls_context() if origin.scheme == "https" else None
        try:
            _, connection = await loop.create_connection(
                _Connection, origin.host, origin.port, ssl=tls, server_hostname=origin.host if tls else None
            )
        except OSError as error:  # ssl.SSLError and a name that does not resolve included
            raise ConnectFailed(connect_reason(error)) from None
        self._open.add(connection)
        return connection

    def _release(self, origin: _Origin, connection: _Connection) -> None:
        """Keep the connection for the next request when its exchange ended cleanly, else close it."""
        http = connection.http
        if http.our_state is h11.DONE and http.their_state is h11.DONE and connection.ended is None:
            http.start_next_cycle()
            self._idle.setdefault(origin, []).append(connection)
        else:
            self._discard(connection)

    def _discard(self, connection: _Connection) -> None:
        connection.transport.close()
        self._open.discard(connection)


_PORTS = {"http": 80, "https": 443}


@functools.lru_cache(maxsize=256)
def _request_line(url: str) -> tuple[_Origin, bytes, dict[str, str]]:
    """Where a request to `url` goes, its target and the header fields it implies, parsed once per URL
    (a run requests the same few URLs over and over)."""
    parsed = httpx.URL(url)
    origin = _Origin(parsed.scheme, parsed.raw_host.decode("ascii"), parsed.port or _PORTS[parsed.scheme])
    fields = {"Host": _host_header(origin), "User-Agent": "kvwatch"}
    if parsed.username:  # user:password@ in the URL, taken as httpx and curl take it
        credentials = f"{parsed.username}:{parsed.password}".encode()
        fields["Authorization"] = "Basic " + base64.b64encode(credentials).decode("ascii")
    return origin, parsed.raw_path, fields


def _host_header(origin: _Origin) -> str:
    host = f"[{origin.host}]" if ":" in origin.host else origin.host  # an IPv6 address
    return host if origin.port == _PORTS[origin.scheme] else f"{host}:{origin.port}"
