"""The simulated replica's SageMaker container half against real vLLM 0.32's (AWS's
model-hosting-container-standards session manager): the same session requests, the same answers.
Then the whole path with real vLLM behind the lab's SageMaker front, through the real botocore."""

from __future__ import annotations

import json
import re

import pytest
from sagemaker_client import Conversation, close_session, open_session

from processes import http_get, http_post

SESSION = "X-Amzn-SageMaker-Session-Id"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def answer(url: str, body, session_id: str | None = None) -> dict:
    """An /invocations answer with the ids it names replaced, so two containers' answers compare."""
    headers = {"Content-Type": "application/json"} | ({SESSION: session_id} if session_id else {})
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http_post(f"{url}/invocations", content=content, headers=headers, timeout=120)
    kept = {
        name.lower(): UUID.sub("<id>", value)
        for name, value in response.headers.items()
        if name.lower().startswith("x-amzn-sagemaker")
    }
    text = response.text
    if response.headers.get("content-type", "").startswith("application/json"):
        error = response.json().get("error", {})
        text = {key: error.get(key) for key in ("message", "type", "code")} if error else "(answer)"
    if isinstance(text, dict) and text["message"].startswith("["):  # pydantic's list of problems
        text["message"] = sorted(problem["type"] for problem in json.loads(text["message"]))
    elif isinstance(text, str):
        text = UUID.sub("<id>", text)
    else:
        text["message"] = UUID.sub("<id>", text["message"])
    return {"status": response.status_code, "headers": _dates_out(kept), "body": text}


def _dates_out(headers: dict[str, str]) -> dict[str, str]:
    return {name: re.sub(r"Expires=\S+", "Expires=<date>", value) for name, value in headers.items()}


CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2, "ignore_eos": True}


def session_protocol(url: str) -> list[dict]:
    """Every session request of the protocol, in order, and the container's answers."""
    opened = http_post(f"{url}/invocations", json={"requestType": "NEW_SESSION"}, timeout=60)
    session_id = opened.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
    return [
        answer(url, {"requestType": "NEW_SESSION"}),
        answer(url, CHAT, session_id),
        answer(url, {"requestType": "NEW_SESSION", "extra": 1}),
        answer(url, {"requestType": "OPEN"}),
        answer(url, b"not json"),
        answer(url, {"requestType": "CLOSE"}),
        answer(url, {"requestType": "CLOSE"}, session_id),
        answer(url, CHAT, session_id),
        answer(url, {"requestType": "CLOSE"}, session_id),
        answer(url, CHAT, "never-opened"),
        answer(url, CHAT),
    ]


def disabled_protocol(url: str) -> list[dict]:
    return [
        answer(url, {"requestType": "NEW_SESSION"}),
        answer(url, CHAT, "some-session"),
        answer(url, {"requestType": "CLOSE"}, "some-session"),
        answer(url, CHAT),
    ]


@pytest.fixture(scope="module")
def real_container(vllm_sagemaker_lab) -> str:
    return vllm_sagemaker_lab.replica_url("r1")


def test_the_simulated_container_answers_session_requests_as_real_vllm(real_container, start_replica):
    sim = start_replica(
        "s1", "vllm", "--model", "lab-model", env={"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true"}
    )
    assert http_get(f"{sim.url}/ping", timeout=5).status_code == 200
    assert http_get(f"{real_container}/ping", timeout=5).status_code == 200
    real = session_protocol(real_container)
    assert real[0]["headers"] == {"x-amzn-sagemaker-new-session-id": "<id>; Expires=<date>"}
    assert session_protocol(sim.url) == real


def test_without_the_variable_both_refuse_sessions_alike(vllm_lab, start_replica):
    sim = start_replica("s2", "vllm", "--model", vllm_lab.status["model"])
    real = disabled_protocol(vllm_lab.replica_url("r1"))
    assert real[0]["body"]["message"] == "Invalid payload. stateful sessions not enabled"
    assert disabled_protocol(sim.url) == real


def test_real_vllm_behind_the_front_keeps_a_session_and_reuses_its_prefix(
    vllm_sagemaker_lab, sagemaker_runtime
):
    client = sagemaker_runtime(vllm_sagemaker_lab.affinity)
    session_id, opened = open_session(client)
    assert opened["Body"] == f"Session {session_id} created".encode()
    conversation = Conversation(client, "real", system_words=300, max_tokens=4, session_id=session_id)
    for question in ("first", "second", "third"):
        conversation.round(question)
    block = 128  # vLLM's on CPU
    for before, usage in zip(conversation.usages, conversation.usages[1:], strict=False):
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % block == 0
        assert cached >= before["prompt_tokens"] // block * block
    assert close_session(client, session_id)["ClosedSessionId"] == session_id
    with pytest.raises(client.exceptions.ModelError) as refused:
        conversation.round("after the close")
    assert f"session not found: {session_id}" in refused.value.response["OriginalMessage"]
