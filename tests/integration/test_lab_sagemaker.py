"""`kvwatch lab up --gateway sagemaker` with simulated replicas, driven by the real AWS SDK (botocore):
sessions opened, pinned, reused, closed; the errors botocore raises; the front's faults."""

from __future__ import annotations

import json

import botocore
import pytest
from botocore.exceptions import ClientError
from sagemaker_client import ENDPOINT, JSON, Conversation, close_session, open_session, stream_text

from processes import http_get, http_post

REPLICAS = ("r1", "r2", "r3")


@pytest.fixture(scope="module")
def lab(start_lab):
    """No probes: their rounds would share the front's load counts with the tests' own, and the
    least-outstanding choice would then follow the probes' timing, not the strategy's."""
    return start_lab("--gateway", "sagemaker", "--replicas", "3", "--time-scale", "0.1", "--no-probes")


@pytest.fixture
def client(lab, sagemaker_runtime):
    yield sagemaker_runtime(lab.affinity)
    if json.loads(lab.cli("status", "--json").stdout)["faults"]:  # a test that failed before its heal
        lab.cli("heal")


def pins(lab) -> dict[str, str]:
    return http_get(f"{lab.affinity}/-/lab-sessions", timeout=5).json()


def records(lab, session_id: str | None = None) -> dict[str, list[dict]]:
    """Each running replica's ground-truth records of chat requests, of one session if given."""
    found = {}
    for replica in REPLICAS:
        url = lab.replica_url(replica)
        if url is None:
            continue
        truth = http_get(f"{url}/lab/ground-truth", timeout=5).json()["records"]
        found[replica] = [
            r for r in truth if "prompt_tokens" in r and (session_id is None or r["session_id"] == session_id)
        ]
    return found


