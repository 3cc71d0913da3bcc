"""The lab's gateways as a family (nginx, envoy): `kvwatch lab up --gateway` and `--envoy-lb`, the Envoy
config the real Envoy accepts for every gateway fault, and what Prometheus and kvwatch serve are told."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from kvwatch.cli.main import main
from kvwatch.collectors.gatewaylogs import LOG_FORMATS
from kvwatch.config.settings import load_config
from kvwatch.lab.configs import render_kvwatch_config, render_prometheus
from kvwatch.lab.gateways import GATEWAYS, envoy
from kvwatch.lab.state import LabState, ReplicaSpec
from processes import free_base_port

ENVOY_FAULTS = [[], ["break-affinity"], ["drop-session-header"], ["hash-request-id"]]


def lab_state(tmp_path: Path, gateway: str = "envoy", **options) -> LabState:
    state = LabState(tmp_path, 20000, gateway=gateway, **options)
    state.replicas = [ReplicaSpec(f"r{i + 1}", 20010 + i, "vllm") for i in range(3)]
    return state


def test_every_gateway_is_registered_under_its_name_with_a_log_format_kvwatch_reads():
    assert sorted(GATEWAYS) == ["envoy", "nginx", "sagemaker"]
    assert all(
        name == gateway.name and gateway.log_format in LOG_FORMATS for name, gateway in GATEWAYS.items()
    )


def static_resources(state: LabState, variant: int) -> dict:
    """The rendered listeners with their xDS files inlined, names and ports made the variant's own."""
    files = {name: yaml.safe_load(text) for name, text in envoy.render(state).items()}
    clusters = [
        {**{k: v for k, v in cluster.items() if k != "@type"}, "name": f"{cluster['name']}-{variant}"}
        for cluster in files["cds.yaml"]["resources"]
    ]
    listeners = files["envoy.yaml"]["static_resources"]["listeners"]
    for listener in listeners:
        listener["name"] += f"-{variant}"
        listener["address"]["socket_address"]["port_value"] += 100 * variant
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (route,) = files[f"rds-{manager.pop('rds')['route_config_name']}.yaml"]["resources"]
        manager["route_config"] = {k: v for k, v in route.items() if k != "@type"}
        for entry in manager["route_config"]["virtual_hosts"][0]["routes"]:
            if "route" in entry:
                entry["route"]["cluster"] += f"-{variant}"
    return {"listeners": listeners, "clusters": clusters}


def test_the_real_envoy_accepts_the_config_of_every_gateway_fault_and_balancer(tmp_path):
    """Every variant in one bootstrap, the xDS files inlined: one `envoy --mode validate` checks them all."""
    (tmp_path / "logs").mkdir()
    states = [
        lab_state(tmp_path, envoy_lb=balancer, faults=faults)
        for balancer in sorted(envoy.LOAD_BALANCERS)
        for faults in ENVOY_FAULTS
    ]
    variants = [static_resources(state, i) for i, state in enumerate(states)]
    bootstrap = yaml.safe_load(envoy.render(states[0])["envoy.yaml"])
    del bootstrap["dynamic_resources"]
    bootstrap["static_resources"] = {
        kind: [resource for variant in variants for resource in variant[kind]]
        for kind in ("listeners", "clusters")
    }
    config = tmp_path / "static.yaml"
    config.write_text(yaml.safe_dump(bootstrap))
    command = [envoy.envoy_binary(), "--mode", "validate", "-c", str(config)]
    check = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert f"configuration '{config}' OK" in check.stdout, check.stdout + check.stderr
    for state, variant in zip(states, variants, strict=True):
        policies = [cluster["lb_policy"] for cluster in variant["clusters"]]
        broken = state.faults == ["break-affinity"]
        assert policies == ["ROUND_ROBIN" if broken else envoy.LOAD_BALANCERS[state.envoy_lb], "ROUND_ROBIN"]


def test_envoys_routes_hash_the_header_each_fault_names(tmp_path):
    def hashed(faults: list[str]) -> list[dict]:
        routes = yaml.safe_load(envoy.render(lab_state(tmp_path, faults=faults))["rds-affinity.yaml"])
        (proxied,) = [r for r in routes["resources"][0]["virtual_hosts"][0]["routes"] if "route" in r]
        return proxied["route"].get("hash_policy", [])

    assert hashed([]) == [{"header": {"header_name": "x-session-id"}}]  # Istio's httpHeaderName
    assert hashed(["hash-request-id"]) == [{"header": {"header_name": "x-request-id"}}]
    assert hashed(["break-affinity"]) == []


def test_every_change_is_a_new_generation_in_every_xds_file(tmp_path):
    healthy, broken = lab_state(tmp_path), lab_state(tmp_path, faults=["break-affinity"])
    assert envoy.config_generation(healthy) != envoy.config_generation(broken)
    for state in (healthy, broken):
        for name, text in envoy.render(state).items():
            if name != "envoy.yaml":
                assert envoy.config_generation(state) in text, name


def test_prometheus_scrapes_the_admin_stats_of_a_gateway_that_has_them(tmp_path):
    def jobs(gateway: str) -> dict[str, dict]:
        config = yaml.safe_load(render_prometheus(lab_state(tmp_path, gateway)))
        return {job["job_name"]: job for job in config["scrape_configs"]}

    assert "envoy" not in jobs("nginx")
    assert jobs("envoy")["envoy"]["metrics_path"] == "/stats/prometheus"
    assert jobs("envoy")["envoy"]["static_configs"] == [{"targets": ["127.0.0.1:20006"]}]


@pytest.mark.parametrize("gateway", sorted(GATEWAYS))
def test_kvwatch_serve_reads_the_gateways_access_logs_in_its_format(tmp_path, gateway):
    path = tmp_path / "kvwatch.yaml"
    path.write_text(render_kvwatch_config(lab_state(tmp_path, gateway)))
    assert {log.format for log in load_config(path).gateway_logs} == {GATEWAYS[gateway].log_format}


def lab_up(tmp_path: Path, *flags: str) -> int:
    return main(["lab", "up", "--detach", "--state-dir", str(tmp_path / "state"), *flags])


def test_an_unknown_gateway_is_refused_naming_the_known_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_code:
        lab_up(tmp_path, "--gateway", "istio")
    assert exit_code.value.code == 2
    assert (
        "--gateway: invalid choice: 'istio' (choose from 'envoy', 'nginx', 'sagemaker')"
        in capsys.readouterr().err
    )


def test_an_unknown_envoy_balancer_is_refused_naming_the_known_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_code:
        lab_up(tmp_path, "--gateway", "envoy", "--envoy-lb", "random")
    assert exit_code.value.code == 2
    refused = "--envoy-lb: invalid choice: 'random' (choose from 'maglev', 'ring-hash')"
    assert refused in capsys.readouterr().err


def test_an_envoy_balancer_without_envoy_is_refused(tmp_path, capsys):
    assert lab_up(tmp_path, "--envoy-lb", "maglev") == 1
    assert capsys.readouterr().err == (
        "kvwatch lab: --envoy-lb is for --gateway envoy; the nginx gateway has its own balancing\n"
    )
    assert not (tmp_path / "state").exists()


def test_envoys_admin_port_taken_is_named_and_nothing_starts(tmp_path, capsys):
    base = free_base_port()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + 6))
        blocker.listen()
        assert lab_up(tmp_path, "--gateway", "envoy", "--base-port", str(base)) == 1
    assert f"port {base + 6} on 127.0.0.1 (gateway admin) is already in use" in capsys.readouterr().err
    assert LabState.load((tmp_path / "state").resolve()).processes == {}
