"""deploy/k8s: every manifest is valid to Kubernetes' own OpenAPI schemas (kubernetes-validate),
prometheus-operator's and Istio's CRD schemas, unknown fields included; the PrometheusRule carries
exactly the rule files' groups, the kvwatch config in the ConfigMap is a valid kvwatch config, the
StatefulSet runs every shard of its targets twice as a non-root container on a read-only root
filesystem, and the pod exposes only the exporter port, whose webhook requires a token mounted from a
Secret. tests/integration/test_kustomize.py checks deploy/k8s as kubectl's kustomize renders it."""

from __future__ import annotations

import copy
import functools
import re
from collections import Counter
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvwatch.cli.generate import RULE_FILES
from kvwatch.config.settings import Config, load_config
from kvwatch.serve import shard
from paths import REPO

K8S = REPO / "deploy" / "k8s"
MANIFESTS = sorted(path for path in K8S.glob("*.yaml") if path.name != "kustomization.yaml")
# The gateways' receivers (deploy/k8s/gateways), but istiod's Helm values, which are no Kubernetes object.
GATEWAY_MANIFESTS = sorted(
    path
    for path in K8S.glob("gateways/*/*.yaml")
    if path.name not in ("kustomization.yaml", "istiod-values.yaml")
)
# The oldest Kubernetes the manifests are for: the StatefulSet's pod-index label is GA from 1.32.
KUBERNETES = "1.32"
# prometheus-operator's CRDs of PodMonitor and PrometheusRule, verbatim from its release v0.93.0, and
# Istio's of Telemetry, verbatim from manifests/charts/base/files/crd-all.gen.yaml of its release 1.29.6.
CRDS = [
    REPO / "tests" / "testdata" / "prometheus-operator-v0.93.0",
    REPO / "tests" / "testdata" / "istio-1.29.6",
]


def documents(text: str) -> list[dict]:
    return [document for document in yaml.safe_load_all(text) if document]


