"""Recording rules: generated from prometheus/queries.py, valid for promtool, and unit-tested by it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import kvwatch.cli.generate
from kvwatch.alerts.alerts import ALERTS, Alert, alerts
from kvwatch.cli import generate
from kvwatch.cli.generate import rule_files
from kvwatch.core.naming import RUNBOOK, RUNBOOK_URL
from kvwatch.prometheus import queries
from kvwatch.prometheus.rules import Rule
from kvwatch.prometheus.thresholds import THRESHOLDS
from paths import REPO

RULE_FILES = sorted((REPO / "prometheus" / "rules").glob("*.yml")) + sorted(
    (REPO / "alerts").glob("*.rules.yml")
)
TEST_FILES = sorted((REPO / "prometheus" / "tests").glob("*-test.yml")) + sorted(
    (REPO / "alerts" / "tests").glob("*-test.yml")
)


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: `make bootstrap` installs Debian's prometheus package"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_generated_rule_files_are_up_to_date():
    for relative, text in generate.generated_files().items():
        assert (REPO / relative).read_text() == text, f"{relative} is stale: run `make generate`"


def test_runbook_links_open_in_the_projects_repository_by_default():
    assert RUNBOOK_URL == "https://github.com/kvwatch/kvwatch/blob/main/alerts/runbook.md"
    assert (REPO / RUNBOOK).is_file()


def test_one_setting_moves_every_runbook_link_of_the_alerts_and_the_boards():
    wiki = "https://wiki.example.net/sre/kvwatch-runbook"
    files = generate.generated_files(wiki)
    assert all(RUNBOOK_URL not in text for text in files.values())
    annotations = [
        rule["annotations"]["runbook_url"]
        for group in yaml.safe_load(files["alerts/kvwatch.rules.yml"])["groups"]
        for rule in group["rules"]
    ]
    assert annotations == [f"{wiki}#{alert.name.lower()}" for alert in ALERTS]
    for name in ("kvwatch-overview.json", "kvwatch-drilldown.json"):
        board = json.loads(files[f"grafana/dashboards/{name}"])
        links = [link["url"] for panel in board["panels"] for link in panel.get("links", [])]
        assert links and all(link.startswith(f"{wiki}#kvwatch") for link in links), name
        assert {"title": "kvwatch runbook", "url": wiki}.items() <= board["links"][1].items()


@pytest.mark.parametrize(
    "url",
    ["wiki.example.net/rb", "https://wiki.example.net/rb#top", "https://wiki.example.net/r b", "https://w/'"],
)
def test_the_generator_refuses_a_runbook_url_that_is_no_plain_http_url(url, capsys):
    with pytest.raises(SystemExit) as exited:
        generate.main(["--check", "--runbook-url", url])
    assert exited.value.code == 2 and "argument --runbook-url: must be an http:// or https:// URL" in (
        capsys.readouterr().err
    )


def test_make_generate_passes_its_runbook_url_variable_to_the_generator():
    wiki = "https://wiki.example.net/sre/kvwatch-runbook"
    planned = subprocess.run(["make", "-n", "generate", f"RUNBOOK_URL={wiki}"], cwd=REPO,
                             capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    assert f"-m kvwatch.cli.generate --runbook-url {wiki}\n" in planned


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
@pytest.mark.integration  # runs promtool
def test_promtool_accepts_the_rules(path: Path):
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_every_rules_file_has_a_promtool_test_file(path: Path):
    assert any(path.name in test.read_text() for test in TEST_FILES), f"no promtool test loads {path.name}"


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
@pytest.mark.integration  # runs promtool
def test_promtool_unit_tests_pass(path: Path):
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_recording_rule_is_exercised_by_a_unit_test():
    tested = "\n".join(path.read_text() for path in TEST_FILES)
    for _, rules in kvwatch.cli.generate.RULE_FILES.values():
        for rule in rules:
            if isinstance(rule, Rule):
                assert rule.record in tested, f"{rule.record} has no promtool test"


def runbook_anchors() -> set[str]:
    """GitHub-style anchors of the runbook's headings."""
    text = (REPO / RUNBOOK).read_text()
    return {
        line.lstrip("#").strip().lower().replace(" ", "-")
        for line in text.splitlines()
        if line.startswith("#")
    }


