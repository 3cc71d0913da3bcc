"""Conversations through a lab SageMaker front with the real AWS SDK (botocore), as a client of a
SageMaker endpoint holds them: open a session, stream rounds with its SessionId, close it; and kvwatch's
SageMaker target on the command line against such a front."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field

from conftest import Lab, kvwatch
from kvwatch.lab.gateways.sagemaker import LAB_CREDENTIALS, LAB_REGION

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


# --- kvwatch's SageMaker target ------------------------------------------------------------------------

MODEL = "lab-model"


def use_lab_credentials(monkeypatch, tmp_path) -> None:
    """The lab's dummy credentials in the environment the commands inherit; never the user's files."""
    for name, value in LAB_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def endpoint(url: str, model: str = MODEL) -> list[str]:
    return ["--sagemaker-endpoint", ENDPOINT, "--region", LAB_REGION, "--endpoint-url", url, "--model", model]


def probe_json(lab: Lab, *options: str, timeout: float = 180) -> tuple[dict, subprocess.CompletedProcess]:
    result = kvwatch(
        "probe", *endpoint(lab.affinity, lab.status.get("model", MODEL)), "--prometheus",
        lab.status["prometheus"], "--json", *options, timeout=timeout,
    )  # fmt: skip
    assert result.stdout, result.stderr
    return json.loads(result.stdout), result


def fault(lab: Lab, *args: str) -> str:
    result = lab.cli("fault", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def assert_sticky_by_reuse(report: dict, block: int) -> None:
    """Every session sticky, judged by reuse: each warm round cached all its ideal tokens, block-aligned."""
    assert report["block_size"]["tokens"] == block, report["block_size"]
    for session in report["sessions"]:
        assert session["ok"] and session["closed"], session
        assert (session["sticky"], session["evidence"], session["session_losses"]) == (True, "reuse", [])
        first, *warm = session["rounds"]
        assert first["ideal_cached_tokens"] == 0 and first["ttft_seconds"] > 0
        for r in warm:
            assert r["ttft_seconds"] > 0 and r["session_id_sent"] == session["session_id"], r
            assert r["ideal_cached_tokens"] > 0 and r["ideal_cached_tokens"] % block == 0, r
            assert r["cached_tokens"] == r["ideal_cached_tokens"], r
