"""Scaffolding of the sagemaker target's tests: botocore's real client answered from a script."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Callable

import botocore.session
from botocore.awsrequest import AWSResponse
from botocore.response import StreamingBody

from kvwatch.collectors.probe.conversation import run_conversation
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.targets.sagemaker import Runtime, SageMakerEndpoint, SageMakerExchange
from kvwatch.collectors.probe.workload import Conversation

ENDPOINT = SageMakerEndpoint("chat-endpoint", "us-east-1", endpoint_url="http://127.0.0.1:9")
SECRET_KEY = "kvw-aws-secret-7d3b5f1c0e9a"  # distinctive, so that a leak is found
CONVERSATION = Conversation("You are brief.", ("one", "two", "three"))


def settings(**changes) -> ProbeSettings:
    base = {"base_url": ENDPOINT.base_url, "model": "m", "kind": "sagemaker", "sagemaker": ENDPOINT}
    return ProbeSettings(**{**base, **changes})


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def answer_text(content: str, prompt: int, cached: int | None) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": 2}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return sse(
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": content}}]},
        {"choices": [], "usage": usage},
    )


def parts(text: bytes, *cuts: int) -> list[dict]:
    """`text` as PayloadPart events, cut at `cuts`."""
    edges = [0, *cuts, len(text)]
    return [{"PayloadPart": {"Bytes": text[a:b]}} for a, b in zip(edges, edges[1:], strict=False)]


class Scripted:
    """botocore's real sagemaker-runtime client whose calls are answered in turn by `answers`, from its
    before-call event as botocore's Stubber answers (Stubber refuses a stream's events); each request,
    as botocore serialized it, is kept in `requests`."""

    def __init__(self, *answers: Callable[[], tuple[int, dict]]) -> None:
        self.answers, self.requests = list(answers), []
        session = botocore.session.get_session()
        self.client = session.create_client(
            "sagemaker-runtime",
            region_name="us-east-1",
            endpoint_url="http://127.0.0.1:9",
            aws_access_key_id="AKIDEXAMPLE",
            aws_secret_access_key=SECRET_KEY,
        )
        self.client.meta.events.register("before-call.sagemaker-runtime", self._answer)

    def _answer(self, model, params, **_) -> tuple[AWSResponse, dict]:
        self.requests.append((model.name, params["headers"], params["body"]))
        status, parsed = self.answers.pop(0)()
        parsed.setdefault("ResponseMetadata", {}).setdefault("HTTPStatusCode", status)
        return AWSResponse(None, status, {}, None), parsed

    def session_ids(self) -> list[tuple[str, str | None]]:
        return [(name, headers.get("X-Amzn-SageMaker-Session-Id")) for name, headers, _ in self.requests]


def opened(session_id: str, expires: str = "2099-01-01T00:00:00Z"):
    text = f"Session {session_id} created".encode()
    body = {
        "Body": StreamingBody(io.BytesIO(text), len(text)),
        "NewSessionId": f"{session_id}; Expires={expires}",
    }
    return lambda: (200, body)


def closed(session_id: str):
    return lambda: (200, {"Body": StreamingBody(io.BytesIO(b""), 0), "ClosedSessionId": session_id})


class EventBody:
    """botocore's EventStream as the exchange reads it: parsed events, and a close()."""

    def __init__(self, events) -> None:
        self.events = events

    def __iter__(self):
        return iter(self.events)

    def close(self) -> None:
        pass


def streamed(events, custom: str | None = None, headers: dict | None = None):
    def answer():
        parsed = {
            "Body": EventBody(events() if callable(events) else events),
            "ResponseMetadata": {"HTTPHeaders": headers or {}},
        }
        if custom:
            parsed["CustomAttributes"] = custom
        return 200, parsed

    return answer


def refused(status: int, code: str, message: str, **modeled):
    return lambda: (status, {"Error": {"Code": code, "Message": message}, **modeled})


def converse(scripted: Scripted, conversation: Conversation = CONVERSATION, **changes):
    exchange = SageMakerExchange(Runtime(scripted.client, threads=2), settings(**changes))

    async def run():
        try:
            return await run_conversation(exchange, exchange.settings, conversation)
        finally:
            await exchange.runtime.aclose()

    return asyncio.run(run())


def round_events(prompt: int, cached: int | None) -> list[dict]:
    text = answer_text("hi", prompt, cached)
    return parts(text, 10, len(text) // 2)
