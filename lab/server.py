"""The HTTP face of a lab replica: what vLLM's and SGLang's OpenAI-compatible servers show a client,
a gateway or a router, plus a loopback-only admin API for faults and ground truth."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvwatch.core.errors import KVWatchError
from kvwatch.core.tokenizer import TemplateError, render_chat, tokenize
from kvwatch.lab import sessions
from kvwatch.lab.engine import Engine, ReplicaSettings, Sequence, faults_from_json

log = logging.getLogger("kvwatch.lab.replica")

SESSION_HEADERS = ("X-Session-Id", "X-SMG-Routing-Key", sessions.SESSION_HEADER)
LOOPBACK = {"127.0.0.1", "::1"}
ENGINE_KEY = web.AppKey("engine", Engine)
ARRIVAL_KEY = web.RequestKey("arrival", float)


class ApiError(KVWatchError):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, error_type: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": None,
                "code": self.code or self.status,
            }
        }
        return web.json_response(body, status=self.status)


def _session_id(request: web.Request) -> str | None:
    for header in SESSION_HEADERS:
        if request.headers.get(header):
            return request.headers[header]
    return None


def _check_key(engine: Engine, request: web.Request) -> str | None:
    """Enforce the API-key fault: 401 without a valid Bearer key, 403 for an expired one."""
    keys = engine.faults.api_keys
    if keys is None:
        return None
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme != "Bearer" or not key:
        raise ApiError(
            401,
            "Missing bearer token: send 'Authorization: Bearer <key>'.",
            "invalid_request_error",
            "invalid_api_key",
        )
    if key in engine.faults.expired_keys:
        raise ApiError(
            403, "The access token has expired; request a new one.", "permission_error", "token_expired"
        )
    if key not in keys:
        raise ApiError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")
    return key


def _check_scope(engine: Engine, key: str | None, model: str) -> None:
    if key is None:
        return
    allowed = engine.faults.api_keys[key]
    if "*" not in allowed and model not in allowed:
        raise ApiError(
            403,
            f"This API key is not allowed to use the model '{model}'.",
            "permission_error",
            "model_not_allowed",
        )


def _parse_chat(engine: Engine, raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(
            400, f"The request body is not valid JSON: {error}", "invalid_request_error"
        ) from error
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", "invalid_request_error")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list.", "invalid_request_error")
    model = body.get("model", engine.settings.model)
    if model != engine.settings.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model_not_found")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, "'max_tokens' must be a positive integer.", "invalid_request_error")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false.", "invalid_request_error")
    try:
        prompt = render_chat(messages)
    except TemplateError as error:
        raise ApiError(400, str(error), "invalid_request_error") from error
    options = body.get("stream_options") or {}
    nvext = body.get("nvext")
    extra_fields = nvext.get("extra_fields") if isinstance(nvext, dict) else None
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
        "include_usage": bool(isinstance(options, dict) and options.get("include_usage")),
        # NVIDIA Dynamo's request extension: which extra fields the answer should carry.
        "nvext_fields": frozenset(extra_fields) if isinstance(extra_fields, list) else frozenset(),
    }


class Answer:
    """The bodies of one chat completion answer, shaped like the replica's engine shapes them.

    The `vllm` flavour has vLLM 0.32's shape, as far as it matters to an OpenAI client (tests/contract.py
    holds it to a real engine's): `created_cache_tokens` in the usage, OpenAI's null message fields, a
    `system_fingerprint`, and `finish_reason` on the last token's chunk. The other flavours keep the
    plain OpenAI shape: a separate finishing chunk, and no more than `cached_tokens` in the usage.
    The replica's answer style puts the tokens in the deltas of a reasoning model or a tool call, and a
    request that asks with `nvext.extra_fields` gets Dynamo's `nvext` in every chunk.
    """

    def __init__(self, engine: Engine, seq: Sequence, model: str, nvext_fields: frozenset = frozenset()):
        self.seq = seq
        self.replica_id = engine.settings.replica_id
        self.style = engine.settings.answer_style
        self.vllm = engine.settings.flavour == "vllm"
        self.reasoning_field = "reasoning" if self.vllm else "reasoning_content"
        self.nvext_fields = nvext_fields
        self.head = {"id": f"chatcmpl-{seq.request_id}", "created": int(time.time()), "model": model}
        self.closing = {"system_fingerprint": _fingerprint(engine.settings)} if self.vllm else {}

    def completion(self, words: list[str]) -> dict:
        deltas = [self._delta(index, word) for index, word in enumerate(words)]
        text = "".join(d.get("content", "") for d in deltas)
        message = {"role": "assistant", "content": text or None}
        if thinking := "".join(d.get(self.reasoning_field, "") for d in deltas):
            message[self.reasoning_field] = thinking
        if self.style == "tool-call":
            arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
            message["tool_calls"] = [self._tool_call(arguments)]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self._finish_reason()}
        body = {**self.head, "object": "chat.completion", "choices": [choice], "usage": self.usage(False)}
        if self.vllm:
            message |= {"refusal": None, "annotations": None, "audio": None, "function_call": None}
            body |= {"service_tier": None, **self.closing}
        return body | self._nvext(last=True)

    async def stream(self, include_usage: bool) -> AsyncIterator[dict]:
        """Prefill and decode the sequence, yielding each chunk of the event stream."""
        seq = self.seq
        await seq.prefill()
        yield self._chunk([self._choice({"role": "assistant", "content": ""})])
        async for word in seq.decode():
            last = self.vllm and seq.completion_tokens == len(seq.words)
            delta = self._delta(seq.completion_tokens - 1, word)
            if not last:
                yield self._chunk([self._choice(delta)])
            else:  # vLLM's closing chunk carries the fingerprint, unless a usage chunk follows
                closing = {} if include_usage else self.closing
                choices = [self._choice(delta, self._finish_reason())]
                yield self._chunk(choices, last=not include_usage, **closing)
        if not self.vllm:
            yield self._chunk([self._choice({}, self._finish_reason())], last=not include_usage)
        if include_usage:
            yield self._chunk([], last=True, usage=self.usage(True), **self.closing)

    def _delta(self, index: int, word: str) -> dict:
        """The delta of the answer's `index`th token, by the replica's answer style."""
        piece = word if index == 0 else " " + word
        if self.style == "tool-call":
            last = index == len(self.seq.words) - 1
            arguments = ('{"query": "' if index == 0 else "") + piece + ('"}' if last else "")
            later = {"index": 0, "function": {"arguments": arguments}}
            return {"tool_calls": [self._tool_call(arguments) if index == 0 else later]}
        thinking = self.style == "reasoning" and index < max(1, len(self.seq.words) // 2)
        return {self.reasoning_field: piece} if thinking else {"content": piece}

    def _tool_call(self, arguments: str) -> dict:
        function = {"name": "lookup", "arguments": arguments}
        return {"index": 0, "id": f"call-{self.seq.request_id}", "type": "function", "function": function}

    def _finish_reason(self) -> str:
        return "tool_calls" if self.style == "tool-call" else self.seq.finish_reason

    def _nvext(self, last: bool) -> dict:
        """Dynamo's `nvext`: the worker on every chunk, the timing on the last, each when asked for."""
        nvext = {}
        if "worker_id" in self.nvext_fields:
            nvext["worker_id"] = {
                "prefill_worker_id": self.replica_id,
                "prefill_dp_rank": 0,
                "decode_worker_id": self.replica_id,
                "decode_dp_rank": 0,
            }
        if last and "timing" in self.nvext_fields:
            ttft = self.seq.ttft_seconds or 0.0
            nvext["timing"] = {"ttft_ms": round(ttft * 1000, 3), "prefill_time_ms": round(ttft * 1000, 3)}
        return {"nvext": nvext} if nvext else {}

    def usage(self, streamed: bool) -> dict:
        seq = self.seq
        details = {"cached_tokens": seq.cached_tokens}
        usage = {
            "prompt_tokens": len(seq.prompt),
            "completion_tokens": seq.completion_tokens,
            "total_tokens": len(seq.prompt) + seq.completion_tokens,
            "prompt_tokens_details": details,
        }
        if self.vllm:
            details["created_cache_tokens"] = seq.created_cache_tokens
            if not streamed:  # vLLM leaves null fields out of the streamed usage only
                usage["completion_tokens_details"] = None
        return usage

    def _chunk(self, choices: list[dict], last: bool = False, **extra) -> dict:
        chunk = {**self.head, "object": "chat.completion.chunk", "choices": choices, **extra}
        return chunk | self._nvext(last)

    @staticmethod
    def _choice(delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _fingerprint(settings: ReplicaSettings) -> str:
    """vLLM's `vllm-<version>-<hash of its config>`: replicas configured alike print the same one."""
    config = f"{settings.model} {settings.block_size} {settings.cache_blocks} {settings.max_model_len}"
    return f"vllm-0.32.0-{hashlib.blake2b(config.encode(), digest_size=4).hexdigest()}"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = request[ARRIVAL_KEY]
    engine = request.app[ENGINE_KEY]
    session_id = _session_id(request)
    try:
        key = _check_key(engine, request)
        chat = _parse_chat(engine, await request.read())
        _check_scope(engine, key, chat["model"])
        if engine.should_fail():
            raise ApiError(500, "Internal server error.", "InternalServerError")
    except ApiError as error:
        engine.record(
            {
                "time": time.time(),
                "session_id": session_id,
                "status": error.status,
                "error": error.code or error.error_type,
            }
        )
        return error.response()

    headers = {"X-Worker-Id": engine.settings.replica_id} if engine.settings.identity_header else {}
    seq = engine.sequence(chat["prompt"], chat["max_tokens"], chat["stream"], session_id, arrival)
    answer = Answer(engine, seq, chat["model"], chat["nvext_fields"])
    async with seq:
        if not chat["stream"]:
            await seq.prefill()
            words = [word async for word in seq.decode()]
            return web.json_response(answer.completion(words), headers=headers)

        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        async for chunk in answer.stream(chat["include_usage"]):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's container contract, as vLLM serves it: session requests are the session manager's
    (lab/sessions.py), any other body is a chat completion, with the session header as its session."""
    engine = request.app[ENGINE_KEY]
    session_id = request.headers.get(sessions.SESSION_HEADER)
    try:
        answer = sessions.intercept(engine.sessions, await request.read(), session_id)
    except sessions.SessionError as error:
        engine.record(
            {"time": time.time(), "session_id": session_id, "status": error.status, "error": error.detail}
        )
        return ApiError(error.status, error.detail, error.status.phrase, error.status).response()
    if answer is None:
        return await chat_completions(request)
    engine.record({"time": time.time(), "session_id": session_id, "status": 200, "session": answer.text})
    return web.Response(body=answer.text.encode(), headers=answer.headers)  # no type, as vLLM sends none


async def render(request: web.Request) -> web.Response:
    """vLLM's chat render / tokenize endpoints, which vllm-router's cache_aware policy calls."""
    try:
        body = json.loads(await request.read())
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list):
            ids = render_chat(messages)
        elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
            ids = tokenize(body["prompt"])
        else:
            raise ApiError(400, "Send 'messages' or 'prompt'.", "invalid_request_error")
    except (ValueError, TemplateError) as error:
        return ApiError(400, str(error), "invalid_request_error").response()
    except ApiError as error:
        return error.response()
    max_model_len = request.app[ENGINE_KEY].settings.max_model_len
    return web.json_response(
        {"token_ids": ids, "tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    )


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        _check_key(engine, request)
    except ApiError as error:
        return error.response()
    # Only the served name: a model or tokenizer path would make routers try to download it.
    model = {"id": engine.settings.model, "object": "model", "created": 0, "owned_by": "kvwatch-lab"}
    return web.json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    """/health, and SageMaker's /ping."""
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.Response(
        body=generate_latest(engine.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


class ArrivalDating(asyncio.Protocol):
    """A connection's protocol in front of aiohttp's, dating each request at the loop's first read of it.

    aiohttp hands a request to its handler at least one loop turn after reading it, behind every other
    ready callback: at 64 streaming sessions that is milliseconds, which a clock started in the handler
    would leave out of the replica's ground truth and so count against the client measuring TTFT.
    A request that arrives while another is in flight on the connection (pipelining, which no client
    here does) is dated when its handling starts.
    """

    def __init__(self, handler: asyncio.Protocol):
        self._handler = handler
        self._first_read: float | None = None
        self._in_flight = False

    def request_started(self) -> float:
        """When this connection's current request arrived; its bytes are read from here on undated."""
        arrival, self._first_read, self._in_flight = self._first_read, None, True
        return arrival or time.monotonic()

    def request_ended(self) -> None:
        self._in_flight = False

    def data_received(self, data: bytes) -> None:
        if self._first_read is None and not self._in_flight:
            self._first_read = time.monotonic()
        self._handler.data_received(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._handler.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()


@web.middleware
async def dated_arrival(request: web.Request, handler):
    """Give each request its arrival as its connection's ArrivalDating saw it."""
    transport = request.transport
    dating = transport.get_protocol() if transport is not None else None
    if not isinstance(dating, ArrivalDating):
        request[ARRIVAL_KEY] = time.monotonic()
        return await handler(request)
    request[ARRIVAL_KEY] = dating.request_started()
    try:
        return await handler(request)
    finally:
        dating.request_ended()


@web.middleware
async def loopback_admin(request: web.Request, handler):
    if request.path.startswith("/lab/") and request.remote not in LOOPBACK:
        return web.json_response({"error": "the lab admin API answers loopback clients only"}, status=403)
    return await handler(request)


async def lab_state(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    settings = engine.settings
    return web.json_response(
        {
            "replica_id": settings.replica_id,
            "flavour": settings.flavour,
            "model": settings.model,
            "faults": engine.faults.public(),
            "cache_blocks_used": len(engine.cache),
            "cache_blocks": settings.cache_blocks,
            "sessions": None if engine.sessions is None else len(engine.sessions.expiries),
            "oldest_in_flight": min(engine.in_flight.values(), default=None),  # unix time of its arrival
        }
    )


async def lab_set_faults(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        update = json.loads(await request.read())
        if not isinstance(update, dict):
            raise ValueError("send a JSON object of faults")
        engine.set_faults(faults_from_json(engine.faults, update))
    except ValueError as error:
        return web.json_response({"error": str(error)}, status=400)
    log.info("faults now %s", engine.faults.public())
    return web.json_response(engine.faults.public())


async def lab_reset_cache(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].reset_cache()
    return web.json_response({"cache_blocks_used": 0})


async def lab_expire_sessions(request: web.Request) -> web.Response:
    """The lab's fault: every open SageMaker session expires now."""
    table = request.app[ENGINE_KEY].sessions
    if table is None:
        return web.json_response({"error": "stateful sessions are not enabled on this replica"}, status=409)
    return web.json_response({"expired": table.expire_all()})


async def lab_held(request: web.Request) -> web.Response:
    """Ground truth at a router's decision time: how many tokens of a prompt (`{"tokens": [...]}`) this
    replica's prefix cache would serve now; 0 with prefix caching off, as the engine then serves none."""
    engine = request.app[ENGINE_KEY]
    try:
        tokens = json.loads(await request.read())["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(token, int) for token in tokens):
            raise ValueError("'tokens' must be a list of token ids")
    except (ValueError, KeyError, TypeError) as error:
        return web.json_response({"error": f"send {{'tokens': [ids]}}: {error}"}, status=400)
    held = engine.cache.held(tokens) if engine.faults.prefix_caching else 0
    return web.json_response({"held_tokens": held})


async def lab_ground_truth(request: web.Request) -> web.Response:
    return web.json_response({"records": list(request.app[ENGINE_KEY].ground_truth)})


def make_app(engine: Engine) -> web.Application:
    app = web.Application(middlewares=[dated_arrival, loopback_admin], client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app.add_routes(
        [
            web.post("/v1/chat/completions", chat_completions),
            web.post("/v1/chat/completions/render", render),
            web.post("/tokenize", render),
            web.get("/v1/models", models),
            web.get("/health", health),
            web.get("/ping", health),
            web.post("/ping", health),
            web.post("/invocations", invocations),
            web.get("/metrics", metrics),
            web.get("/lab/state", lab_state),
            web.post("/lab/faults", lab_set_faults),
            web.post("/lab/reset-cache", lab_reset_cache),
            web.post("/lab/expire-sessions", lab_expire_sessions),
            web.get("/lab/ground-truth", lab_ground_truth),
            web.post("/lab/held", lab_held),
        ]
    )
    return app


class PortInUse(KVWatchError, RuntimeError):
    pass


async def until_signalled(on_hangup: Callable[[], None] | None = None) -> None:
    """Return on SIGINT or SIGTERM: a lab process serves until then (and on SIGHUP calls `on_hangup`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if on_hangup is not None:
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
    await stop.wait()


async def serve(settings: ReplicaSettings, port: int) -> None:
    """Serve one replica on 127.0.0.1:port until SIGINT or SIGTERM."""
    engine = Engine(settings)
    engine.sessions = sessions.table_from_environment(os.environ)  # as the container reads its own
    runner = web.AppRunner(make_app(engine), access_log=log)
    await runner.setup()
    loop = asyncio.get_running_loop()
    try:
        server = await loop.create_server(lambda: ArrivalDating(runner.server()), "127.0.0.1", port)
    except OSError as error:
        await runner.cleanup()
        reason = "the port is already in use" if error.errno == errno.EADDRINUSE else error.strerror
        raise PortInUse(f"cannot listen on 127.0.0.1:{port}: {reason}") from error
    log.info("replica %s (%s) listening on http://127.0.0.1:%d", settings.replica_id, settings.flavour, port)
    try:
        await until_signalled()
    finally:
        server.close()  # stop listening first, then finish what is in flight, as a TCPSite does
        await runner.cleanup()
