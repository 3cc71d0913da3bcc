"""deploy/k8s: the PrometheusRule carries exactly the rule files' groups, the kvwatch config in the
Deployment's ConfigMap is a valid kvwatch config, and the pod exposes only the exporter port, whose
webhook requires a token mounted from a Secret."""

from __future__ import annotations

from pathlib import Path

import yaml

from collectors import queries
from collectors.config import Config, load_config
from conftest import REPO

K8S = REPO / "deploy" / "k8s"


def test_prometheus_rule_has_exactly_the_rule_files_groups():
    rule = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())
    files = [REPO / path for path in queries.RULE_FILES]
    assert {path.name for path in files} >= {
        "kvwatch-engines.yml",
        "kvwatch-routers.yml",
        "kvwatch.rules.yml",
    }
    groups = [group for path in files for group in yaml.safe_load(path.read_text())["groups"]]
    assert rule["kind"] == "PrometheusRule" and rule["spec"]["groups"] == groups


def manifest(kind: str) -> dict:
    """The one document of that kind in deploy/k8s/kvwatch.yaml."""
    (document,) = [d for d in yaml.safe_load_all((K8S / "kvwatch.yaml").read_text()) if d["kind"] == kind]
    return document


def deployed_config(tmp_path: Path) -> Config:
    path = tmp_path / "kvwatch.yaml"
    path.write_text(manifest("ConfigMap")["data"]["kvwatch.yaml"])
    return load_config(path)


def pod_spec() -> dict:
    return manifest("Deployment")["spec"]["template"]["spec"]


def test_the_deployment_config_is_a_valid_kvwatch_config(tmp_path):
    config = deployed_config(tmp_path)
    assert config.targets[0].api_key_env == "KVWATCH_API_KEY"
    container = pod_spec()["containers"][0]
    assert container["args"][:1] == ["serve"] and container["env"][0]["name"] == "KVWATCH_API_KEY"
    assert all(d["kind"] == "PodMonitor" for d in yaml.safe_load_all((K8S / "podmonitors.yaml").read_text()))


def test_the_webhook_requires_a_token_mounted_from_a_secret(tmp_path):
    exporter = deployed_config(tmp_path).exporter
    assert exporter.webhook_token_env is None and exporter.webhook_token_file is not None
    pod = pod_spec()
    (container,) = pod["containers"]
    secrets = {volume["name"]: volume["secret"] for volume in pod["volumes"] if "secret" in volume}
    mounted = {
        Path(mount["mountPath"]) / item["path"]: secrets[mount["name"]]
        for mount in container["volumeMounts"]
        if mount["name"] in secrets
        for item in secrets[mount["name"]]["items"]
    }
    secret = mounted[exporter.webhook_token_file]
    assert secret["secretName"] == "kvwatch-webhook-token" and secret["defaultMode"] == 0o400
    assert not any("token" in arg.lower() for arg in container["args"])  # never argv


def test_only_the_exporter_port_is_exposed_and_only_to_prometheus_and_alertmanager(tmp_path):
    exporter = deployed_config(tmp_path).exporter
    (container,) = pod_spec()["containers"]
    assert container["ports"] == [{"name": "metrics", "containerPort": exporter.port}]
    assert [port["targetPort"] for port in manifest("Service")["spec"]["ports"]] == ["metrics"]
    policy = manifest("NetworkPolicy")["spec"]
    assert policy["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "kvwatch"}}
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/name", "operator": "In", "values": ["prometheus", "alertmanager"]}
    ]


def test_the_shipped_alertmanager_config_sends_the_webhook_token_from_a_file():
    config = yaml.safe_load((REPO / "alerts" / "alertmanager.yml").read_text())
    (webhook,) = next(r for r in config["receivers"] if r["name"] == "kvwatch")["webhook_configs"]
    authorization = webhook["http_config"]["authorization"]
    assert authorization["type"] == "Bearer" and "credentials_file" in authorization
    assert "credentials" not in authorization
