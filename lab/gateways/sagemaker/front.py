"""The lab's SageMaker runtime: `InvokeEndpoint` and `InvokeEndpointWithResponseStream` for one endpoint
whose instances are the lab's replicas (SageMaker containers: `/ping`, `/invocations`).

What it does as SageMaker does (botocore's service model, AWS's documentation): SigV4 required (the
header's form and its date, never the signature itself); every request header the API does not define is
stripped; `X-Amzn-SageMaker-Session-Id` goes to the container, a `NEW_SESSION` goes to one instance and
the session id the container answers with is pinned to it, a `Closed-Session-Id` unpins; the variant is
named in `x-Amzn-Invoked-Production-Variant`; the stream is AWS's event stream; errors have the shapes
botocore's model gives them. Requests without a session go by the listener's routing strategy.

What SageMaker does when the instance holding a session is gone is not documented: this front forgets
the session and answers a ValidationError naming it.

Run as `python -m kvwatch.lab.gateways.sagemaker.front CONFIG`; SIGHUP re-reads CONFIG.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from kvwatch.core.errors import Unreachable  # a container not answering: refused, reset before an answer
from kvwatch.lab import sessions
from kvwatch.lab.gateways.sagemaker import IGNORE_SESSIONS, LOAD_PATH, errors
from kvwatch.lab.gateways.sagemaker.eventstream import encode_exception, payload_part
from kvwatch.lab.gateways.sagemaker.index import IndexHealth
from kvwatch.lab.gateways.sagemaker.requests import check_signature, forwarded_headers, validated_session
from kvwatch.lab.gateways.sagemaker.routing import STRATEGIES, Instance, Load
from kvwatch.lab.gateways.sagemaker.table import SessionTable
from kvwatch.lab.server import until_signalled

log = logging.getLogger("kvwatch.lab.sagemaker")

GENERATION_PATH = "/-/lab-config"
SESSIONS_PATH = "/-/lab-sessions"
METRICS_PATH = "/metrics"  # the session table's series (the admin listener's, scraped by the lab)
VARIANT_HEADER = "x-Amzn-Invoked-Production-Variant"
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
PREFIX_AWARE_ID = "X-Amzn-SageMaker-Prefix-Aware-Id"
FRONT_KEY = web.AppKey("front", object)
LISTENER_KEY = web.AppKey("listener", str)
OCTETS = "application/octet-stream"


@dataclass(frozen=True)
class FrontConfig:
    generation: str
    endpoint: str
    variant: str
    instances: list[Instance]
    listeners: dict[str, dict]  # name -> {"port": int, "routing": strategy name}
    faults: list[str]
    log_directory: Path
    prefix_length: int
    concurrency_threshold: int
    container_timeout_s: float
    # instance id -> seconds its new requests may wait (while the lab restarts it), at most
    held: dict[str, float] = field(default_factory=dict)
    session_ttl_s: float | None = None  # idle seconds a session stays pinned (table.SessionTable)
    max_sessions: int | None = None  # sessions pinned at most; a new one beyond is refused
    admin_port: int | None = None  # where the session table's metrics are served

    @classmethod
    def load(cls, path: Path) -> FrontConfig:
        data = json.loads(path.read_text())
        data["instances"] = [Instance(**i) for i in data["instances"]]
        data["log_directory"] = Path(data["log_directory"])
        for listener in data["listeners"].values():
            STRATEGIES.lookup(listener["routing"])
        return cls(**data)


class Front:
    """The endpoint's state shared by its listeners: config, the session pins, the load."""

    def __init__(self, config_path: Path):
        self.config_path = config_path
        self.config = FrontConfig.load(config_path)
        self.table = SessionTable(self.config.session_ttl_s, self.config.max_sessions)
        self.index = IndexHealth()
        self.index.follow(self.config.faults)
        self.load = Load()
        self.client: aiohttp.ClientSession | None = None
        self.reloaded = asyncio.Event()  # set, then replaced, at each reload: what held requests await

    def reload(self) -> None:
        try:
            self.config = FrontConfig.load(self.config_path)
        except (OSError, ValueError, TypeError, KeyError) as error:
            log.error("kept the old config: %s cannot be used: %r", self.config_path, error)
            return
        self.table.ttl_s, self.table.capacity = self.config.session_ttl_s, self.config.max_sessions
        self.index.follow(self.config.faults)
        log.info("config %s loaded", self.config.generation)
        self.reloaded.set()
        self.reloaded = asyncio.Event()

    async def released(self, instance: Instance) -> None:
        """Return once the instance is not held (the lab restarts a container under its clients, as
        SageMaker would never show them); Unreachable if it stays held longer than the lab said."""
        deadline = time.monotonic() + self.config.held.get(instance.id, 0.0)
        while instance.id in self.config.held:
            try:
                await asyncio.wait_for(self.reloaded.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise Unreachable(f"instance {instance.id} held for over its timeout") from None

    def instance(self, instance_id: str) -> Instance | None:
        return next((i for i in self.config.instances if i.id == instance_id), None)

    def choose(self, listener: str, body: bytes, headers, excluded: set[str]) -> Instance:
        """An instance for a request without a session, by the listener's routing strategy."""
        candidates = [i for i in self.config.instances if i.id not in excluded]
        candidates = [i for i in candidates if i.id not in self.config.held] or candidates
        if not candidates:
            raise errors.service_unavailable()
        strategy = STRATEGIES.lookup(self.config.listeners[listener]["routing"])
        key = headers.get(PREFIX_AWARE_ID, "").encode() or body[: self.config.prefix_length]
        return strategy.choose(candidates, self.load, key, self.config.concurrency_threshold)

    def learn(self, instance: Instance, answer_headers) -> None:
        """Pin a session the container opened to it; unpin one it closed."""
        if IGNORE_SESSIONS in self.config.faults:
            return
        if opened := answer_headers.get(sessions.NEW_SESSION_HEADER):
            self.table.bind(opened.split(";", 1)[0].strip(), instance.id)
        if closed := answer_headers.get(sessions.CLOSED_SESSION_HEADER):
            self.table.drop(closed.strip(), "close")


@dataclass
class Call:
    """One request on its way through the front."""

    request: web.Request
    streaming: bool
    request_id: str
    region: str = "us-east-1"
    sent_session: str | None = None  # as the client sent it, for the access log
    session_id: str | None = None  # as the container gets it
    instance: Instance | None = None
    tried: tuple[str, ...] = ()
    status: int = 0

    @property
    def front(self) -> Front:
        return self.request.app[FRONT_KEY]

    @property
    def listener(self) -> str:
        return self.request.app[LISTENER_KEY]


async def invoke(request: web.Request) -> web.StreamResponse:
    return await _handle(Call(request, streaming=False, request_id=str(uuid.uuid4())))


async def invoke_streaming(request: web.Request) -> web.StreamResponse:
    return await _handle(Call(request, streaming=True, request_id=str(uuid.uuid4())))


async def _handle(call: Call) -> web.StreamResponse:
    front, request = call.front, call.request
    try:
        call.region = check_signature(request.headers, time.time())
        if request.match_info["name"] != front.config.endpoint:
            raise errors.endpoint_not_found(request.match_info["name"])
        call.sent_session = validated_session(request.headers.get(sessions.SESSION_HEADER), call.streaming)
        call.session_id = None if IGNORE_SESSIONS in front.config.faults else call.sent_session
        body = await request.read()
        headers = forwarded_headers(request.headers, call.streaming, call.session_id)
        upstream = await _send(call, body, headers)
    except errors.AwsError as error:
        call.status = error.status
        _access_log(call)
        return error.response(call.request_id)
    try:
        return await (_stream(call, upstream) if call.streaming else _answer(call, upstream))
    finally:
        upstream.release()
        front.load.outstanding[call.instance.id] -= 1
        if call.session_id:
            front.table.touch(call.session_id)  # idle from the answer's end, not from the request's start
        _access_log(call)


async def _send(call: Call, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
    """The container's answer head: the pinned instance's for a session, else the first instance of the
    strategy's choice that answers. Raises AwsError (the container's error answer: ModelError)."""
    front = call.front
    pinned = front.table.instance_of(call.session_id) if call.session_id else None
    if pinned is None and call.session_id in front.table.idled:
        raise errors.session_expired(call.session_id)
    if pinned is not None:
        call.tried = (pinned,)
        try:
            call.instance = front.instance(pinned)
            if call.instance is None:
                raise Unreachable(f"instance {pinned} is no longer in the endpoint")
            upstream = await _post(front, call.instance, body, headers)
        except Unreachable:
            front.table.drop(call.session_id, "pod_delete")
            raise errors.session_gone(call.session_id) from None
    else:
        if call.session_id == sessions.NEW_SESSION and not front.table.admits():
            raise errors.service_unavailable()
        while True:  # choose() raises ServiceUnavailable once every instance was tried
            call.instance = front.choose(call.listener, body, call.request.headers, set(call.tried))
            call.tried += (call.instance.id,)
            try:
                upstream = await _post(front, call.instance, body, headers)
                break
            except Unreachable:
                continue
    if upstream.status >= 300:
        text = (await upstream.read()).decode(errors="replace")
        upstream.release()
        front.load.outstanding[call.instance.id] -= 1
        if pinned is not None and "session not found" in text:
            front.table.drop(call.session_id, "error")  # the container no longer knows it
        raise errors.model_error(upstream.status, text, front.config.endpoint, call.region)
    front.learn(call.instance, upstream.headers)
    front.index.routed()
    return upstream


async def _post(front: Front, instance: Instance, body: bytes, headers: dict) -> aiohttp.ClientResponse:
    await front.released(instance)
    front.load.outstanding[instance.id] = front.load.outstanding.get(instance.id, 0) + 1
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=front.config.container_timeout_s)
    try:
        url = f"{instance.url}/invocations"
        return await front.client.post(url, data=body, headers=headers, timeout=timeout)
    except (TimeoutError, aiohttp.ClientConnectionError) as error:
        front.load.outstanding[instance.id] -= 1
        log.warning("instance %s unreachable: %r", instance.id, error)
        raise Unreachable(f"instance {instance.id}: {error!r}") from error


def _answer_headers(call: Call, upstream: aiohttp.ClientResponse) -> dict[str, str]:
    headers = {VARIANT_HEADER: call.front.config.variant, "x-amzn-RequestId": call.request_id}
    if attributes := upstream.headers.get(CUSTOM_ATTRIBUTES):
        headers[CUSTOM_ATTRIBUTES] = attributes
    return headers


async def _answer(call: Call, upstream: aiohttp.ClientResponse) -> web.Response:
    headers = _answer_headers(call, upstream)
    for name in (sessions.NEW_SESSION_HEADER, sessions.CLOSED_SESSION_HEADER):
        if value := upstream.headers.get(name):
            headers[name] = value
    headers["Content-Type"] = upstream.headers.get("Content-Type", OCTETS)
    call.status = 200
    return web.Response(body=await upstream.read(), headers=headers)


async def _stream(call: Call, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    """The container's bytes as PayloadPart events as they come; a failure after the start is an
    exception event: ModelStreamError (broken, timed out) or InternalStreamFailure."""
    headers = _answer_headers(call, upstream) | {"Content-Type": "application/vnd.amazon.eventstream"}
    headers["X-Amzn-SageMaker-Content-Type"] = upstream.headers.get("Content-Type", OCTETS)
    response = web.StreamResponse(headers=headers)
    await response.prepare(call.request)
    call.status = 200
    try:
        async for data in upstream.content.iter_any():
            await response.write(payload_part(data))
    except TimeoutError:
        message = "The model did not finish sending its answer in time."
        await response.write(encode_exception("ModelStreamError", message, "ModelInvocationTimeExceeded"))
    except aiohttp.ClientError as error:
        message = f"The connection to the model was reset or closed: {type(error).__name__}"
        await response.write(encode_exception("ModelStreamError", message, "StreamBroken"))
    except Exception as error:  # anything else is the front's own failure, which the client must see
        log.exception("stream of request %s failed", call.request_id)
        await response.write(encode_exception("InternalStreamFailure", f"Internal stream failure: {error!r}"))
    await response.write_eof()
    return response


def _access_log(call: Call) -> None:
    """One line in nginx's JSON format of the lab (collectors.gatewaylogs.nginx) per request."""
    front, now = call.front, time.time()
    opened = call.sent_session in (None, sessions.NEW_SESSION)
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now)),
        "msec": round(now, 3),
        "listener": call.listener,
        "request": f"POST {call.request.path}",
        "status": call.status,
        "upstream_addr": ", ".join(
            i.url.removeprefix("http://") for t in call.tried if (i := front.instance(t)) is not None
        ),
        "session_id": "" if opened else call.sent_session,
        "session_source": "assigned" if opened else "client",
    }
    path = front.config.log_directory / f"gateway-{call.listener}.jsonl"
    with path.open("a") as out:
        out.write(json.dumps(entry) + "\n")


