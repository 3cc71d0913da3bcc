"""The lab SageMaker front's checks of a request and its error answers, each parsed by botocore's own
rest-json parser with the SageMaker runtime's service model: the exception the AWS SDK raises for it."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import botocore.session
import pytest
from botocore.parsers import RestJSONParser

from kvwatch.core.errors import Unreachable
from kvwatch.lab.gateways.sagemaker import errors
from kvwatch.lab.gateways.sagemaker.front import Front
from kvwatch.lab.gateways.sagemaker.requests import check_signature, forwarded_headers, validated_session
from kvwatch.lab.gateways.sagemaker.routing import STRATEGIES, Instance, Load

NOW = datetime(2026, 12, 5, 4, 30, tzinfo=UTC).timestamp()
SIGNED = {
    "Authorization": "AWS4-HMAC-SHA256 Credential=AKID/20261205/eu-west-1/sagemaker/aws4_request, "
    "SignedHeaders=host;x-amz-date, Signature=abc123",
    "X-Amz-Date": "20261205T043000Z",
}


def raised(error: errors.AwsError) -> tuple[str, dict]:
    """(the botocore exception class's name, the parsed error response) for the front's answer."""
    client = botocore.session.get_session().create_client(
        "sagemaker-runtime", region_name="eu-west-1", aws_access_key_id="a", aws_secret_access_key="b"
    )
    answer = error.response("request-1")
    http = {
        "status_code": answer.status,
        "headers": {name.lower(): value for name, value in answer.headers.items()},
        "body": answer.body,
    }
    model = client.meta.service_model
    parser = RestJSONParser()
    parsed = parser.parse(http, model.operation_model("InvokeEndpoint").output_shape)
    if shape := model.shape_for_error_code(parsed["Error"]["Code"]):  # as botocore's endpoint does
        parsed.update(parser.parse(http, shape))
    return client.exceptions.from_code(parsed["Error"]["Code"]).__name__, parsed


def test_a_model_error_carries_the_containers_status_and_message():
    name, parsed = raised(errors.model_error(400, "session not found: s1", "lab-endpoint", "eu-west-1"))
    assert name == "ModelError"
    assert parsed["OriginalStatusCode"] == 400
    assert parsed["OriginalMessage"] == "session not found: s1"
    assert parsed["LogStreamArn"].startswith("arn:aws:logs:eu-west-1:")
    assert parsed["ResponseMetadata"]["HTTPStatusCode"] == 424


@pytest.mark.parametrize(
    "error, exception, status",
    [
        (errors.endpoint_not_found("x"), "ValidationError", 400),
        (errors.session_gone("s1"), "ValidationError", 400),
        (errors.service_unavailable(), "ServiceUnavailable", 503),
        (errors.missing_token(), "ClientError", 403),
        (errors.incomplete_signature("no"), "ClientError", 403),
        (errors.invalid_signature("no"), "ClientError", 403),
        (errors.unknown_operation(), "ClientError", 404),
    ],
)
def test_each_error_answer_is_the_exception_botocore_models(error, exception, status):
    name, parsed = raised(error)
    assert name == exception
    assert parsed["Error"]["Code"] == error.code
    assert parsed["Error"]["Message"] == error.members["Message"]
    assert parsed["ResponseMetadata"]["HTTPStatusCode"] == status


def test_a_signed_request_names_its_region():
    assert check_signature(SIGNED, NOW) == "eu-west-1"


@pytest.mark.parametrize(
    "headers, code, words",
    [
        ({}, "MissingAuthenticationTokenException", "Missing Authentication Token"),
        ({**SIGNED, "Authorization": "Bearer key"}, "IncompleteSignatureException", "'Credential'"),
        ({"Authorization": SIGNED["Authorization"]}, "IncompleteSignatureException", "X-Amz-Date"),
        (
            {**SIGNED, "Authorization": SIGNED["Authorization"].replace("/sagemaker/", "/s3/")},
            "InvalidSignatureException",
            "scoped to correct service",
        ),
        ({**SIGNED, "X-Amz-Date": "20261205T042000Z"}, "InvalidSignatureException", "Signature expired"),
        ({**SIGNED, "X-Amz-Date": "yesterday"}, "IncompleteSignatureException", "basic format"),
    ],
)
def test_a_missing_incomplete_misscoped_or_stale_signature_is_refused(headers, code, words):
    with pytest.raises(errors.AwsError) as refused:
        check_signature(headers, NOW)
    assert (refused.value.status, refused.value.code) == (403, code)
    assert words in refused.value.members["Message"]


@pytest.mark.parametrize(
    "signed_at, message",
    [
        # AWS's words, as botocore's users quote them (boto/botocore#3587, aws/aws-sdk-js#1652).
        (
            "20261205T042000Z",
            "Signature expired: 20261205T042000Z is now earlier than 20261205T042500Z "
            "(20261205T043000Z - 5 min.)",
        ),
        (
            "20261205T045000Z",
            "Signature not yet current: 20261205T045000Z is still later than 20261205T043500Z "
            "(20261205T043000Z + 5 min.)",
        ),
    ],
)
def test_a_signature_dated_over_5_minutes_off_is_refused_in_aws_words(signed_at, message):
    with pytest.raises(errors.AwsError) as refused:
        check_signature({**SIGNED, "X-Amz-Date": signed_at}, NOW)
    assert (refused.value.code, refused.value.members["Message"]) == ("InvalidSignatureException", message)
    check_signature({**SIGNED, "X-Amz-Date": "20261205T043459Z"}, NOW)  # 4:59 ahead: accepted


def test_new_session_opens_only_on_invoke_endpoint():
    assert validated_session("NEW_SESSION", streaming=False) == "NEW_SESSION"
    assert validated_session("abc-123", streaming=True) == "abc-123"
    assert validated_session(None, streaming=True) is None
    with pytest.raises(errors.AwsError, match="sessionId.*regular expression"):
        validated_session("NEW_SESSION", streaming=True)


@pytest.mark.parametrize("session_id", ["-abc", "a_b", "x" * 257])
def test_a_session_id_off_the_models_pattern_or_length_is_a_validation_error(session_id):
    with pytest.raises(errors.AwsError) as refused:
        validated_session(session_id, streaming=False)
    assert refused.value.code == "ValidationError"


def test_only_the_apis_headers_reach_the_container():
    sent = {
        **SIGNED,
        "Content-Type": "application/json",
        "X-Amzn-SageMaker-Accept": "text/event-stream",
        "Accept": "application/json",
        "X-Session-Id": "custom",
        "X-Amzn-SageMaker-Custom-Attributes": "trace=1",
        "User-Agent": "Boto3",
    }
    assert forwarded_headers(sent, streaming=True, session_id="s1") == {
        "Content-Type": "application/json",
        "X-Amzn-SageMaker-Custom-Attributes": "trace=1",
        "Accept": "text/event-stream",
        "X-Amzn-SageMaker-Session-Id": "s1",
    }
    assert forwarded_headers(sent, streaming=False, session_id=None)["Accept"] == "application/json"


INSTANCES = [Instance(f"r{i}", f"http://127.0.0.1:{9000 + i}") for i in range(3)]


def test_least_outstanding_requests_picks_the_idlest_instance():
    load = Load(outstanding={"r0": 2, "r1": 0, "r2": 1})
    assert STRATEGIES["LEAST_OUTSTANDING_REQUESTS"].choose(INSTANCES, load, None, 8).id == "r1"


def test_prefix_aware_keeps_a_prefix_on_one_instance_until_the_threshold():
    strategy, load = STRATEGIES["PREFIX_AWARE"], Load()
    chosen = {strategy.choose(INSTANCES, load, b"same system prompt", 2).id for _ in range(20)}
    assert len(chosen) == 1
    (home,) = chosen
    load.outstanding[home] = 2
    assert strategy.choose(INSTANCES, load, b"same system prompt", 2).id != home


def test_random_spreads_requests():
    load = Load()
    assert {STRATEGIES["RANDOM"].choose(INSTANCES, load, None, 8).id for _ in range(60)} == {"r0", "r1", "r2"}


def front_config(tmp_path, held: dict[str, float]):
    """A front.json of two instances, `held` holding (for so many seconds at most), and its path."""
    path = tmp_path / "front.json"
    config = {
        "generation": f"g-{'-'.join(sorted(held))}", "endpoint": "lab-endpoint", "variant": "AllTraffic",
        "instances": [{"id": "r1", "url": "http://127.0.0.1:9"}, {"id": "r2", "url": "http://127.0.0.1:9"}],
        "listeners": {"affinity": {"port": 9, "routing": "RANDOM"}}, "faults": [],
        "log_directory": str(tmp_path), "prefix_length": 1024, "concurrency_threshold": 8,
        "container_timeout_s": 30.0, "held": held,
    }  # fmt: skip
    path.write_text(json.dumps(config))
    return path


def test_a_held_instances_requests_wait_for_the_config_that_releases_it(tmp_path):
    async def scenario():
        front = Front(front_config(tmp_path, held={"r1": 60.0}))
        waiting = asyncio.create_task(front.released(Instance("r1", "http://127.0.0.1:9")))
        await asyncio.sleep(0)  # the task runs until it waits
        assert not waiting.done()
        await front.released(Instance("r2", "http://127.0.0.1:9"))  # another instance's go through
        front_config(tmp_path, held={})
        front.reload()
        await asyncio.wait_for(waiting, 10)

    asyncio.run(scenario())


def test_an_instance_held_longer_than_the_lab_said_is_unreachable(tmp_path):
    async def scenario():
        front = Front(front_config(tmp_path, held={"r1": 0.05}))
        with pytest.raises(Unreachable, match="held"):
            await front.released(Instance("r1", "http://127.0.0.1:9"))

    asyncio.run(scenario())


def test_requests_without_a_session_go_to_instances_not_held(tmp_path):
    front = Front(front_config(tmp_path, held={"r1": 60.0}))
    assert {front.choose("affinity", b"{}", {}, set()).id for _ in range(20)} == {"r2"}
    front_config(tmp_path, held={"r1": 60.0, "r2": 60.0})
    front.reload()  # every instance held: the request waits for one
    assert {front.choose("affinity", b"{}", {}, set()).id for _ in range(20)} == {"r1", "r2"}
