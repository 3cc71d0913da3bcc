"""A lab of several clusters, without starting it: the central and agent Prometheus configs, the
Alertmanager webhooks, the port blocks and the command line's errors."""

from __future__ import annotations

import pytest
import yaml

from kvwatch.cli.main import main
from kvwatch.config.settings import load_config
from kvwatch.lab import components, rsyslog, stack
from kvwatch.lab.configs import render_alertmanager, render_kvwatch_config, render_prometheus
from kvwatch.lab.gateways import nginx
from kvwatch.lab.process import LabError
from kvwatch.lab.state import MAX_CLUSTER_REPLICAS, MAX_CLUSTERS, LabState

BASE = 24000


@pytest.fixture
def planned(tmp_path) -> list[LabState]:
    """A central lab and clusters a and b of three replicas each, as `lab up --clusters 2` saves them."""
    return stack.plan(tmp_path, BASE, 3, ["vllm"], clusters=2, fast=True)


def jobs(config: dict) -> dict[str, list[str]]:
    return {
        job["job_name"]: [target for group in job["static_configs"] for target in group["targets"]]
        for job in config["scrape_configs"]
    }


def test_a_clusters_prometheus_is_an_agent_remote_writing_its_samples_with_its_name(planned):
    central, a, _ = planned
    config = yaml.safe_load(render_prometheus(a))
    assert config["global"]["external_labels"] == {"kvwatch": "lab", "cluster": "a"}
    assert config["remote_write"] == [
        {
            "url": f"http://127.0.0.1:{central.ports.prometheus}/api/v1/write",
            "queue_config": {"batch_send_deadline": "1s"},
        }
    ]
    assert "rule_files" not in config and "alerting" not in config
    assert jobs(config) == {
        "replicas": [f"127.0.0.1:{BASE + 30 + i}" for i in range(3)],
        "prometheus": [f"127.0.0.1:{a.ports.prometheus}"],
        "kvwatch": [f"127.0.0.1:{a.ports.exporter}"],
    }
    argv = components.prometheus_process(a).argv
    assert "--enable-feature=agent" in argv and f"--storage.agent.path={a.directory}/prometheus-data" in argv
    assert not any(arg.startswith("--storage.tsdb") for arg in argv)


def test_the_central_prometheus_receives_evaluates_and_alerts(planned):
    central = planned[0]
    config = yaml.safe_load(render_prometheus(central))
    assert "remote_write" not in config and "cluster" not in config["global"]["external_labels"]
    assert config["rule_files"] == [str(central.directory / "rules" / "*.yml")]
    alertmanager = f"127.0.0.1:{central.ports.alertmanager}"
    assert config["alerting"]["alertmanagers"] == [{"static_configs": [{"targets": [alertmanager]}]}]
    assert jobs(config) == {
        "prometheus": [f"127.0.0.1:{central.ports.prometheus}"],
        "alertmanager": [alertmanager],
    }
    assert "--web.enable-remote-write-receiver" in components.prometheus_process(central).argv
    assert [[p.name for p in group] for group in components.planned_processes(central)] == [
        ["alertmanager"],
        ["prometheus"],
    ]


def test_a_single_cluster_lab_neither_receives_nor_writes(tmp_path):
    (lab,) = stack.plan(tmp_path, BASE, 2, ["vllm"])
    config = yaml.safe_load(render_prometheus(lab))
    assert "remote_write" not in config and config["global"]["external_labels"] == {"kvwatch": "lab"}
    argv = components.prometheus_process(lab).argv
    assert not {"--enable-feature=agent", "--web.enable-remote-write-receiver"} & set(argv)
    names = [[p.name for p in group] for group in components.planned_processes(lab)]
    assert names == [
        ["replica-r1", "replica-r2"],
        ["nginx", "alertmanager"],
        ["prometheus", "serve", "dashboard", "traffic"],
    ]


def test_the_one_alertmanager_sends_to_every_clusters_kvwatch_with_its_token(planned):
    central, a, b = planned
    (receiver,) = [
        r for r in yaml.safe_load(render_alertmanager(central))["receivers"] if r["name"] == "kvwatch"
    ]
    assert [(w["url"], w["http_config"]["authorization"]["credentials_file"], w["send_resolved"])
            for w in receiver["webhook_configs"]] == [
        (f"http://127.0.0.1:{lab.ports.exporter}/alerts", str(lab.directory / "webhook-token"), True)
        for lab in (a, b)
    ]  # fmt: skip


def test_a_clusters_kvwatch_reads_the_central_prometheus_and_alertmanager(planned):
    central, a, _ = planned
    config = yaml.safe_load(render_kvwatch_config(a))
    assert config["prometheus"]["url"] == f"http://127.0.0.1:{central.ports.prometheus}"
    assert config["alertmanager"]["url"] == f"http://127.0.0.1:{central.ports.alertmanager}"
    assert config["exporter"]["listen"] == f"127.0.0.1:{a.ports.exporter}"
    assert config["store"]["path"] == str(a.directory / "kvwatch.db")


