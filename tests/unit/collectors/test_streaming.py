"""The probe's HTTP/1.1 client (collectors.streaming) against a loopback server that answers bytes as
scripted: framing, kept-alive connections, arrival times and each way an answer can break."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import select
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import h11
import pytest

from kvwatch.collectors.probe import streaming
from kvwatch.collectors.probe.streaming import (
    SPEAKS_TLS,
    ConnectFailed,
    DnsFailed,
    ProtocolError,
    StreamBroken,
    StreamClient,
    TlsFailed,
    TlsMismatch,
    _Connection,
)
from processes import free_port, stop

OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b"data: one\n\n", b"data: two\n\n"]
CHUNKED = OK_HEAD + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"


class Scripted:
    """What the server saw: each request's bytes, and how many connections were made."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.connections = 0


@asynccontextmanager
async def scripted(
    *answers: bytes | Callable[[asyncio.StreamWriter], None], tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[str, Scripted]]:
    """A 127.0.0.1 server answering the n-th request with answers[n] (the last from there on): bytes to
    write, or a function given the writer (to close it, say); over TLS when given a server context."""
    seen = Scripted()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                seen.requests.append(head + await reader.readexactly(length))
                answer = answers[min(len(seen.requests), len(answers)) - 1]
                if callable(answer):
                    answer(writer)
                else:
                    writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=tls)
    async with server:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


async def body_of(client: StreamClient, url: str, headers: dict | None = None) -> tuple[int, bytes]:
    async with client.stream(url, b'{"q": 1}', headers or {}) as response:
        return response.status, b"".join([chunk async for chunk, _ in response.chunks()])


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_a_chunked_stream_is_read_whole_and_the_request_goes_out_as_prepared():
    async def scenario():
        async with scripted(CHUNKED) as (url, seen), StreamClient() as client:
            answer = await body_of(client, f"{url}/v1/chat/completions?x=1", {"X-Session-Id": "s-1"})
        return answer, seen.requests[0]

    (status, body), request = run(scenario)
    assert (status, body) == (200, b"".join(EVENTS))
    head, _, sent = request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
    for field in (b"host: 127.0.0.1:", b"x-session-id: s-1", b"content-length: 8", b"user-agent: kvwatch"):
        assert field in head.lower(), head
    assert sent == b'{"q": 1}'


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Both ends of a loopback TCP connection, the first non-blocking (the kernel dates TCP segments)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    ours.setblocking(False)
    return ours, theirs


def wait_until_the_kernel_stamps_arrivals() -> None:
    """Linux turns receive timestamps on in a worker some time after a socket first asks for them (a
    packet that arrives before is unstamped): wait, 2 s at most, until a new connection's are."""
    deadline = time.monotonic() + 2
    while True:
        ours, theirs = tcp_pair()
        streaming._ask_for_timestamps(ours)
        with ours, theirs:
            theirs.sendall(b"x")
            select.select([ours], [], [], 1)
            _, ancillary, _, _ = ours.recvmsg(1, streaming.ANCILLARY_BYTES)
        if ancillary:
            return
        assert time.monotonic() < deadline, "the kernel stamped no received packet within 2 s"
        time.sleep(0.01)


def test_chunks_carry_the_time_the_kernel_received_their_bytes_not_when_the_loop_read_them():
    async def scenario():
        ours, theirs = tcp_pair()
        connection = _Connection(ours)
        connection.http.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        connection.http.send(h11.EndOfMessage())
        theirs.sendall(CHUNKED)
        sent = time.perf_counter()
        time.sleep(0.05)  # the loop busy elsewhere before it reads the socket
        events = [await connection.next_event() for _ in range(4)]
        connection.close()
        theirs.close()
        return sent, events

    with streaming.keep_kernel_timestamps_on():  # as every StreamClient does while it lives
        wait_until_the_kernel_stamps_arrivals()
        sent, events = run(scenario)
    assert [type(event).__name__ for event, _ in events] == ["Response", "Data", "Data", "EndOfMessage"]
    assert all(sent - 0.05 < arrived_at <= sent for _, arrived_at in events), (sent, events)


