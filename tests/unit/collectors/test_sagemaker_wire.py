"""The sagemaker target over HTTP: botocore signs, sends and parses for real against a loopback server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import socket
import threading

import pytest
from loopback import QuietHandler, loopback_http
from sagemaker_kit import ENDPOINT, SECRET_KEY, settings

from kvwatch.collectors.probe.targets import ProbeClients, probe_once
from kvwatch.collectors.probe.targets.sagemaker import SageMakerEndpoint
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.config.settings import Config, StoreSettings, Target, Workload
from kvwatch.lab.gateways.sagemaker.eventstream import encode_exception, payload_part
from kvwatch.serve.scheduler import Service

# Over the wire: botocore signs, sends and parses for real, against a loopback server.


class RuntimeFront(QuietHandler):
    """Opens sessions, and refuses every streamed round's session as SageMaker refuses an unknown one."""

    seen: list[dict] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen.append({"path": self.path, **dict(self.headers.items())})
        if self.path.endswith("/invocations"):
            self.send_response(200)
            self.send_header(
                "X-Amzn-SageMaker-New-Session-Id", f"s-{len(self.seen)}; Expires=2099-01-01T00:00:00Z"
            )
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"message": f"session not found: s-{len(self.seen) - 1}"}).encode()
        self.send_response(400)
        self.send_header("x-amzn-ErrorType", "ValidationError")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class StreamCutShort(QuietHandler):
    """Streams a part of an answer and a ModelStreamError event, then holds the connection open (the
    chunked body never ends) until the client closes it, which `closed` tells."""

    protocol_version = "HTTP/1.1"
    closed = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.amazon.eventstream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = payload_part(b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n') + encode_exception(
            "ModelStreamError", "model stream timed out", "ModelStreamError"
        )
        self.wfile.write(b"%x\r\n%s\r\n" % (len(events), events))
        self.wfile.flush()
        self.connection.settimeout(30)
        with contextlib.suppress(OSError):
            while self.connection.recv(1024):
                pass
        type(self).closed.set()
        self.close_connection = True


