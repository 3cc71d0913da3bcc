"""Small HTTP servers on 127.0.0.1, for what a test needs a real server to answer: one in a thread
(`loopback_http`), or an aiohttp app on the test's event loop (`serving`)."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from aiohttp import web


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler for `loopback_http` that logs nothing and answers in one call."""

    def answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def loopback_http(handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """`handler` served from a thread on a free 127.0.0.1 port (over TLS with `tls`): its base URL;
    stopped on leaving. A handler that waits must be released before leaving, or the stop waits for it."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def answering_bytes(answer: bytes) -> type[QuietHandler]:
    """A handler for `loopback_http` that answers every POST with `answer`, byte for byte, whatever HTTP
    allows, and then closes the connection (a body without a length ends there)."""

    class RawAnswer(QuietHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.wfile.write(answer)
            self.close_connection = True

    return RawAnswer


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """`app` on a free 127.0.0.1 port, on the running event loop: its base URL; stopped on leaving."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def chat_answer(
    request: web.Request, headers: dict[str, str], streams: bool = True
) -> web.StreamResponse:
    """A one-token chat completion with `headers`: streamed with its usage when the request asks for a
    stream (and `streams`), else whole."""
    body = await request.json()
    if not (body.get("stream") and streams):
        return web.json_response({"choices": [{"message": {"content": "hi"}}]}, headers=headers)
    answer = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
    await answer.prepare(request)
    usage = {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    for chunk in ({"choices": [{"index": 0, "delta": {"content": "hi"}}]}, {"choices": [], "usage": usage}):
        await answer.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await answer.write(b"data: [DONE]\n\n")
    return answer
