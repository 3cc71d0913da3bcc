"""The files `kvwatch init` writes: each one valid for what reads it, and all of them agreeing on the
addresses, the token file and the `replica` label the pages group by."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest
import yaml

from kvwatch.collectors.probe.blocksize import BlockSize
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import load_config
from kvwatch.onboarding import summary, writers
from kvwatch.onboarding.survey import Request, Survey, SurveyError, Target, _pick_model, _target
from kvwatch.prometheus import queries

ALERTMANAGER_TEMPLATE = yaml.safe_load(writers.ALERTMANAGER_TEMPLATE.read_text())


def found(**fields) -> Survey:
    request = Request(base_url="https://llm.example.com/v1", prometheus_url="http://prom:9090")
    defaults = dict(
        request=request,
        models=["m1"],
        model="m1",
        session_echoed=True,
        identity_header="X-Upstream",
        identity_convention="headers",
        backends=("10.0.0.7:8000",) * 3,
        sticky=True,
        engines=[
            Target("10.0.0.7:8000", "vllm", "pod-a", "vllm"),
            Target("10.0.0.8:8000", "vllm", None, "vllm"),
        ],
        block=BlockSize(16, "vllm:cache_config_info in Prometheus at http://prom:9090"),
    )
    return Survey(**(defaults | fields))


def layout(tmp_path: Path, **fields) -> writers.Layout:
    return writers.Layout(directory=tmp_path, listen="127.0.0.1:9464", api_key_env="CHAT_KEY", **fields)


def test_the_config_is_what_was_found_and_loads_as_serve_loads_it(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    path.write_text(writers.kvwatch_config(found(), layout(tmp_path)))
    config = load_config(path)
    (target,) = config.targets
    assert (target.name, target.base_url, target.model) == (
        "chat",
        "https://llm.example.com/v1",
        "m1",
    )
    assert (target.session.mode, target.session.header) == ("client", "X-Session-Id")
    assert target.backend.headers == ("X-Upstream",) and target.api_key_env == "CHAT_KEY"
    assert config.exporter.listen == "127.0.0.1:9464"
    assert Path(config.exporter.webhook_token_file) == tmp_path / writers.TOKEN
    assert config.prometheus.url == "http://127.0.0.1:9090"


def test_a_gateway_that_sets_its_own_session_id_gets_server_mode(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    path.write_text(
        writers.kvwatch_config(found(session_mode="server", identity_header=None), layout(tmp_path))
    )
    (target,) = load_config(path).targets
    assert target.session.mode == "server"


def scrape_jobs(text: str) -> dict[str, dict]:
    return {job["job_name"]: job for job in yaml.safe_load(text)["scrape_configs"]}


def test_every_engine_is_scraped_with_the_replica_label_the_pages_group_by(tmp_path):
    survey = found(request=Request("http://gw:8000", engines=("10.0.0.9:8000", "10.0.0.7:8000")))
    jobs = scrape_jobs(writers.prometheus_config(survey, layout(tmp_path)))
    groups = jobs["llm-engines"]["static_configs"]
    replicas = {group["targets"][0]: group["labels"]["replica"] for group in groups}
    # Its own label where Prometheus had one, else a name by address; --engine adds, never twice.
    assert replicas == {"10.0.0.7:8000": "pod-a", "10.0.0.8:8000": "engine-2", "10.0.0.9:8000": "engine-3"}
    assert 'replica!=""' in queries.REPLICA_IDS  # the label the pages name replicas by
    assert jobs["kvwatch"]["static_configs"] == [{"targets": ["127.0.0.1:9464"]}]
    assert "llm-routers" not in jobs


def test_routers_rules_and_alertmanager_match_the_config(tmp_path):
    survey = found(routers=[Target("10.0.1.1:30000", "smg")])
    config = yaml.safe_load(
        writers.prometheus_config(survey, layout(tmp_path, alertmanager_url="http://am:9093"))
    )
    assert scrape_jobs(yaml.safe_dump(config))["llm-routers"]["static_configs"] == [
        {"targets": ["10.0.1.1:30000"]}
    ]
    assert config["rule_files"] == ["rules/*.yml"]
    assert config["alerting"]["alertmanagers"][0]["static_configs"] == [{"targets": ["am:9093"]}]


def test_kvwatch_listening_on_every_interface_is_scraped_at_this_hosts_name(tmp_path):
    everywhere = writers.Layout(directory=tmp_path, listen="0.0.0.0:9464")
    assert everywhere.exporter_address == f"{socket.gethostname()}:9464"
    jobs = scrape_jobs(writers.prometheus_config(found(), everywhere))
    assert jobs["kvwatch"]["static_configs"] == [{"targets": [f"{socket.gethostname()}:9464"]}]


def test_alertmanager_sends_to_the_configs_webhook_with_its_token_file(tmp_path):
    config = yaml.safe_load(writers.alertmanager_config(layout(tmp_path)))
    (kvwatch,) = [r for r in config["receivers"] if r["name"] == "kvwatch"]
    (webhook,) = kvwatch["webhook_configs"]
    assert webhook["url"] == "http://127.0.0.1:9464/alerts"
    assert webhook["http_config"]["authorization"] == {
        "type": "Bearer",
        "credentials_file": str(tmp_path / writers.TOKEN),
    }
    # The routes, timers and inhibitions are the template's own.
    assert {k: v for k, v in config.items() if k != "receivers"} == {
        k: v for k, v in ALERTMANAGER_TEMPLATE.items() if k != "receivers"
    }


def test_the_rule_files_are_kvwatchs_own():
    files = writers.rule_files()
    assert set(files) == {
        "kvwatch-engines.yml",
        "kvwatch-gateway.yml",
        "kvwatch-routers.yml",
        "kvwatch-probe-share.yml",
        "kvwatch.rules.yml",
    }
    assert files["kvwatch.rules.yml"] == (writers.PACKAGE / "alerts" / "kvwatch.rules.yml").read_text()


def test_nothing_is_overwritten_without_force(tmp_path):
    planned = writers.planned(found(), layout(tmp_path))
    token = tmp_path / writers.TOKEN
    writers.write(planned, token, force=False)
    first_token = token.read_text()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(first_token.strip()) >= 32
    (tmp_path / writers.CONFIG).write_text("# edited by hand\n")
    with pytest.raises(writers.ExistingFiles, match=r"would overwrite .*kvwatch\.yaml.*--force"):
        writers.write(planned, token, force=False)
    assert (
        tmp_path / writers.CONFIG
    ).read_text() == "# edited by hand\n" and token.read_text() == first_token
    writers.write(planned, token, force=True)
    assert (tmp_path / writers.CONFIG).read_text() == planned[tmp_path / writers.CONFIG]
    assert token.read_text() != first_token


def test_target_names_come_from_the_host():
    assert writers.target_name("https://LLM.example.com:8443/api/v1") == "llm-example-com-8443"
    assert writers.target_name("http://127.0.0.1:18000") == "127-0-0-1-18000"


def test_the_summary_says_what_was_found_and_assumed(tmp_path):
    survey = found(assumed=["model m1, the first of 2 listed (--model)"], models=["m1", "m2"])
    text = summary.summary(survey, layout(tmp_path), [tmp_path / writers.CONFIG])
    assert "models: m1, m2 (using m1)" in text
    assert "replica identity: X-Upstream (headers convention)" in text
    assert "engines in Prometheus: pod-a (10.0.0.7:8000), 10.0.0.8:8000" in text
    assert "KV block: 16 tokens" in text
    assert "Assumed (check these):\n  model m1, the first of 2 listed (--model)" in text
    assert "$CHAT_KEY" in text and f"kvwatch serve --config {tmp_path / writers.CONFIG}" in text


def test_a_model_is_picked_from_the_list_or_refused():
    survey = found(models=["a", "b"], assumed=[])
    assert _pick_model(survey, None) == "a" and "first of 2" in survey.assumed[0]
    assert _pick_model(survey, "b") == "b"
    with pytest.raises(SurveyError, match="model c is not among those the route lists: a, b"):
        _pick_model(survey, "c")


def test_a_scraped_engine_keeps_its_replica_or_pod_name_and_flavour():
    assert _target(
        {"__name__": "sglang:num_running_reqs", "instance": "i:1", "job": "j", "pod": "p"}
    ) == Target("i:1", "j", "p", "sglang")
    assert (
        _target(
            {"__name__": "vllm:num_requests_running", "instance": "i:2", "job": "j", "replica": "r"}
        ).replica
        == "r"
    )


def test_a_config_that_serve_would_refuse_is_never_planned(tmp_path):
    with pytest.raises(ConfigError, match=r"exporter\.listen"):
        writers.planned(found(), writers.Layout(directory=tmp_path, listen="127.0.0.1"))
    assert list(tmp_path.iterdir()) == []