def over_the_wire(monkeypatch, front: type[QuietHandler] = RuntimeFront, **changes):
    """One round of one conversation through botocore, to `front`."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    RuntimeFront.seen = []
    with loopback_http(front) as url:
        endpoint = SageMakerEndpoint("chat-endpoint", "us-east-1", endpoint_url=url)
        over = settings(sagemaker=endpoint, base_url=url, **changes)
        (session,) = probe_once(over, [Conversation("s", ("one",))])
    return session


def test_a_stream_cut_short_has_its_connection_closed_at_once_not_left_to_the_garbage_collector(monkeypatch):
    StreamCutShort.closed.clear()
    gc.disable()  # what the garbage collector would close late is not closed by it here
    try:
        session = over_the_wire(monkeypatch, StreamCutShort, session_mode="none")
        assert session.rounds[0].error_kind == "model_stream_error", session.rounds[0]
        assert StreamCutShort.closed.wait(10), "the connection of the stream cut short is still open"
    finally:
        gc.enable()


def test_over_http_botocore_signs_sends_the_session_header_and_a_refusal_reopens(monkeypatch):
    session = over_the_wire(monkeypatch)
    paths = [(seen["path"], seen.get("X-Amzn-SageMaker-Session-Id")) for seen in RuntimeFront.seen]
    assert paths == [
        ("/endpoints/chat-endpoint/invocations", "NEW_SESSION"),
        ("/endpoints/chat-endpoint/invocations-response-stream", "s-1"),
        ("/endpoints/chat-endpoint/invocations", "NEW_SESSION"),
        ("/endpoints/chat-endpoint/invocations-response-stream", "s-3"),
        ("/endpoints/chat-endpoint/invocations", "s-3"),
    ]
    assert all(
        seen["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
        for seen in RuntimeFront.seen
    )
    (failed,) = session.rounds
    assert (failed.error_kind, failed.status) == ("http_error", 400)
    assert session.session_losses == ((1, "not_found"),) and session.closed is False
    assert SECRET_KEY not in repr(session)


def test_a_custom_session_header_is_sent_as_configured_and_no_session_is_opened(monkeypatch):
    session = over_the_wire(monkeypatch, session_header="X-Session-Id")
    (seen,) = RuntimeFront.seen
    assert seen["path"] == "/endpoints/chat-endpoint/invocations-response-stream"
    assert (
        "X-Amzn-SageMaker-Session-Id" not in seen
        and seen["X-Session-Id"] == session.rounds[0].session_id_sent
    )
    assert "x-session-id" in seen["Authorization"]  # signed with the request, as an SDK hook would add it
    assert session.session_id is None and session.closed is None


def test_no_aws_credentials_is_a_credentials_error_named_so(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    (session,) = probe_once(settings(), [Conversation("s", ("one",))])
    assert session.rounds[0].error_kind == "credentials_error"
    assert "Unable to locate credentials" in session.rounds[0].error_detail


@pytest.mark.parametrize("where", ["config", "environment"])
def test_an_aws_profile_that_is_not_there_fails_the_run_as_a_credentials_error_naming_it(
    monkeypatch, tmp_path, where
):
    """botocore refuses to make a client for a profile its shared files do not have: the run fails as the
    credentials error it is, in the command and in serve alike, not as a crash or an internal error."""
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    endpoint = ENDPOINT
    if where == "config":
        endpoint = dataclasses.replace(ENDPOINT, profile="gone")
    else:
        monkeypatch.setenv("AWS_PROFILE", "gone")
    (session,) = probe_once(settings(sagemaker=endpoint), [Conversation("s", ("one", "two"))])
    (failed,) = session.rounds
    assert (failed.round, failed.error_kind) == (1, "credentials_error")
    assert failed.error_detail == "The config profile (gone) could not be found"


def test_a_proxy_that_refuses_is_named_with_its_credentials_masked(monkeypatch):
    """botocore reaches AWS through HTTP(S)_PROXY as the AWS SDK does: a proxy that is down is the
    round's connection failure, naming the proxy, not an internal error; its password is not shown."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    with socket.socket() as closed:  # a port that was free: nothing listens on it
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://someone:{SECRET_KEY}@127.0.0.1:{port}")
    (session,) = probe_once(settings(), [Conversation("s", ("one",))])
    (failed,) = session.rounds
    assert failed.error_kind == "connection_refused"
    detail = failed.error_detail
    assert detail.startswith("cannot connect to the proxy http://"), detail
    assert detail.endswith(f"@127.0.0.1:{port} (HTTP(S)_PROXY): Connection refused"), detail
    assert "someone" not in detail and SECRET_KEY not in detail


def test_kvwatch_serve_probes_a_sagemaker_target_and_exports_its_session_losses(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    RuntimeFront.seen = []
    workload = Workload(system_tokens=20, turn_tokens=5, max_tokens=1)
    with loopback_http(RuntimeFront) as url:
        endpoint = SageMakerEndpoint("chat-endpoint", "us-east-1", endpoint_url=url)
        target = Target(
            "sm", model="m", kind="sagemaker", sagemaker=endpoint, sessions_per_run=1, workload=workload
        )
        service = Service(Config(targets=(target,), store=StoreSettings(tmp_path / "kvwatch.db")))

        async def one_run() -> None:
            service._gate, service._stop = asyncio.Semaphore(1), asyncio.Event()
            async with ProbeClients() as service._clients:
                await service.probe(target)

        asyncio.run(asyncio.wait_for(one_run(), timeout=60))  # a guard against a hang, not a timing
    service.writer.close(5)
    route = {"target": "sm", "route_mode": "affinity"}
    sample = service.registry.get_sample_value
    assert sample("kvwatch_probe_session_losses_total", {**route, "kind": "not_found"}) == 1
    assert sample("kvwatch_probe_errors_total", {**route, "kind": "http_error"}) == 1
    assert [seen["path"].rsplit("/", 1)[1] for seen in RuntimeFront.seen] == [
        "invocations",
        "invocations-response-stream",
        "invocations",
        "invocations-response-stream",
        "invocations",
    ]
    (stored,) = service.store.sessions()
    assert stored["error_kind"] == "http_error"
    service.store.close()
