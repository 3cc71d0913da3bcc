"""deploy/k8s: the PrometheusRule carries exactly the rule files' groups, and the kvwatch config in the
Deployment's ConfigMap is a valid kvwatch config."""

from __future__ import annotations

import yaml

from collectors import queries
from collectors.config import load_config
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


def test_the_deployment_config_is_a_valid_kvwatch_config(tmp_path):
    documents = list(yaml.safe_load_all((K8S / "kvwatch.yaml").read_text()))
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    path = tmp_path / "kvwatch.yaml"
    path.write_text(config_map["data"]["kvwatch.yaml"])
    config = load_config(path)
    assert config.targets[0].api_key_env == "KVWATCH_API_KEY"
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:1] == ["serve"] and container["env"][0]["name"] == "KVWATCH_API_KEY"
    assert all(d["kind"] == "PodMonitor" for d in yaml.safe_load_all((K8S / "podmonitors.yaml").read_text()))