def strict(schema: object) -> object:
    """A CRD schema that rejects unknown fields, as `kubectl apply --validate=strict` does, where the API
    server would drop them silently (a misspelt key would then just not take effect)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema.setdefault("additionalProperties", False)
    return schema


# What the API server checks of every object itself, which some CRDs' schemas leave out (Istio's).
OBJECT_FIELDS = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}


@functools.cache
def crd_schemas() -> dict[tuple[str, str], jsonschema.Draft4Validator]:
    """Each served version of each CRD by (apiVersion, kind); OpenAPI v3 schemas are JSON Schema draft 4."""
    schemas = {}
    for path in (path for directory in CRDS for path in directory.glob("*.yaml")):
        (crd,) = documents(path.read_text())
        for version in crd["spec"]["versions"]:
            api_version = f"{crd['spec']['group']}/{version['name']}"
            schema = version["schema"]["openAPIV3Schema"]
            schema = strict(schema | {"properties": OBJECT_FIELDS | schema["properties"]})
            schemas[api_version, crd["spec"]["names"]["kind"]] = jsonschema.Draft4Validator(schema)
    return schemas


def schema_errors(document: dict) -> list[str]:
    """What the schema of the document's kind finds wrong with it, each at its path; a kind with no
    schema is an error too, so that no manifest goes unchecked."""
    validator = crd_schemas().get((document["apiVersion"], document["kind"]))
    if validator is not None:
        return [f"{error.json_path}: {error.message}" for error in validator.iter_errors(document)]
    try:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{error.json_path}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [error.message]
    return []


@pytest.mark.parametrize("path", MANIFESTS + GATEWAY_MANIFESTS, ids=lambda path: str(path.relative_to(K8S)))
def test_every_manifest_is_valid_to_its_schema(path):
    found = {
        f"{document['kind']}/{document['metadata']['name']}": schema_errors(document)
        for document in documents(path.read_text())
    }
    assert found and all(errors == [] for errors in found.values()), found


@pytest.mark.parametrize(
    "path, kind, mistake, error",
    [
        ("kvwatch.yaml", "StatefulSet", lambda d: d["spec"].update(replica=1), "'replica' was unexpected"),
        (
            "kvwatch.yaml",
            "NetworkPolicy",
            lambda d: d["spec"].update(policyTypes="Ingress"),
            "$.spec.policyTypes: 'Ingress' is not of type 'array'",
        ),
        (
            "podmonitors.yaml",
            "PodMonitor",
            lambda d: d["spec"]["podMetricsEndpoints"][0].update(intervall="15s"),
            "$.spec.podMetricsEndpoints[0]: Additional properties are not allowed ('intervall'",
        ),
        (
            "prometheusrule.yaml",
            "PrometheusRule",
            lambda d: d["spec"]["groups"][0]["rules"][0].update({"for": "5 minutes"}),
            "$.spec.groups[0].rules[0].for: '5 minutes' does not match",
        ),
        (
            "gateways/istio/telemetry.yaml",
            "Telemetry",
            lambda d: d["spec"]["accessLogging"][0].update(provider={"name": "kvwatch-otlp"}),
            "$.spec.accessLogging[0]: Additional properties are not allowed ('provider'",
        ),
    ],
)
def test_a_broken_manifest_is_refused_at_its_mistake(path, kind, mistake, error):
    document = next(d for d in documents((K8S / path).read_text()) if d["kind"] == kind)
    broken = copy.deepcopy(document)
    mistake(broken)
    assert schema_errors(document) == []
    assert any(error in found for found in schema_errors(broken)), schema_errors(broken)


def test_a_kind_without_a_schema_is_refused():
    (error,) = schema_errors({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitr"})
    assert "Couldn't find schema for kind ServiceMonitr" in error


def test_prometheus_rule_has_exactly_the_rule_files_groups():
    rule = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())
    files = [REPO / path for path in RULE_FILES]
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
    return manifest("StatefulSet")["spec"]["template"]["spec"]


def test_the_deployment_config_is_a_valid_kvwatch_config(tmp_path):
    config = deployed_config(tmp_path)
    assert config.targets[0].api_key_env == "KVWATCH_API_KEY"
    container = pod_spec()["containers"][0]
    assert container["args"][:1] == ["serve"] and container["env"][0]["name"] == "KVWATCH_API_KEY"
    assert all(d["kind"] == "PodMonitor" for d in yaml.safe_load_all((K8S / "podmonitors.yaml").read_text()))


def test_the_statefulset_runs_each_shard_twice_and_every_shard_probes(tmp_path):
    statefulset = manifest("StatefulSet")["spec"]
    (container,) = pod_spec()["containers"]
    shard_arg = container["args"][container["args"].index("--shard") + 1]
    ordinal, _, count = shard_arg.partition("/")
    assert ordinal == "$(KVWATCH_POD_INDEX)"
    pod_index = next(e["valueFrom"]["fieldRef"] for e in container["env"] if e["name"] == "KVWATCH_POD_INDEX")
    assert pod_index == {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    shards = [shard.parse(f"{pod}/{count}") for pod in range(statefulset["replicas"])]
    assert sorted(Counter(shards).values()) == [2] * int(count)
    targets = deployed_config(tmp_path).targets
    assert all(part.select(targets) for part in shards)  # no shard is left without a target


def test_kvwatch_runs_as_non_root_on_a_read_only_root_filesystem_and_keeps_its_store(tmp_path):
    pod = pod_spec()
    (container,) = pod["containers"]
    context = container["securityContext"]
    assert context["runAsNonRoot"] and context["readOnlyRootFilesystem"]
    assert not context["allowPrivilegeEscalation"] and context["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["fsGroup"] == context["runAsUser"]  # it can write its data volume
    (data,) = manifest("StatefulSet")["spec"]["volumeClaimTemplates"]
    store = deployed_config(tmp_path).store.path
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == data["metadata"]["name"]]
    assert store.is_relative_to(mount["mountPath"])  # on the pod's own volume, kept across restarts


def mounted_secrets() -> dict[Path, dict]:
    """Each file the container sees from a Secret, by its path: the Secret volume it comes from."""
    pod = pod_spec()
    (container,) = pod["containers"]
    secrets = {volume["name"]: volume["secret"] for volume in pod["volumes"] if "secret" in volume}
    return {
        Path(mount["mountPath"]) / item["path"]: secrets[mount["name"]]
        for mount in container["volumeMounts"]
        if mount["name"] in secrets and mount.get("readOnly")
        for item in secrets[mount["name"]]["items"]
    }


def test_the_webhook_requires_a_token_mounted_from_a_secret(tmp_path):
    exporter = deployed_config(tmp_path).exporter
    assert exporter.webhook_token_env is None and exporter.webhook_token_file is not None
    secret = mounted_secrets()[exporter.webhook_token_file]
    assert secret["secretName"] == "kvwatch-webhook-token" and secret["defaultMode"] == 0o400
    (container,) = pod_spec()["containers"]
    assert not any("token" in arg.lower() for arg in container["args"])  # never argv


def test_the_shared_history_example_is_postgresql_with_its_password_from_a_secret_file(tmp_path):
    """The ConfigMap's commented store: one PostgreSQL history for every shard, its password a file
    from a Secret the pods start without while the history is SQLite."""
    text = manifest("ConfigMap")["data"]["kvwatch.yaml"]
    example = yaml.safe_load("\n".join(re.findall(r"^ *#   (\w+: .+)$", text, flags=re.MULTILINE)))
    config = yaml.safe_load(text) | {"store": example}
    path = tmp_path / "kvwatch.yaml"
    path.write_text(yaml.safe_dump(config))
    store = load_config(path).store
    assert store.url.startswith("postgresql://") and store.password_env is None
    secret = mounted_secrets()[store.password_file]
    assert secret["secretName"] == "kvwatch-store-password" and secret["defaultMode"] == 0o400
    assert secret["optional"] is True


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


def test_every_engine_podmonitor_gives_its_pods_the_replica_label_the_pages_name_them_by():
    monitors = documents((REPO / "deploy" / "k8s" / "podmonitors.yaml").read_text())
    engines = [m for m in monitors if m["metadata"]["name"] != "kvwatch"]
    assert engines
    for monitor in engines:
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "replica"} in endpoint.get(
                "relabelings", []
            ), monitor["metadata"]["name"]