@pytest.mark.parametrize("alert", ALERTS, ids=lambda a: f"{a.name}-{a.labels}")
def test_every_alert_follows_the_conventions(alert: Alert):
    assert re.fullmatch(r"(KVWatch[A-Z][A-Za-z]+|Watchdog)", alert.name)
    assert alert.severity in ("critical", "warning", "info", "none")
    assert alert.summary.endswith(".") and alert.summary[0].isupper()
    assert alert.description.endswith(".")
    page, _, anchor = alert.runbook_url.partition("#")
    assert page == RUNBOOK_URL and anchor in runbook_anchors(), alert.runbook_url


def test_every_alert_fires_and_stays_quiet_in_a_promtool_test():
    tests = yaml.safe_load((REPO / "alerts" / "tests" / "kvwatch-test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    for name in {alert.name for alert in ALERTS}:
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in mine), f"{name} has no firing case"
        if name != "Watchdog":
            assert any(not case["exp_alerts"] for case in mine), f"{name} has no not-firing case"


AGGREGATION = re.compile(r"\b(sum|min|max|avg|count|group)\s*(\(|by\s*\(([^)]*)\))")
MATCHING = re.compile(r"\b(on|ignoring)\s*\(([^)]*)\)")


@pytest.mark.parametrize("label", ["cluster", "region"])
@pytest.mark.integration  # runs promtool
def test_every_aggregation_and_join_keeps_the_cluster_label(label, tmp_path):
    """No rule or alert may merge two clusters: each `by (...)` and `on(...)` lists the label (the alert
    templates' replica look-up too), so a cluster's sum is its own and a join matches within a cluster."""
    assert generate.main(["--cluster-label", label, "--out", str(tmp_path)]) == 0
    for relative in rule_files(label):
        assert promtool("check", "rules", str(tmp_path / relative)).returncode == 0, relative
    for relative in [*rule_files(label), "deploy/k8s/prometheusrule.yaml"]:
        text = (tmp_path / relative).read_text()
        aggregations = AGGREGATION.findall(text)
        assert aggregations, relative
        for name, opening, labels in aggregations:
            assert label in labels.replace(" ", "").split(","), f"{relative}: {name} {opening}"
        for keyword, labels in MATCHING.findall(text):
            assert label in labels.replace(" ", "").split(","), f"{relative}: {keyword}({labels})"
        if label != "cluster":
            assert not re.search(r"\bcluster\s*[,)=]", text.replace("cluster:kvwatch", "")), relative


def test_alert_summaries_name_the_cluster_only_where_the_series_has_one():
    (drop,) = (
        a for a in ALERTS if a.name == "KVWatchPrefixCacheHitRateDrop" and a.labels["scope"] == "cluster"
    )
    assert drop.notification_summary == (
        "The cluster's prefix-cache hit ratio dropped{{ with $labels.cluster }} in cluster {{ . }}{{ end }}."
    )
    (region,) = (
        a
        for a in rule_files("region")["alerts/kvwatch.rules.yml"][1]
        if a.name == drop.name and a.labels == drop.labels
    )
    assert "{{ with $labels.region }} in region {{ . }}{{ end }}" in region.notification_summary
    assert alerts(THRESHOLDS, queries.WHOLE)[0].notification_summary == ALERTS[0].summary


def test_the_generator_refuses_a_cluster_label_that_is_no_label_name(capsys):
    with pytest.raises(SystemExit) as exited:
        generate.main(["--check", "--cluster-label", "k8s-cluster"])
    assert exited.value.code == 2 and "argument --cluster-label: must be a Prometheus label name" in (
        capsys.readouterr().err
    )