@web.middleware
async def unknown_operation(request: web.Request, handler):
    """A path or method the runtime API does not have: AWS's UnknownOperationException."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
        return errors.unknown_operation().response(str(uuid.uuid4()))


async def generation(request: web.Request) -> web.Response:
    return web.Response(text=request.app[FRONT_KEY].config.generation)


async def pins(request: web.Request) -> web.Response:
    """The lab's view of which instance holds each session (loopback only, as the front listens)."""
    return web.json_response(request.app[FRONT_KEY].table.pins())


async def metrics(request: web.Request) -> web.Response:
    """The session table's and the index's series (table, index), for the lab's Prometheus."""
    front = request.app[FRONT_KEY]
    text = front.table.exposition() + front.index.exposition(i.id for i in front.config.instances)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def load(request: web.Request) -> web.Response:
    """Requests in flight per instance: what the lab waits to drain before it restarts a held one."""
    return web.json_response(request.app[FRONT_KEY].load.outstanding)


def make_app(front: Front, listener: str) -> web.Application:
    app = web.Application(middlewares=[unknown_operation], client_max_size=64 * 1024 * 1024)
    app[FRONT_KEY] = front
    app[LISTENER_KEY] = listener
    app.add_routes(
        [
            web.post("/endpoints/{name}/invocations", invoke),
            web.post("/endpoints/{name}/invocations-response-stream", invoke_streaming),
            web.get(GENERATION_PATH, generation),
            web.get(SESSIONS_PATH, pins),
            web.get(LOAD_PATH, load),
        ]
    )
    return app


def make_admin_app(front: Front) -> web.Application:
    """The admin listener: the session table's metrics and pins, no runtime API."""
    app = web.Application()
    app[FRONT_KEY] = front
    app.add_routes([web.get(METRICS_PATH, metrics), web.get(SESSIONS_PATH, pins)])
    return app


async def serve(config_path: Path) -> None:
    """Serve every listener of the config until SIGINT or SIGTERM; SIGHUP re-reads the config."""
    front = Front(config_path)
    front.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    runners = []
    apps = {
        name: (make_app(front, name), listener["port"]) for name, listener in front.config.listeners.items()
    }
    if front.config.admin_port is not None:
        apps["admin"] = (make_admin_app(front), front.config.admin_port)
    for name, (app, port) in apps.items():
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        log.info("listener %s on 127.0.0.1:%d", name, port)
    try:
        await until_signalled(on_hangup=front.reload)
    finally:
        for runner in runners:
            await runner.cleanup()
        await front.client.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
