"""deploy/k8s as kubectl's kustomize renders it (`kubectl apply -k`): the base and each gateway's receiver
render, every object valid to its schema (tests/unit/deploy), the base holds every manifest and each
Grafana board byte for byte in a ConfigMap for the sidecar of kube-prometheus-stack, and each gateway's
settings point at the receiver's Service and port, which its config listens on, its NetworkPolicy opens
to the gateway alone and the PodMonitor scrapes."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_deploy import K8S, MANIFESTS, documents, schema_errors

from kvwatch.collectors.gatewaylogs import LOG_FORMATS
from kvwatch.config.settings import GatewayLog, load_config
from paths import REPO

pytestmark = pytest.mark.integration

GATEWAYS = K8S / "gateways"
KUSTOMIZATIONS = [K8S, GATEWAYS / "ingress-nginx", GATEWAYS / "istio"]
NAMESPACE = "monitoring"
# The sidecar of kube-prometheus-stack's Grafana loads every ConfigMap with this label (its default).
SIDECAR_LABEL = ("grafana_dashboard", "1")
# The transport of each push source, as the Service and the NetworkPolicy must carry it.
PROTOCOLS = {"syslog": {"UDP", "TCP"}, "otlp": {"TCP"}}


@functools.cache
def rendered(directory: Path) -> tuple[dict, ...]:
    """The objects `kubectl kustomize DIRECTORY` renders; kubectl missing or failing fails the test."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing: `make test` installs Debian's kubernetes-client"
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr[-3000:]}"
    return tuple(documents(done.stdout))