def test_a_clients_timestamp_keeper_asks_for_stamps_while_it_lives():
    async def scenario():
        async with StreamClient() as client:
            keeper = client._timestamps
            asked = keeper.getsockopt(socket.SOL_SOCKET, streaming.SO_TIMESTAMPNS)
        return asked, keeper.fileno()

    assert run(scenario) == (1, -1)


def test_a_stamp_is_dated_on_perf_counter_by_the_clocks_read_together(monkeypatch):
    real_time_ns = time.time_ns
    calls = []

    def preempted_once() -> int:  # the process loses its core for 5 ms at the first read, only
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.005)
        return real_time_ns()

    before = time.perf_counter()
    stamp = real_time_ns() - 20_000_000  # arrived 20 ms before now
    after = time.perf_counter()
    ancillary = [(socket.SOL_SOCKET, streaming.SO_TIMESTAMPNS, struct.pack("qq", *divmod(stamp, 10**9)))]
    monkeypatch.setattr(streaming.time, "time_ns", preempted_once)
    arrived_at = streaming.received_at(ancillary)
    assert len(calls) >= 2
    slack = streaming.CLOCK_READ_GAP_NS / 1e9
    assert before - 0.02 - slack <= arrived_at <= after - 0.02 + slack, (before, arrived_at, after)


def test_an_unstamped_read_is_dated_when_it_was_read():
    before = time.perf_counter()
    assert before <= streaming.received_at([]) <= time.perf_counter()


def test_sequential_requests_share_one_kept_alive_connection():
    async def scenario():
        async with scripted(CHUNKED) as (url, seen), StreamClient() as client:
            answers = [await body_of(client, url) for _ in range(3)]
        return answers, seen.connections

    answers, connections = run(scenario)
    assert answers == [(200, b"".join(EVENTS))] * 3
    assert connections == 1


def close_after(answer: bytes) -> Callable[[asyncio.StreamWriter], None]:
    def act(writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        writer.close()

    return act


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(close_after(CHUNKED), id="closed-while-idle"),
        pytest.param(
            CHUNKED.replace(b"chunked\r\n", b"chunked\r\nConnection: close\r\n"), id="connection-close"
        ),
    ],
)
def test_a_connection_the_server_closes_is_not_reused(first):
    async def scenario():
        async with scripted(first, CHUNKED) as (url, seen), StreamClient() as client:
            answers = [await body_of(client, url) for _ in range(2)]
        return answers, seen.connections

    answers, connections = run(scenario)
    assert answers == [(200, b"".join(EVENTS))] * 2
    assert connections == 2


def test_an_answer_left_unread_closes_its_connection():
    async def scenario():
        async with scripted(CHUNKED) as (url, seen), StreamClient() as client:
            async with client.stream(url, b"{}", {}) as response:
                assert response.status == 200  # its body is not read
            await body_of(client, url)
        return seen.connections

    assert run(scenario) == 2


def test_a_body_delimited_by_the_close_is_complete():
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + b"".join(EVENTS)

    async def scenario():
        async with scripted(close_after(answer)) as (url, _), StreamClient() as client:
            return await body_of(client, url)

    assert run(scenario) == (200, b"".join(EVENTS))


def test_informational_responses_are_skipped():
    async def scenario():
        async with scripted(b"HTTP/1.1 100 Continue\r\n\r\n" + CHUNKED) as (url, _), StreamClient() as client:
            return await body_of(client, url)

    assert run(scenario) == (200, b"".join(EVENTS))


def reset_after(answer: bytes) -> Callable[[asyncio.StreamWriter], None]:
    """Write `answer`, then reset the connection (an RST, as a crashing proxy's kernel sends)."""

    def answer_and_reset(writer: asyncio.StreamWriter) -> None:
        writer.write(answer)  # written at once: the transport's buffer is empty
        writer.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        writer.transport.abort()

    return answer_and_reset


GZIP_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"


