"""Scaffolding of the probe's tests: the settings of a quick run and small fake OpenAI-compatible servers."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aiohttp import web
from loopback import serving

from kvwatch.collectors.probe.records import SessionResult
from kvwatch.collectors.probe.session import ProbeSettings, run_session
from kvwatch.collectors.probe.streaming import StreamClient
from kvwatch.collectors.probe.targets import probe_once
from kvwatch.collectors.probe.workload import Conversation, synthetic
from paths import REPO

MODEL = "lab-model"
KEY = "kvw-secret-5f1c0e9a7d3b"  # distinctive, so a grep finds any leak
SMALL = f"--model {MODEL} --system-tokens 50 --turn-tokens 10 --max-tokens 8".split()  # a quick CLI run


def conversations(
    seed: int, sessions: int = 3, rounds: int = 4, system_tokens: int = 2000
) -> list[Conversation]:
    """Conversations with a system prompt each, so that round 1 is a cold prefill wherever it lands.

    Every test takes its own seed: the lab's caches outlive a test.
    """
    return [synthetic(rounds, system_tokens, 20, seed * 100 + n, sessions=1)[0] for n in range(sessions)]


def probe(url: str, workload: list[Conversation], **settings) -> list[SessionResult]:
    settings = {"base_url": url, "model": MODEL, "max_tokens": 16, **settings}
    return probe_once(ProbeSettings(**settings), workload)


# Small fake servers, for what no healthy engine does.


def fake_server(handler):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return serving(app)


async def sse(request: web.Request, events: list[str], headers: dict | None = None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {event}\n\n".encode())
    return response


USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
ANSWER = [
    '{"choices": [{"delta": {"role": "assistant", "content": ""}}]}',
    '{"choices": [{"delta": {"content": "hello"}}]}',
    '{"choices": [{"delta": {"content": " world"}}]}',
    json.dumps({"choices": [], "usage": USAGE}),
    "[DONE]",
]
WORKLOAD = Conversation("Be brief.", ("first question", "second question", "third question"))


def against(handler, scheme: str = "http", **settings) -> SessionResult:
    async def scenario():
        async with fake_server(handler) as url, StreamClient() as client:
            base_url = url.replace("http", scheme, 1)
            return await run_session(
                client, ProbeSettings(base_url=base_url, model=MODEL, **settings), WORKLOAD
            )

    return asyncio.run(scenario())


def answering(events: list[str], headers: dict | None = None):
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, events, headers)

    return handler


def replying(body: dict, status: int = 200):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    return handler


ERROR_OBJECT = {"error": {"message": f"Incorrect API key provided: {KEY}", "code": "invalid_api_key"}}


async def run_kvwatch(*args: str, env: dict | None = None) -> tuple[int | None, str, str]:
    """`kvwatch ARGS` in a process of its own: its exit code, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvwatch.cli.main", *args, cwd=REPO, env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode, out.decode(), err.decode()
