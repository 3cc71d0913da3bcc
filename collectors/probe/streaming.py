"""The probe's HTTP/1.1 client, built so that its own overhead stays out of the TTFT it measures.

Every received piece is dated by when the kernel received its bytes (SO_TIMESTAMPNS on Linux; where
there is none, when the event loop read them), before any parsing or TLS: a round's first token is dated
by its bytes, not by when a busy loop got round to reading and parsing them. A read that takes in
several segments at once is dated by the last of them, so a late loop can only make a first token that
arrived together with later ones look as late as those. The request goes out as one write of bytes
prepared before the clock starts, on a kept-alive connection of the client's pool, so a round pays no
set-up either. h11 does the HTTP/1.1 framing; TLS runs through memory buffers so that the bytes the
kernel dated are the ones decrypted.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import re
import select
import socket
import ssl
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import h11
import httpx

from kvwatch.core.connections import connect_reason, tls_context
from kvwatch.core.errors import UpstreamError

READ_BYTES = 64 << 10  # how much one read takes in: a streamed chunk is a few hundred bytes
MAX_HEADER_BYTES = 64 << 10  # of the status line and headers; more is no HTTP server kvwatch probes
SO_TIMESTAMPNS = 35 if sys.platform == "linux" else None  # Python names it on some builds only
ANCILLARY_BYTES = socket.CMSG_SPACE(16)  # one struct timespec
CLOCK_READ_TRIES = 3  # at reading the wall clock and perf_counter together
CLOCK_READ_GAP_NS = 10_000  # perf_counter's reads around the wall clock this close are one moment
CLOSED = "the server closed the connection"
SPEAKS_TLS = "the port speaks TLS: use https://"
SPEAKS_HTTP = "the server answered the TLS handshake with no TLS, as a plain-HTTP server does: use http://"
# What a TLS server may write to a plain-HTTP client: an alert or handshake record of TLS 1.x.
_TLS_RECORD = re.compile(rb"[\x15\x16]\x03[\x00-\x04]")
_STATUS_LINE = re.compile(rb"HTTP/[0-9]\.[0-9][ \t]+[0-9]{3}(?:[ \t][^\r\n]*)?")
_CONTENT_LENGTH = re.compile(rb"\ncontent-length[ \t]*:[ \t]*([^\r\n]*)", re.IGNORECASE)
SHOWN_CHARS = 60  # of a bad status line or header value, in an error message


class ConnectFailed(UpstreamError):
    """No connection to the origin; the message is the operating system's or TLS's reason."""


class DnsFailed(ConnectFailed):
    """The host name does not resolve: a typo, or a name only another network (a cluster's DNS) knows."""


class TlsFailed(ConnectFailed):
    """No usable connection because of TLS: a failed handshake (OpenSSL's reason, a certificate's
    included)."""


class TlsMismatch(TlsFailed):
    """The URL's scheme is not what the port speaks: https:// to a plain-HTTP server, which answered the
    TLS handshake in HTTP, or http:// to a TLS port, which answered in TLS."""


class StreamBroken(UpstreamError):
    """The server broke HTTP/1.1 or the connection before the response was complete."""


class ProtocolError(StreamBroken):
    """The server's answer is not valid HTTP/1.1; the message names what is wrong with it."""


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int


@dataclass(frozen=True)
class _Tls:
    """A TLS session over memory buffers: what came from the socket goes in, what goes to it comes out."""

    session: ssl.SSLObject
    incoming: ssl.MemoryBIO
    outgoing: ssl.MemoryBIO


def received_at(ancillary: list[tuple[int, int, bytes]]) -> float:
    """The perf_counter time the kernel stamped on what one recvmsg read, or now when it stamped none.

    The stamp is a wall-clock time: its age on the wall clock, taken off perf_counter read at the same
    moment, dates it on the clock the rest of the exchange is timed by."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            seconds, nanoseconds = struct.unpack("qq", data[:16])
            wall_ns, perf_ns = _clocks_now()
            return (perf_ns - max(0, wall_ns - (seconds * 1_000_000_000 + nanoseconds))) / 1e9
    return time.perf_counter()


def _clocks_now() -> tuple[int, int]:
    """The wall clock and perf_counter, in ns, read at one moment: perf_counter read on both sides of the
    wall clock, the tightest pair of a few tries, so that the process losing its core between two reads
    cannot shift one clock against the other (it did, by 0.4 ms, on a loaded machine)."""
    tightest = None
    for _ in range(CLOCK_READ_TRIES):
        before, wall, after = time.perf_counter_ns(), time.time_ns(), time.perf_counter_ns()
        if tightest is None or after - before < tightest[0]:
            tightest = (after - before, wall, (before + after) // 2)
        if after - before <= CLOCK_READ_GAP_NS:
            break
    return tightest[1], tightest[2]


def keep_kernel_timestamps_on() -> socket.socket:
    """A socket that asks for receive timestamps and only that, to keep while connections come and go.

    Linux stamps received packets only while some socket asks for it, and turns stamping on in a worker
    some time after the first one asks: a connection opened after all others closed would get its first
    answer unstamped, dated when the loop read it. One socket kept open keeps stamping on throughout."""
    keeper = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _ask_for_timestamps(keeper)
    return keeper


def _ask_for_timestamps(sock: socket.socket) -> None:
    """Have the kernel stamp what `sock` receives, where it can (SO_TIMESTAMPNS)."""
    if SO_TIMESTAMPNS is not None:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)


class _Connection:
    """One connection: what arrived, each piece with its arrival time, and h11's view of the exchange."""

    def __init__(self, sock: socket.socket, tls: _Tls | None = None) -> None:
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.sock = sock
        self.arrived: deque[tuple[float, bytes]] = deque()
        self.ended: BaseException | None = None  # why no more bytes will come
        self.fed_at = 0.0  # when the bytes h11 parses now arrived
        self.head: bytearray | None = None  # what came of a response head being read, to name its fault
        self._end_fed = False  # h11 was told that no more bytes will come
        self._wakeup = asyncio.Event()
        self._tls = tls
        self._loop = asyncio.get_running_loop()
        _ask_for_timestamps(sock)
        self._loop.add_reader(sock.fileno(), self._readable)

    @classmethod
    async def open(cls, origin: _Origin) -> _Connection:
        """Connected, and through the TLS handshake for https. Raises ConnectFailed."""
        try:
            sock = await _connected(origin)
        except socket.gaierror as error:
            raise DnsFailed(connect_reason(error)) from None
        except OSError as error:
            raise ConnectFailed(connect_reason(error)) from None
        try:
            tls = await _handshake(sock, origin) if origin.scheme == "https" else None
        except BaseException:
            sock.close()
            raise
        return cls(sock, tls)

    def _readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(READ_BYTES, ANCILLARY_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._end(StreamBroken(f"the connection was lost: {connect_reason(error)}"))
            return
        arrived_at = received_at(ancillary)
        if not data:
            self._end(StreamBroken(CLOSED))
            return
        if self._tls is not None:
            data = self._decrypted(data)
        if data:
            self.arrived.append((arrived_at, data))
            self._wakeup.set()

    def _decrypted(self, data: bytes) -> bytes:
        self._tls.incoming.write(data)
        pieces = []
        try:
            while piece := self._tls.session.read(READ_BYTES):
                pieces.append(piece)
            self._end(StreamBroken(CLOSED))  # read b"": the server's close_notify
        except ssl.SSLWantReadError:  # all of what came is decrypted
            pass
        except ssl.SSLZeroReturnError:  # the same, as some reads report it
            self._end(StreamBroken(CLOSED))
        except ssl.SSLError as error:
            self._end(StreamBroken(f"TLS failed: {error.reason or error}"))
        return b"".join(pieces)

    def _end(self, reason: StreamBroken) -> None:
        self._loop.remove_reader(self.sock.fileno())
        self.ended = self.ended or reason
        self._wakeup.set()

    async def send(self, data: bytes) -> None:
        """Write `data` whole (encrypted for https). Raises StreamBroken."""
        if self._tls is not None:
            self._tls.session.write(data)
            data = self._tls.outgoing.read()
        try:
            await self._loop.sock_sendall(self.sock, data)
        except OSError as error:
            raise StreamBroken(f"the connection was lost: {connect_reason(error)}") from None

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()

    @property
    def reusable(self) -> bool:
        """Idle and quiet: a server that closed a kept-alive connection (or sent something unasked) has
        made its socket readable, which the loop may not have told this connection yet."""
        if self.ended is not None or self.arrived or self.http.our_state is not h11.IDLE:
            return False
        readable, _, _ = select.select([self.sock], [], [], 0)
        return not readable

    async def response_head(self) -> h11.Response:
        """The response's status line and headers, informational responses (100 Continue) skipped.

        Raises ProtocolError naming what is wrong when the head is no HTTP/1.1 or never completes, and
        TlsMismatch when TLS came back to plain HTTP."""
        self.head = bytearray()
        try:
            while True:
                event, _ = await self.next_event()
                if isinstance(event, h11.Response):
                    return event
                if not isinstance(event, h11.InformationalResponse):  # h11.ConnectionClosed
                    raise self.ended or StreamBroken(CLOSED)
        except ProtocolError:
            raise
        except StreamBroken as broken:
            raise ProtocolError(_unfinished_head(broken, self.head)) from None
        finally:
            self.head = None

    async def next_event(self) -> tuple[h11.Event, float]:
        """h11's next event of the response, with the arrival time of the bytes that completed it."""
        while True:
            try:
                event = self.http.next_event()
            except h11.RemoteProtocolError as error:
                if self._end_fed:  # h11 found the answer incomplete at the close
                    raise self.ended from None
                raise self._refusal(error) from None
            if event is not h11.NEED_DATA:
                return event, self.fed_at
            if self.arrived:
                self.fed_at, data = self.arrived.popleft()
                if self.head is not None:
                    self.head += data
                self.http.receive_data(data)
            elif self.ended is not None:
                self.http.receive_data(b"")  # h11 tells a complete close-delimited body from a cut one
                self._end_fed = True
            else:
                self._wakeup.clear()
                await self._wakeup.wait()

    def _refusal(self, error: h11.RemoteProtocolError) -> ProtocolError | TlsMismatch:
        """What h11 refused, named for whoever reads the round's error (h11 says "bad Content-Length")."""
        if self.head is None:
            return ProtocolError(f"invalid body: {error}")
        if _TLS_RECORD.match(self.head):
            return TlsMismatch(SPEAKS_TLS)
        return ProtocolError(_head_fault(bytes(self.head)) or f"invalid response head: {error}")


def _head_fault(head: bytes) -> str | None:
    """What makes `head` no HTTP/1.1 response head, when it is one of the faults servers are known for."""
    if len(head) > MAX_HEADER_BYTES:
        return f"a header block over {MAX_HEADER_BYTES} bytes"
    line = head.split(b"\n", 1)[0].removesuffix(b"\r")
    if not _STATUS_LINE.fullmatch(line):
        return f"invalid status line {_shown(line.decode('latin-1'))}"
    for value in _CONTENT_LENGTH.findall(head.split(b"\r\n\r\n", 1)[0]):
        if not value.strip().isdigit():
            return f"invalid Content-Length {_shown(value.strip().decode('latin-1'))}"
    return None


def _unfinished_head(broken: StreamBroken, head: bytearray) -> str:
    """Why no response head came: a server that closes without a word may be a TLS port asked plain HTTP."""
    if not head and str(broken) == CLOSED:
        return f"{CLOSED} without answering (a TLS port does so to plain HTTP: is the URL https://?)"
    return f"{broken}, before the response head was complete"


def _shown(text: str) -> str:
    """What a server sent, short and quoted: no character of it can break a line."""
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…")


async def _connected(origin: _Origin) -> socket.socket:
    """A non-blocking socket connected to the first of the origin's addresses that answers."""
    loop = asyncio.get_running_loop()
    addresses = await loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"{origin.host} has no address")
    for family, kind, protocol, _, address in addresses:
        sock = socket.socket(family, kind, protocol)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as failed:
            sock.close()
            error = failed
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error


async def _handshake(sock: socket.socket, origin: _Origin) -> _Tls:
    """TLS verified with the process's one context (collectors.connections). Raises ConnectFailed,
    TlsMismatch when the server answered the handshake with something other than TLS."""
    loop = asyncio.get_running_loop()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    session = tls_context().wrap_bio(incoming, outgoing, server_hostname=origin.host)
    first = b""  # the server's first bytes: a TLS record, or "HTTP/1.1 400" from a plain-HTTP server
    try:
        while True:
            try:
                session.do_handshake()
                break
            except ssl.SSLWantReadError:
                await loop.sock_sendall(sock, outgoing.read())
                data = await loop.sock_recv(sock, READ_BYTES)
                if not data:
                    raise TlsFailed("TLS handshake failed: the server closed the connection") from None
                first = first or data
                incoming.write(data)
        await loop.sock_sendall(sock, outgoing.read())  # the handshake's last flight
    except ssl.SSLError as error:
        if first and not _TLS_RECORD.match(first):  # "HTTP/1.1 400 …", or HTTP/0.9's bare page
            first_line = first.split(b"\n", 1)[0].removesuffix(b"\r").decode("latin-1")
            raise TlsMismatch(f"{SPEAKS_HTTP} (it sent {_shown(first_line)})") from None
        raise TlsFailed(connect_reason(error)) from None
    except OSError as error:
        raise ConnectFailed(connect_reason(error)) from None
    return _Tls(session, incoming, outgoing)


class Response:
    """A response whose status and headers have arrived; its body comes as it arrives."""

    def __init__(self, connection: _Connection, head: h11.Response, sent_at: float) -> None:
        self.status = head.status_code
        # Given as text and UTF-8, so that httpx neither re-encodes a value as ASCII (which raised on
        # `Server: café`) nor decodes all of them by the guess one odd byte makes for every header.
        self.headers = httpx.Headers(
            [(name.decode("ascii"), _header_text(value)) for name, value in head.headers], encoding="utf-8"
        )
        self.sent_at = sent_at  # perf_counter when the request was written
        self._connection = connection

    async def chunks(self) -> AsyncIterator[tuple[bytes, float]]:
        """The body's pieces, each with the perf_counter time its bytes arrived. Raises ProtocolError for
        a body in a content coding: the client asks for none (it sends no Accept-Encoding)."""
        coding = self.headers.get("Content-Encoding", "").strip().lower()
        if coding not in ("", "identity"):
            raise ProtocolError(f"a body in Content-Encoding {_shown(coding)}, which was not asked for")
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
        self._timestamps = keep_kernel_timestamps_on()

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for connection in self._open:
            connection.close()
        self._open.clear()
        self._idle.clear()
        self._timestamps.close()

    @asynccontextmanager
    async def stream(self, url: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[Response]:
        """POST `body` to `url` and yield the response once its head has arrived.

        The clock (Response.sent_at) starts when the prepared request is written, on a connection that
        is already open. Raises ConnectFailed (DnsFailed for a name that does not resolve, TlsFailed for
        TLS, TlsMismatch for a scheme the port does not speak) or StreamBroken (ProtocolError for an
        answer that is no HTTP/1.1); a timeout is the caller's to set."""
        origin, target, fields = _request_line(url)
        fields = {**fields, **headers, "Content-Length": str(len(body))}  # an API key's beats the URL's
        connection = await self._connection(origin)
        try:
            # In UTF-8, as header values are read: a gateway's non-ASCII session id goes back as it came.
            lines = [(name, value.encode()) for name, value in fields.items()]
            request = connection.http.send(h11.Request(method="POST", target=target, headers=lines))
            request += connection.http.send(h11.Data(data=body)) + connection.http.send(h11.EndOfMessage())
            sent_at = time.perf_counter()
            await connection.send(request)
            yield Response(connection, await connection.response_head(), sent_at)
        finally:
            self._release(origin, connection)

    async def _connection(self, origin: _Origin) -> _Connection:
        idle = self._idle.get(origin, [])
        while idle:
            connection = idle.pop()
            if connection.reusable:
                return connection
            self._discard(connection)
        connection = await _Connection.open(origin)
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
        connection.close()
        self._open.discard(connection)


def _header_text(value: bytes) -> str:
    """A header value as text: UTF-8 when it is, else Latin-1, in which every byte is a character."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


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
