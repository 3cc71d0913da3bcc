"""The thresholds file: `kvwatch generate --config FILE --out DIR` writes rules, alerts and boards judging by
it, promtool accepts them, and each way the file can be wrong is one clear line."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess

import pytest
import yaml

from kvwatch.cli.generate import rule_files
from kvwatch.cli.main import main
from kvwatch.prometheus.thresholds import THRESHOLDS, load_thresholds
from paths import REPO

CHANGED = """\
cluster_label: region
hit_ratio_floor: 0.25
hit_ratio_drop_for: 7m
keyless_share_window: 7m
load_imbalance_above: 3
moved_share_above: 0.4
min_returning_requests_per_minute: 12
"""


def alert_rules(text: str, name: str) -> list[dict]:
    rules = yaml.safe_load(text)["groups"][0]["rules"]
    return [rule for rule in rules if rule.get("alert") == name]


def test_the_example_file_holds_the_defaults():
    assert load_thresholds(REPO / "examples" / "thresholds.yaml") == THRESHOLDS


@pytest.mark.integration  # runs promtool
def test_a_thresholds_file_moves_the_rules_alerts_and_boards(tmp_path):
    config = tmp_path / "thresholds.yaml"
    config.write_text(CHANGED)
    out = tmp_path / "out"
    assert main(["generate", "--config", str(config), "--out", str(out)]) == 0

    alerts = (out / "alerts" / "kvwatch.rules.yml").read_text()
    drops = alert_rules(alerts, "KVWatchPrefixCacheHitRateDrop")
    assert len(drops) == 2 and all("< 0.25)" in d["expr"] and "< 0.1)" not in d["expr"] for d in drops)
    assert [d["for"] for d in drops] == ["7m", "7m"]
    keyless = alert_rules(alerts, "KVWatchSessionIdNotPropagated")[1]["expr"]
    assert "[7m]" in keyless and "[7m] offset 1h" in keyless and "[5m]" not in keyless
    (moved,) = alert_rules(alerts, "KVWatchGatewaySessionsMoved")
    assert '{failover="false"}) > 0.4\n' in moved["expr"] and " * 60 >= 12\n" in moved["expr"]
    for relative in ("prometheus/rules/kvwatch-engines.yml", "deploy/k8s/prometheusrule.yaml"):
        text = (out / relative).read_text()
        assert "by (region, job, instance)" in text and "by (cluster" not in text, relative
    for variant in ("dashboards", "import"):
        board = json.loads((out / "grafana" / variant / "kvwatch-overview.json").read_text())
        described = " ".join(panel.get("description", "") for panel in board["panels"])
        assert "Bad: above 3, the alert's threshold" in described, variant
        assert "it fires once that lasts 7m" in described and "lasts 5m" in described, variant
        assert {"name": "cluster", "definition": "label_values(up, region)"}.items() <= next(
            v for v in board["templating"]["list"] if v["name"] == "cluster"
        ).items()

    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make bootstrap` installs Debian's prometheus package"
    for relative in rule_files():
        checked = subprocess.run([promtool, "check", "rules", str(out / relative)], capture_output=True,
                                 text=True, timeout=120)  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_command_line_cluster_label_wins_over_the_files(tmp_path):
    config = tmp_path / "thresholds.yaml"
    config.write_text("cluster_label: region\n")
    args = ["generate", "--config", str(config), "--cluster-label", "zone", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    text = (tmp_path / "out" / "prometheus" / "rules" / "kvwatch-gateway.yml").read_text()
    assert "zone" in text and "region" not in text


# Every key the file may give, as the error lists them: sorted.
KNOWN = ", ".join(sorted(field.name for field in dataclasses.fields(THRESHOLDS)))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "hit_ratio_flor: 0.2\n",
            f'hit_ratio_flor: unknown key; did you mean "hit_ratio_floor"? known: {KNOWN}',
        ),
        ("hit_ratio_floor: low\n", 'hit_ratio_floor: expected a number, got the string "low"'),
        ("min_returning_sessions: 2.5\n", "min_returning_sessions: expected an integer, got the number 2.5"),
        ("hit_ratio_floor: -0.1\n", "hit_ratio_floor: must be 0 or more, got -0.1"),
        ("keyless_share_window: 5 minutes\n",
         "keyless_share_window: expected a duration such as 5m, got 5 minutes"),
        ("cluster_label: 3\n", "cluster_label: expected a string, got the number 3"),
        ("cluster_label: 2cluster\n",
         'cluster_label: must be a Prometheus label name (letters, digits and _, not starting with "__"), '
         'got "2cluster"'),
        ("", "the file is empty"),
        ("- hit_ratio_floor\n", "the top level must be a mapping of keys, got a list"),
        ("hit_ratio_floor: 0.2\nhit_ratio_floor: 0.3\n",
         'invalid YAML at line 2, column 1: duplicate key "hit_ratio_floor"'),
    ],
    ids=["unknown-key", "not-a-number", "not-an-integer", "negative", "not-a-duration", "label-not-a-string",
         "bad-label", "empty", "not-a-mapping", "duplicate-key"],
)  # fmt: skip
def test_each_thresholds_file_error_is_one_line_naming_the_file_and_the_key(text, message, tmp_path, capsys):
    config = tmp_path / "thresholds.yaml"
    config.write_text(text)
    out = tmp_path / "out"
    assert main(["generate", "--config", str(config), "--out", str(out)]) == 1
    assert capsys.readouterr().err == f"kvwatch generate: error in {config}: {message}\n"
    assert not out.exists()  # nothing written from a file that cannot be used


def test_a_cluster_label_kvwatch_uses_itself_is_refused(tmp_path, capsys):
    config = tmp_path / "thresholds.yaml"
    config.write_text("cluster_label: job\n")
    assert main(["generate", "--config", str(config), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f'kvwatch generate: error in {config}: cluster_label: "job" is taken by kvwatch\'s own'
    )
    assert err.endswith(": pick another\n") and err.count("\n") == 1


def test_a_missing_thresholds_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nowhere.yaml"
    assert main(["generate", "--config", str(missing), "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == (
        f"kvwatch generate: error in {missing}: cannot read it: No such file or directory\n"
    )
