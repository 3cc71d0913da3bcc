"""The lab's metrics stores, without starting them: what `lab up --metrics-store victoriametrics` runs
and writes (VictoriaMetrics in Prometheus' place, vmalert on its own port, the alerts without
keep_firing_for, kvwatch's prometheus.rules_url), the default lab unchanged, and the command line's
refusals."""

from __future__ import annotations

import pytest
import yaml

from kvwatch.cli.main import main
from kvwatch.config.settings import load_config
from kvwatch.lab import components, stack
from kvwatch.lab.configs import render_kvwatch_config, rule_files
from kvwatch.lab.metrics_stores import METRICS_STORES
from kvwatch.lab.metrics_stores.victoriametrics import SCRAPE_CONFIG, write_scrape_config
from kvwatch.lab.state import LabState
from paths import REPO

BASE = 24200


def planned(tmp_path, store: str) -> LabState:
    (state,) = stack.plan(tmp_path, BASE, 2, ["vllm"], fast=True, metrics_store=store)
    return state


def names(groups) -> list[list[str]]:
    return [[process.name for process in group] for group in groups]


def test_the_victoriametrics_lab_runs_the_store_before_vmalert_and_every_server_on_loopback(tmp_path):
    state = planned(tmp_path, "victoriametrics")
    groups = components.planned_processes(state)
    assert names(groups)[1:] == [
        ["nginx", "alertmanager", "victoria-metrics"],  # vmalert's datasource serves before it starts
        ["vmalert", "serve", "dashboard", "traffic"],
    ]
    by_name = {process.name: process for group in groups for process in group}
    store, engine = by_name["victoria-metrics"], by_name["vmalert"]
    assert f"-httpListenAddr=127.0.0.1:{BASE + 2}" in store.argv and store.ready_url.endswith("/health")
    assert f"-httpListenAddr=127.0.0.1:{BASE + 9}" in engine.argv and engine.ready_url.endswith("/health")
    assert {f"-datasource.url=http://127.0.0.1:{BASE + 2}", f"-remoteWrite.url=http://127.0.0.1:{BASE + 2}",
            f"-notifier.url=http://127.0.0.1:{BASE + 3}"} <= set(engine.argv)  # fmt: skip
    listening = stack.listening_ports([state])
    assert (listening["victoria-metrics"], listening["rule engine"]) == (BASE + 2, BASE + 9)


def test_the_default_lab_still_runs_prometheus_alone(tmp_path):
    state = planned(tmp_path, "prometheus")
    assert names(components.planned_processes(state))[1:] == [
        ["nginx", "alertmanager"],
        ["prometheus", "serve", "dashboard", "traffic"],
    ]
    assert "rules_url" not in yaml.safe_load(render_kvwatch_config(state))["prometheus"]
    assert rule_files(state)["kvwatch.rules.yml"] == (REPO / "alerts" / "kvwatch.rules.yml").read_text()
    assert "rule engine" not in stack.listening_ports([state])


def test_vmalert_loads_the_alerts_without_keep_firing_for_and_kvwatch_reads_its_rules(tmp_path):
    state = planned(tmp_path, "victoriametrics")
    files = rule_files(state)
    assert files.keys() == rule_files(planned(tmp_path / "p", "prometheus")).keys()
    assert "keep_firing_for" not in files["kvwatch.rules.yml"]
    assert "KVWatchSessionAffinityBroken" in files["kvwatch.rules.yml"]
    config = tmp_path / "kvwatch.yaml"
    config.write_text(render_kvwatch_config(state))
    prometheus = load_config(config).prometheus
    assert (prometheus.url, prometheus.rules_url) == (
        f"http://127.0.0.1:{BASE + 2}",
        f"http://127.0.0.1:{BASE + 9}",
    )


def test_victoriametrics_scrapes_the_labs_jobs_and_vmalert_without_external_labels(tmp_path):
    state = planned(tmp_path, "victoriametrics")
    stack._write_configs(state)
    prometheus = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    scrape = yaml.safe_load((tmp_path / SCRAPE_CONFIG).read_text())
    assert scrape == {"global": {"scrape_interval": "1s"}, "scrape_configs": prometheus["scrape_configs"]}
    assert {"job_name": "rule_engine", "static_configs": [{"targets": [f"127.0.0.1:{BASE + 9}"]}]} in scrape[
        "scrape_configs"
    ]
    write_scrape_config(state)  # rewritten as the lab's prometheus.yml changes (scale-out, heal)
    assert yaml.safe_load((tmp_path / SCRAPE_CONFIG).read_text()) == scrape


def test_each_store_is_named_in_the_command_lines_help():
    assert list(METRICS_STORES) == ["prometheus", "victoriametrics"]
    assert METRICS_STORES["victoriametrics"].rules_apart and not METRICS_STORES["prometheus"].rules_apart


@pytest.mark.parametrize(
    "options",
    [("--clusters", "2"), ("--gateway-log-source", "syslog")],
    ids=["clusters", "syslog"],
)
def test_up_refuses_victoriametrics_where_its_rule_engine_has_no_port(tmp_path, capsys, options):
    args = ["lab", "up", "--detach", "--metrics-store", "victoriametrics", "--state-dir", str(tmp_path)]
    assert main([*args, *options]) == 1
    assert "--metrics-store victoriametrics runs one cluster" in capsys.readouterr().err
    assert not (tmp_path / "state.json").exists()


def test_an_unknown_metrics_store_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["lab", "up", "--metrics-store", "victoria", "--state-dir", str(tmp_path)])
    assert "invalid choice: 'victoria'" in capsys.readouterr().err