def named(objects: tuple[dict, ...], kind: str, name: str | None = None) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return found


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions In) matching these labels."""
    return labels.items() >= selector.get("matchLabels", {}).items() and all(
        expression["operator"] == "In" and labels.get(expression["key"]) in expression["values"]
        for expression in selector.get("matchExpressions", [])
    )


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda path: str(path.relative_to(K8S)))
def test_each_kustomization_renders_objects_valid_to_their_schemas(directory):
    found = {f"{o['kind']}/{o['metadata']['name']}": schema_errors(o) for o in rendered(directory)}
    assert found and all(errors == [] for errors in found.values()), found


def test_the_base_renders_every_manifest_in_its_namespace():
    objects = rendered(K8S)
    assert all(o["metadata"]["namespace"] == NAMESPACE for o in objects)
    for path in MANIFESTS:
        for document in documents(path.read_text()):
            document["metadata"]["namespace"] = NAMESPACE
            assert document in objects, f"{path.name}: {document['kind']}/{document['metadata']['name']}"


def test_the_base_holds_every_board_byte_for_byte_in_a_configmap_for_the_grafana_sidecar():
    boards = {path.name: path.read_text() for path in (REPO / "grafana" / "dashboards").glob("*.json")}
    labelled = [
        o
        for o in rendered(K8S)
        if o["kind"] == "ConfigMap" and SIDECAR_LABEL in o["metadata"].get("labels", {}).items()
    ]
    assert len(boards) == len(labelled) >= 2
    assert {key: text for configmap in labelled for key, text in configmap["data"].items()} == boards
    assert all(json.loads(text)["uid"] for text in boards.values())


def pod_volumes(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["volumes"]


def receiver(directory: Path, scratch: Path) -> tuple[GatewayLog, dict, dict, dict]:
    """A gateway's rendered receiver: its one gateway log as kvwatch reads it, its Service, its pod
    template and the NetworkPolicy that admits its senders."""
    objects = rendered(directory)
    deployment = named(objects, "Deployment", "kvwatch-gateway-logs")
    (volume,) = [v for v in pod_volumes(deployment) if "configMap" in v]
    config = named(objects, "ConfigMap", volume["configMap"]["name"])["data"]["kvwatch.yaml"]
    path = scratch / f"{directory.name}.yaml"
    path.write_text(config)
    loaded = load_config(path)
    assert loaded.targets == () and deployment["spec"]["replicas"] == 1  # one receiver sees the whole log
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod_volumes(deployment) if "secret" in v}
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (token_mount,) = [m for m in container["volumeMounts"] if m["name"] in secrets]
    assert loaded.exporter.webhook_token_file.parent == Path(token_mount["mountPath"])  # its webhook refuses
    assert secrets[token_mount["name"]] == "kvwatch-webhook-token"
    (log,) = loaded.gateway_logs
    senders = named(objects, "NetworkPolicy", "kvwatch-gateway-logs-senders")
    return log, named(objects, "Service", "kvwatch-gateway-logs"), deployment["spec"]["template"], senders


@pytest.mark.parametrize("directory", KUSTOMIZATIONS[1:], ids=lambda path: path.name)
def test_the_receiver_listens_where_its_service_sends_and_only_the_gateway_may_send(directory, tmp_path):
    log, service, pod, senders = receiver(directory, tmp_path)
    host, _, port = log.listen.rpartition(":")
    assert host == "0.0.0.0"  # the pod's address, where the Service delivers; 127.0.0.1 would take nothing
    ports = {(p["protocol"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {(protocol, int(port)) for protocol in PROTOCOLS[log.source]}
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    assert selects(senders["spec"]["podSelector"], pod["metadata"]["labels"])
    (rule,) = senders["spec"]["ingress"]
    assert {(p["protocol"], p["port"]) for p in rule["ports"]} == ports
    assert all(peer["namespaceSelector"]["matchLabels"] and peer["podSelector"] for peer in rule["from"])


@pytest.mark.parametrize("directory", KUSTOMIZATIONS[1:], ids=lambda path: path.name)
def test_prometheus_scrapes_the_receiver_and_alertmanager_posts_only_to_the_probes(directory, tmp_path):
    _, _, pod, _ = receiver(directory, tmp_path)
    labels = pod["metadata"]["labels"]
    base = rendered(K8S)
    assert selects(named(base, "PodMonitor", "kvwatch")["spec"]["selector"], labels)
    assert not selects({"matchLabels": named(base, "Service", "kvwatch")["spec"]["selector"]}, labels)
    probes = named(base, "StatefulSet", "kvwatch")["spec"]
    assert not selects(probes["selector"], labels)
    assert selects(
        named(base, "PodMonitor", "kvwatch")["spec"]["selector"], probes["template"]["metadata"]["labels"]
    )


def service_address(service: dict) -> str:
    return f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"


# What ingress-nginx puts in each variable of the log format, for one request.
NGINX_VARIABLES = {
    "time_iso8601": "2026-12-01T13:20:31+00:00",
    "msec": "1764595231.535",
    "req_id": "5f1c0d2b9a3e4f60",
    "proxy_upstream_name": "llm-vllm-8000",
    "upstream_addr": "10.0.0.1:8000, 10.0.0.2:8000",
    "upstream_status": "502, 200",
    "status": "200",
    "request_method": "POST",
    "uri": "/v1/chat/completions",
    "http_x_session_id": "chat-42",
    "request_time": "0.412",
}


def test_ingress_nginx_sends_kvwatch_its_access_log_in_the_format_kvwatch_reads(tmp_path):
    log, service, _, _ = receiver(GATEWAYS / "ingress-nginx", tmp_path)
    settings = named(rendered(GATEWAYS / "ingress-nginx"), "ConfigMap", "ingress-nginx-controller")
    assert settings["metadata"]["namespace"] == "ingress-nginx"
    data = settings["data"]
    assert (data["enable-syslog"], data["log-format-escape-json"]) == ("true", "true")
    assert (data["syslog-host"], data["syslog-port"]) == (
        service_address(service),
        log.listen.rpartition(":")[2],
    )
    assert (log.format, log.source) == ("ingress-nginx", "syslog")
    line = re.sub(r"\$(\w+)", lambda variable: NGINX_VARIABLES[variable[1]], data["log-format-upstream"])
    request = LOG_FORMATS[log.format].parse(json.loads(line))
    assert (request.listener, request.session_id, request.failover) == ("llm-vllm-8000", "chat-42", True)
    assert request.path == "/v1/chat/completions"  # only inference_paths count as inference requests


def test_istio_sends_kvwatch_the_attributes_of_envoys_otlp_access_log(tmp_path):
    log, service, _, _ = receiver(GATEWAYS / "istio", tmp_path)
    assert (log.format, log.source) == ("envoy", "otlp")
    (grpc,) = service["spec"]["ports"]
    assert grpc["appProtocol"] == "grpc"  # Istio then speaks HTTP/2 to it
    telemetry = named(rendered(GATEWAYS / "istio"), "Telemetry")
    ((provider,),) = [entry["providers"] for entry in telemetry["spec"]["accessLogging"]]
    mesh = yaml.safe_load((GATEWAYS / "istio" / "istiod-values.yaml").read_text())["meshConfig"]
    (extension,) = mesh["extensionProviders"]
    assert extension["name"] == provider["name"]
    als = extension["envoyOtelAls"]
    assert (als["service"], als["port"]) == (service_address(service), grpc["port"])
    example = yaml.safe_load((REPO / "examples" / "envoy-otlp-access-log.yaml").read_text())
    (logger,) = example["access_log"]
    attributes = {
        a["key"]: a["value"]["string_value"] for a in logger["typed_config"]["attributes"]["values"]
    }
    assert als["logFormat"]["labels"] == attributes
