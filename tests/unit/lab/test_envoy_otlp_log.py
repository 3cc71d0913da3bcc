"""The lab's Envoy sends its access log over OTLP only when asked, and keeps its file log either way."""

from __future__ import annotations

import yaml

from kvwatch.lab.gateways import envoy
from kvwatch.lab.state import LabState, ReplicaSpec


def bootstrap(tmp_path, **options) -> dict:
    state = LabState(directory=tmp_path, base_port=20000, gateway="envoy", **options)
    state.replicas = [ReplicaSpec("r1", 20100, "vllm")]
    return yaml.safe_load(envoy.render(state)["envoy.yaml"])


def access_logs(config: dict) -> list[list[str]]:
    return [
        [log["name"] for log in listener["filter_chains"][0]["filters"][0]["typed_config"]["access_log"]]
        for listener in config["static_resources"]["listeners"]
    ]


def test_by_default_only_the_file_log(tmp_path):
    config = bootstrap(tmp_path)
    assert access_logs(config) == [["envoy.access_loggers.file"]] * 2
    assert config["static_resources"]["clusters"] == []


def otlp_receivers(config: dict) -> dict[str, dict]:
    """Each listener's OTLP log: its cluster's socket address."""
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    receivers = {}
    for listener in config["static_resources"]["listeners"]:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        log = manager["access_log"][1]["typed_config"]
        assert {"key": "listener", "value": {"string_value": listener["name"]}} in log["attributes"]["values"]
        cluster = clusters[log["grpc_service"]["envoy_grpc"]["cluster_name"]]
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        receivers[listener["name"]] = endpoint["endpoint"]["address"]["socket_address"]
    return receivers


def test_asked_the_otlp_log_goes_beside_the_file_log_to_the_given_receiver(tmp_path):
    config = bootstrap(tmp_path, gateway_log_otlp="127.0.0.1:4999")
    assert access_logs(config) == [["envoy.access_loggers.file", "envoy.access_loggers.open_telemetry"]] * 2
    assert otlp_receivers(config) == dict.fromkeys(
        envoy.LISTENERS, {"address": "127.0.0.1", "port_value": 4999}
    )


def test_with_the_otlp_log_source_each_listener_logs_to_its_own_kvwatch_receiver(tmp_path):
    config = bootstrap(tmp_path, gateway_log_source="otlp")
    assert access_logs(config) == [["envoy.access_loggers.file", "envoy.access_loggers.open_telemetry"]] * 2
    assert otlp_receivers(config) == {
        "affinity": {"address": "127.0.0.1", "port_value": 20007},
        "round_robin": {"address": "127.0.0.1", "port_value": 20008},
    }