@pytest.mark.parametrize(
    "answer, broken, message",
    [
        pytest.param(
            close_after(CHUNKED[:-20]), StreamBroken, "the server closed the connection", id="cut-mid-body"
        ),
        pytest.param(
            close_after(b""),
            ProtocolError,
            "the server closed the connection without answering (a TLS port does so to plain HTTP: is the "
            "URL https://?)",
            id="closed-unanswered",
        ),
        pytest.param(
            b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
            ProtocolError,
            "invalid status line 'SSH-2.0-OpenSSH_9.6'",
            id="no-http",
        ),
        pytest.param(
            b"HTTP/1.1 abc OK\r\n\r\n",
            ProtocolError,
            "invalid status line 'HTTP/1.1 abc OK'",
            id="status-abc",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            ProtocolError,
            "invalid Content-Length '-1'",
            id="content-length-minus-1",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (200 << 10) + b"\r\n\r\n",
            ProtocolError,
            "a header block over 65536 bytes",
            id="200-KB-head",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (80 << 10),
            ProtocolError,
            "a header block over 65536 bytes",
            id="endless-head",
        ),
        pytest.param(
            reset_after(b"HTTP/1.1 200 OK\r\nContent-Type: text/ev"),
            ProtocolError,
            "the connection was lost: Connection reset by peer, before the response head was complete",
            id="reset-mid-head",
        ),
        pytest.param(
            OK_HEAD + b"zz\r\n", ProtocolError, "invalid body: illegal chunk header", id="bad-chunk-size"
        ),
        pytest.param(
            close_after(GZIP_HEAD + b"\r\n" + gzip.compress(b"".join(EVENTS))),
            ProtocolError,
            "a body in Content-Encoding 'gzip', which was not asked for",
            id="unasked-gzip",
        ),
    ],
)
def test_a_broken_answer_is_a_stream_broken_error_naming_the_fault(answer, broken, message):
    async def scenario():
        async with scripted(answer) as (url, _), StreamClient() as client:
            with pytest.raises(StreamBroken) as failed:
                await body_of(client, url)
        return failed.value

    error = run(scenario)
    assert type(error) is broken and str(error).startswith(message), repr(error)


def test_header_values_are_read_as_utf_8_or_byte_for_byte_whatever_their_bytes():
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nServer: caf\xc3\xa9-gateway\r\nX-Upstream: r\xff1\r\n\r\nok"
    )

    async def scenario():
        async with (
            scripted(head) as (url, _),
            StreamClient() as client,
            client.stream(url, b"{}", {}) as answer,
        ):
            await answer.finish()
            return answer.headers

    headers = run(scenario)
    assert (headers["server"], headers["x-upstream"]) == ("café-gateway", "r\xff1")


def test_nothing_listening_is_a_connect_failure_with_the_systems_reason():
    async def scenario():
        async with scripted(CHUNKED) as (url, _):
            pass  # the port is free again
        async with StreamClient() as client:
            with pytest.raises(ConnectFailed, match="Connection refused"):
                await body_of(client, url)

    run(scenario)


@pytest.mark.parametrize(
    "headers, sent",
    [
        pytest.param({}, b"authorization: basic " + base64.b64encode(b"kvw:p w").lower(), id="from-the-url"),
        pytest.param({"Authorization": "Bearer k"}, b"authorization: bearer k", id="the-key-wins"),
    ],
)
def test_a_user_and_password_in_the_url_are_sent_as_basic_auth_unless_a_key_is(headers, sent):
    async def scenario():
        async with scripted(CHUNKED) as (url, seen), StreamClient() as client:
            await body_of(client, url.replace("//", "//kvw:p%20w@"), headers)
        return seen.requests[0].lower()

    request = run(scenario)
    assert sent in request and request.count(b"authorization") == 1


@pytest.fixture
def trusting(certificate, monkeypatch) -> None:
    """The probe's TLS context trusts the test certificate, as SSL_CERT_FILE would make it."""
    monkeypatch.setattr(streaming, "tls_context", lambda: ssl.create_default_context(cafile=certificate[0]))


def test_https_streams_are_read_whole_on_one_kept_alive_connection(server_tls, trusting):
    async def scenario():
        async with scripted(CHUNKED, tls=server_tls) as (url, seen), StreamClient() as client:
            answers = [await body_of(client, url) for _ in range(3)]
        return answers, seen

    answers, seen = run(scenario)
    assert answers == [(200, b"".join(EVENTS))] * 3
    assert seen.connections == 1 and seen.requests[0].endswith(b'\r\n\r\n{"q": 1}')


