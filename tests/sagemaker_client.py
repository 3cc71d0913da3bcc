"""Conversations through a lab SageMaker front with the real AWS SDK (botocore), as a client of a
SageMaker endpoint holds them: open a session, stream rounds with its SessionId, close it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

ENDPOINT = "lab-endpoint"
JSON = "application/json"


def open_session(client) -> tuple[str, dict]:
    """A new session's id and the whole InvokeEndpoint answer."""
    answer = client.invoke_endpoint(
        EndpointName=ENDPOINT, Body=json.dumps({"requestType": "NEW_SESSION"}), ContentType=JSON,
        SessionId="NEW_SESSION",
    )  # fmt: skip
    return answer["NewSessionId"].split(";", 1)[0], answer


def close_session(client, session_id: str) -> dict:
    return client.invoke_endpoint(
        EndpointName=ENDPOINT,
        Body=json.dumps({"requestType": "CLOSE"}),
        ContentType=JSON,
        SessionId=session_id,
    )


def stream_text(client, body: dict, session_id: str | None = None) -> tuple[str, dict]:
    """The text of a streamed answer (its PayloadParts joined) and the answer's other fields."""
    options = {"SessionId": session_id} if session_id else {}
    answer = client.invoke_endpoint_with_response_stream(
        EndpointName=ENDPOINT, Body=json.dumps(body), ContentType=JSON, **options
    )
    text = b"".join(event["PayloadPart"]["Bytes"] for event in answer["Body"]).decode()
    return text, answer


def usage_of(sse: str) -> dict:
    """The usage chunk of an SSE chat stream."""
    chunks = [json.loads(line[6:]) for line in sse.split("\n\n") if line.startswith("data: {")]
    return next(chunk["usage"] for chunk in reversed(chunks) if chunk.get("usage"))


@dataclass
class Conversation:
    """A growing chat whose rounds stream through the front; `usages` holds each round's usage."""

    client: object
    topic: str
    system_words: int = 300
    max_tokens: int = 8
    session_id: str | None = None
    messages: list[dict] = field(default_factory=list)
    usages: list[dict] = field(default_factory=list)

    def __post_init__(self):
        system = " ".join(f"{self.topic}{i}" for i in range(self.system_words))
        self.messages = [{"role": "system", "content": system}]

    def round(self, question: str) -> dict:
        self.messages.append({"role": "user", "content": question})
        body = {
            "messages": self.messages, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        text, answer = stream_text(self.client, body, self.session_id)
        self.usages.append(usage_of(text))
        self.messages.append({"role": "assistant", "content": f"answer {len(self.usages)}"})
        return answer