def fault(lab, *args: str) -> str:
    result = lab.cli("fault", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_lab_status_names_the_endpoint(lab):
    assert lab.status["sagemaker"] == {
        "endpoint": ENDPOINT, "variant": "AllTraffic", "routing": "LEAST_OUTSTANDING_REQUESTS"
    }  # fmt: skip
    assert lab.status["traffic_users"] == 0
    printed = "sagemaker endpoint   lab-endpoint (variant AllTraffic, LEAST_OUTSTANDING_REQUESTS)"
    assert printed in lab.up_output


def test_a_session_stays_on_the_instance_that_opened_it_and_reuses_its_prefix(lab, client):
    session_id, opened = open_session(client)
    assert opened["InvokedProductionVariant"] == "AllTraffic"
    assert opened["Body"] == f"Session {session_id} created".encode()
    home = pins(lab)[session_id]
    conversation = Conversation(client, "pin", session_id=session_id)
    for question in ("first", "second", "third"):
        answer = conversation.round(question)
        assert answer["InvokedProductionVariant"] == "AllTraffic"
        assert answer["ContentType"] == "text/event-stream"
    by_replica = {replica: len(found) for replica, found in records(lab, session_id).items() if found}
    assert by_replica == {home: 3}
    assert conversation.usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    for usage in conversation.usages[1:]:  # every full block of the round before is reused
        block = 16
        assert (
            usage["prompt_tokens_details"]["cached_tokens"] >= (usage["prompt_tokens"] - 40) // block * block
        )
    closed = close_session(client, session_id)
    assert closed["ClosedSessionId"] == session_id
    assert session_id not in pins(lab)
    with pytest.raises(client.exceptions.ModelError) as refused:
        conversation.round("after the close")
    assert refused.value.response["OriginalStatusCode"] == 400
    assert f"session not found: {session_id}" in refused.value.response["OriginalMessage"]


def test_an_unknown_session_id_is_the_containers_400_as_a_model_error(client):
    with pytest.raises(client.exceptions.ModelError) as refused:
        Conversation(client, "unknown", session_id="no-such-session").round("hello")
    assert refused.value.response["Error"]["Code"] == "ModelError"
    assert refused.value.response["OriginalStatusCode"] == 400
    assert "Bad request: session not found: no-such-session" in refused.value.response["OriginalMessage"]


def test_a_session_cannot_be_opened_on_the_stream(client):
    with pytest.raises(client.exceptions.ValidationError, match="sessionId"):
        stream_text(client, {"requestType": "NEW_SESSION"}, session_id="NEW_SESSION")


def test_an_unknown_endpoint_is_a_validation_error(client):
    with pytest.raises(client.exceptions.ValidationError, match="Endpoint other of account"):
        client.invoke_endpoint(EndpointName="other", Body=b"{}", ContentType=JSON)


def test_an_unsigned_request_is_refused_as_aws_refuses_it(lab, sagemaker_runtime):
    unsigned = sagemaker_runtime(lab.affinity, signature_version=botocore.UNSIGNED)
    with pytest.raises(ClientError) as refused:
        unsigned.invoke_endpoint(EndpointName=ENDPOINT, Body=b"{}", ContentType=JSON)
    assert refused.value.response["Error"]["Code"] == "MissingAuthenticationTokenException"
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    raw = http_post(f"{lab.affinity}/endpoints/{ENDPOINT}/invocations", content=b"{}", timeout=5)
    assert raw.status_code == 403
    assert raw.headers["x-amzn-ErrorType"].startswith("MissingAuthenticationTokenException")


def test_headers_the_api_does_not_define_never_reach_the_container(lab, client):
    def add_custom_header(request, **_):
        request.headers["X-Session-Id"] = "custom-header-session"

    client.meta.events.register("before-sign.sagemaker-runtime.*", add_custom_header)
    session_id, _ = open_session(client)
    Conversation(client, "strip", session_id=session_id).round("hello")
    Conversation(client, "strip-none").round("hello")
    seen = {r["session_id"] for found in records(lab).values() for r in found}
    assert session_id in seen  # the replica names a request's session by X-Session-Id first
    assert "custom-header-session" not in seen
    close_session(client, session_id)


def test_without_a_session_the_listener_routes_by_its_strategy(lab, client):
    before = {replica: len(found) for replica, found in records(lab).items()}
    for index in range(12):
        Conversation(client, f"spread{index}", system_words=20).round("hello")
    after = {replica: len(found) for replica, found in records(lab).items()}
    assert all(after[replica] > before[replica] for replica in REPLICAS), (before, after)


def test_fault_ignore_session_ids_spreads_a_sessions_rounds_and_loses_its_reuse(lab, client):
    assert "ignore-session-ids" in fault(lab, "ignore-session-ids")
    session_id, _ = open_session(client)
    assert session_id not in pins(lab)
    conversation = Conversation(client, "ignored", session_id=session_id)
    for index in range(10):
        conversation.round(f"question {index}")
    log = lab.access_log(
        "affinity", lambda entries: sum(e["session_id"] == session_id for e in entries) == 10
    )
    upstreams = {e["upstream_addr"] for e in log if e["session_id"] == session_id}
    assert len(upstreams) > 1
    assert not any(records(lab, session_id).values())  # the id never reached a container
    assert min(u["prompt_tokens_details"]["cached_tokens"] for u in conversation.usages[1:]) == 0
    with pytest.raises(client.exceptions.ModelError, match="invalid session_id: None"):
        close_session(client, session_id)
    lab.cli("heal")
    session_id, _ = open_session(client)
    assert session_id in pins(lab)


def test_fault_expire_sessions_serves_the_next_round_without_it_then_refuses_the_id(lab, client):
    session_id, _ = open_session(client)
    conversation = Conversation(client, "expiring", session_id=session_id)
    conversation.round("first")
    assert "expired" in fault(lab, "expire-sessions")
    conversation.round("second")  # as the container does: the expired session is dropped, not refused
    with pytest.raises(client.exceptions.ModelError) as refused:
        conversation.round("third")
    assert f"session not found: {session_id}" in refused.value.response["OriginalMessage"]
    lab.cli("heal")


def test_fault_kill_replica_loses_its_sessions_and_the_front_says_which(lab, client):
    session_id, _ = open_session(client)
    conversation = Conversation(client, "killed", session_id=session_id)
    conversation.round("first")
    home = pins(lab)[session_id]
    fault(lab, "kill-replica", home)
    with pytest.raises(client.exceptions.ValidationError, match=f"Session {session_id} is not available"):
        conversation.round("second")
    assert session_id not in pins(lab)
    other, _ = open_session(client)  # new sessions open on the instances still in service
    assert pins(lab)[other] != home
    lab.cli("heal")


def test_fault_disable_sessions_restarts_the_containers_without_them(lab, client):
    session_id, _ = open_session(client)
    assert "without SAGEMAKER_ENABLE_STATEFUL_SESSIONS" in fault(lab, "disable-sessions")
    with pytest.raises(client.exceptions.ModelError) as refused:
        open_session(client)
    assert refused.value.response["OriginalStatusCode"] == 400
    assert "Invalid payload. stateful sessions not enabled" in refused.value.response["OriginalMessage"]
    with pytest.raises(client.exceptions.ModelError, match="header not supported"):
        Conversation(client, "disabled", session_id=session_id).round("hello")
    Conversation(client, "disabled").round("hello")  # requests without a session are served
    lab.cli("heal")
    assert open_session(client)[0]


def test_faults_of_another_gateway_are_refused(lab):
    result = lab.cli("fault", "break-affinity")
    assert result.returncode != 0
    assert "ignore-session-ids" in result.stderr