def test_the_largest_lab_of_clusters_uses_distinct_ports_in_one_block_of_100(tmp_path):
    planned = stack.plan(tmp_path, BASE, MAX_CLUSTER_REPLICAS, ["vllm"], clusters=MAX_CLUSTERS)
    ports = stack.listening_ports(planned)
    assert len(set(ports.values())) == len(ports)
    assert min(ports.values()) >= BASE and max(ports.values()) < BASE + 100
    assert ports["cluster d's prometheus"] == BASE + 4 * 20 + 2
    assert [lab.directory for lab in planned] == [tmp_path, *(tmp_path / name for name in "abcd")]


def test_a_fault_names_its_cluster_exactly_when_there_are_several(planned, tmp_path):
    central = planned[0]
    assert stack.cluster(central, "b").directory == tmp_path / "b"
    with pytest.raises(LabError, match=r"^this lab runs clusters a, b: name one with --cluster NAME$"):
        stack.cluster(central, None)
    with pytest.raises(LabError, match=r"^no cluster 'c' in this lab \(clusters: a, b\)$"):
        stack.cluster(central, "c")
    (single,) = stack.plan(tmp_path / "single", BASE, 2, ["vllm"])
    assert stack.cluster(single, None) is single
    with pytest.raises(LabError, match=r"^--cluster a: this lab runs one cluster"):
        stack.cluster(single, "a")


@pytest.mark.parametrize(
    "options, message",
    [
        (("--clusters", "0"), f"--clusters must be from 1 to {MAX_CLUSTERS}"),
        (("--clusters", str(MAX_CLUSTERS + 1)), f"--clusters must be from 1 to {MAX_CLUSTERS}"),
        (("--clusters", "2", "--replicas", str(MAX_CLUSTER_REPLICAS + 1)), "--replicas must be at most"),
    ],
)
def test_up_refuses_impossible_clusters(tmp_path, capsys, options, message):
    assert main(["lab", "up", "--detach", "--state-dir", str(tmp_path), *options]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "state.json").exists()


def test_fault_and_heal_on_a_saved_lab_of_clusters_name_the_cluster(planned, tmp_path, capsys):
    assert main(["lab", "fault", "break-affinity", "--state-dir", str(tmp_path)]) == 1
    assert "name one with --cluster NAME" in capsys.readouterr().err
    assert main(["lab", "heal", "--cluster", "z", "--state-dir", str(tmp_path)]) == 1
    assert "no cluster 'z' in this lab (clusters: a, b)" in capsys.readouterr().err


def test_behind_the_sagemaker_gateway_serve_probes_the_endpoint_with_and_without_sessions(tmp_path):
    (state,) = stack.plan(tmp_path, BASE, 2, ["sim"], gateway="sagemaker", fast=True)
    path = tmp_path / "kvwatch.yaml"
    path.write_text(render_kvwatch_config(state))
    targets = {t.name: t for t in load_config(path).targets}
    affinity, round_robin = targets["lab-affinity"], targets["lab-round-robin"]
    assert (affinity.kind, affinity.session.mode, affinity.expect_sticky) == ("sagemaker", "client", True)
    without = (round_robin.kind, round_robin.session.mode, round_robin.expect_sticky)
    assert without == ("sagemaker", "none", False)
    assert affinity.sagemaker.endpoint_url == f"http://127.0.0.1:{state.ports.affinity}"
    assert round_robin.sagemaker.endpoint_name == "lab-endpoint"
    serve = components.serve_process(state)
    assert serve.env["AWS_SHARED_CREDENTIALS_FILE"] == str(tmp_path / "no-aws-files")  # never the user's


def test_the_syslog_lab_sends_nginx_logs_to_kvwatch_and_through_rsyslog(tmp_path):
    state = LabState(tmp_path, 21000, gateway_log_source="syslog")
    conf = nginx.render(state)["nginx.conf"]
    assert "access_log syslog:server=127.0.0.1:21007,tag=nginx,nohostname kvwatch_json;" in conf
    assert "access_log syslog:server=127.0.0.1:21009,tag=nginx kvwatch_json;" in conf
    assert f"access_log {tmp_path}/logs/gateway-affinity.jsonl kvwatch_json;" in conf  # the ground truth
    logs = {log["name"]: log for log in yaml.safe_load(render_kvwatch_config(state))["gateway_logs"]}
    assert logs["affinity"]["source"] == "syslog" and logs["affinity"]["listen"] == "127.0.0.1:21007"
    assert logs["round_robin"]["listen"] == "127.0.0.1:21008" and "path" not in logs["round_robin"]
    rsyslog.write_config(state)
    relay = (tmp_path / "rsyslog.conf").read_text()
    assert 'port="21009"' in relay and 'port="21008"' in relay and 'TCP_Framing="octet-counted"' in relay
    assert "syslog:" not in nginx.render(LabState(tmp_path, 21000))["nginx.conf"]  # the default lab