def test_an_https_body_delimited_by_the_close_is_complete(server_tls, trusting):
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + b"".join(EVENTS)

    async def scenario():
        async with scripted(close_after(answer), tls=server_tls) as (url, _), StreamClient() as client:
            return await body_of(client, url)

    assert run(scenario) == (200, b"".join(EVENTS))


async def failure_of(url: str) -> ConnectFailed:
    async with StreamClient() as client:
        with pytest.raises(ConnectFailed) as failed:
            await body_of(client, url)
    return failed.value


def served_over_tls(tls: ssl.SSLContext, host: str = "127.0.0.1") -> ConnectFailed:
    """How a request to a TLS server on 127.0.0.1, addressed as `host`, fails."""

    async def scenario():
        async with scripted(CHUNKED, tls=tls) as (url, _):
            return await failure_of(url.replace("127.0.0.1", host))

    return run(scenario)


def test_a_self_signed_certificate_is_a_tls_failure_with_openssls_reason(server_tls):
    failed = served_over_tls(server_tls)
    assert type(failed) is TlsFailed
    assert str(failed) == "TLS handshake failed: certificate verify failed: self-signed certificate"


def test_a_certificate_for_another_name_is_a_tls_failure_naming_the_mismatch(server_tls, trusting):
    failed = served_over_tls(server_tls, host="localhost")
    assert type(failed) is TlsFailed
    assert str(failed) == (
        "TLS handshake failed: certificate verify failed: Hostname mismatch, certificate is not valid for "
        "'localhost'."
    )


@contextlib.contextmanager
def openssl_server(certificate: tuple[str, str], *options: str) -> Iterator[str]:
    """`openssl s_server` on a free 127.0.0.1 port with the test certificate: its https URL; stopped by
    its PID on leaving."""
    port = free_port()
    server = subprocess.Popen(
        ["openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-cert", certificate[0], "-key",
         certificate[1], "-www", "-quiet", *options],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while server.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.05)  # polling for the listener, within the deadline
        else:
            raise AssertionError(f"openssl s_server did not listen on 127.0.0.1:{port}")
        yield f"https://127.0.0.1:{port}"
    finally:
        stop(server)


def test_a_server_of_an_old_tls_version_only_is_a_tls_failure_naming_the_version(certificate, trusting):
    with openssl_server(certificate, "-tls1", "-cipher", "DEFAULT:@SECLEVEL=0") as url:
        failed = run(lambda: failure_of(url))
    assert type(failed) is TlsFailed and str(failed) == "TLS handshake failed: TLSV1_ALERT_PROTOCOL_VERSION"


def test_plain_http_to_a_port_answering_with_a_tls_alert_is_said_to_speak_tls():
    alert = b"\x15\x03\x01\x00\x02\x02\x46"  # TLS 1.0 fatal protocol_version: what older TLS servers send

    async def scenario():
        async with scripted(close_after(alert)) as (url, _), StreamClient() as client:
            with pytest.raises(TlsMismatch) as failed:
                await body_of(client, url)
        return str(failed.value)

    assert run(scenario) == SPEAKS_TLS


def test_https_to_a_plain_http_server_is_a_mismatch_quoting_what_it_sent():
    async def plain_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the TLS hello, taken for a request no HTTP server understands
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario():
        server = await asyncio.start_server(plain_http, "127.0.0.1", 0)
        async with server:
            return await failure_of(f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1")

    failed = run(scenario)
    assert type(failed) is TlsMismatch
    assert str(failed).endswith("use http:// (it sent 'HTTP/1.1 400 Bad Request')"), str(failed)


def test_a_host_name_that_does_not_resolve_is_a_dns_failure(monkeypatch):
    def nxdomain(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", nxdomain)  # what the resolver answers for a typo
    failed = run(lambda: failure_of("http://gatewy.example:8000/v1/chat/completions"))
    assert type(failed) is DnsFailed
    assert str(failed) == "the host name does not resolve (Name or service not known)"
