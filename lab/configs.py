"""Generated configuration of the lab's Prometheus, Alertmanager and `kvwatch serve`, from the lab state
(the gateway's own is its module's in lab/gateways/)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from kvwatch.cli.generate import RULE_FILES, rule_file_texts
from kvwatch.config.settings import GatewayLog
from kvwatch.core.credentials import write_new_token
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.lab.gateways import GATEWAYS
from kvwatch.lab.gateways.sagemaker import ENDPOINT as SAGEMAKER_ENDPOINT
from kvwatch.lab.gateways.sagemaker import LAB_REGION
from kvwatch.lab.metrics_stores import METRICS_STORES
from kvwatch.lab.process import LabError
from kvwatch.lab.replicas import REPLICA_KINDS
from kvwatch.lab.state import LabState
from kvwatch.prometheus.thresholds import THRESHOLDS

REPO = Path(__file__).resolve().parent.parent

MIN_SCALED_SECONDS = 3  # a scaled rate window must still hold a few 1 s scrapes
RULE_PATTERNS = ("prometheus/rules/*.yml", "alerts/*.rules.yml")
ALERTMANAGER_TIMERS = ("group_wait", "group_interval", "repeat_interval", "resolve_timeout")
_DURATION = re.compile(r"(?<![\w.])(\d+)(ms|s|m|h|d)\b")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
WEBHOOK_TOKEN_FILE = "webhook-token"


def scale_durations(text: str, factor: float) -> str:
    """Every Prometheus duration in `text` (windows, offsets, `for`) times `factor`, in whole seconds."""
    if factor == 1:
        return text

    def scaled(match: re.Match) -> str:
        seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        return f"{max(MIN_SCALED_SECONDS, round(seconds * factor)) if seconds else 0}s"

    return _DURATION.sub(scaled, text)


def rule_files(state: LabState) -> dict[str, str]:
    """The rule files Prometheus loads: the repository's, with `--rule-time-scale` applied (name -> text);
    for a rule engine without keep_firing_for, as `kvwatch generate` writes them with it off.

    A scale of 0.1 makes what takes minutes in production take seconds in the lab and its tests."""
    if not METRICS_STORES.lookup(state.metrics_store).keeps_firing:
        held = dataclasses.replace(THRESHOLDS, keep_firing_for=False)
        texts = rule_file_texts(t=held)
        return {Path(path).name: scale_durations(texts[path], state.rule_time_scale) for path in RULE_FILES}
    found = []
    for pattern in RULE_PATTERNS:
        if not (matched := sorted(REPO.glob(pattern))):
            raise LabError(f"no rule files match {REPO / pattern}: this kvwatch installation is incomplete")
        found += matched
    return {path.name: scale_durations(path.read_text(), state.rule_time_scale) for path in found}


def write_webhook_token(state: LabState) -> None:
    """A fresh random bearer token for kvwatch's webhook, in a file only the lab's user can read:
    Alertmanager sends it and `kvwatch serve` requires it, both naming the file, as an operator sets up."""
    write_new_token(state.directory / WEBHOOK_TOKEN_FILE)


def render_alertmanager(state: LabState) -> str:
    """alerts/alertmanager.yml with kvwatch's webhook on this lab's exporter and with the lab's webhook
    token (in a lab of several clusters, on every cluster's, each with its token), timers time-scaled."""
    config = yaml.safe_load((REPO / "alerts" / "alertmanager.yml").read_text())
    kvwatches = [state.member(name) for name in state.clusters] or [state]
    for receiver in config["receivers"]:
        if "webhook_configs" in receiver:
            receiver["webhook_configs"] = [
                {
                    **webhook,
                    "url": f"http://127.0.0.1:{kvwatch.ports.exporter}/alerts",
                    "http_config": {
                        "authorization": {
                            "type": "Bearer",
                            "credentials_file": str(kvwatch.directory / WEBHOOK_TOKEN_FILE),
                        }
                    },
                }
                for webhook in receiver["webhook_configs"]
                for kvwatch in kvwatches
            ]

    def scale(node: dict) -> None:
        for key in ALERTMANAGER_TIMERS:
            if key in node:
                node[key] = scale_durations(node[key], state.rule_time_scale)
        for child in node.get("routes", []):
            scale(child)

    scale(config["route"])
    scale(config["global"])
    return yaml.safe_dump(config, sort_keys=False)


def render_prometheus(state: LabState) -> str:
    """prometheus.yml: scrape every replica (with replica and flavour labels), the lab's services and the
    gateway's admin API where it has one, evaluate kvwatch's rules and alert the lab's Alertmanager.

    In a lab of several clusters the central Prometheus scrapes only the central services and gets the
    rest by remote_write; each cluster's Prometheus, an agent, scrapes its cluster and remote-writes
    every sample with its cluster's name as an external label."""
    config = yaml.safe_load((REPO / "prometheus" / "prometheus.lab.yml").read_text())
    interval = state.scrape_interval
    config["global"]["scrape_interval"] = interval
    config["global"]["evaluation_interval"] = interval
    ports = state.ports
    jobs = {"prometheus": ports.prometheus, "alertmanager": ports.alertmanager, "kvwatch": ports.exporter}
    if METRICS_STORES.lookup(state.metrics_store).rules_apart:  # it counts the alerts it sends
        jobs["rule_engine"] = ports.rule_engine
    if state.clusters:  # the central lab runs no kvwatch serve
        del jobs["kvwatch"]
    if state.cluster:
        del jobs["alertmanager"], config["rule_files"], config["alerting"]  # an agent evaluates nothing
        config["global"]["external_labels"][CLUSTER_LABEL] = state.cluster
        config["remote_write"] = [
            {
                "url": f"http://127.0.0.1:{state.central.prometheus}/api/v1/write",
                "queue_config": {"batch_send_deadline": interval},
            }
        ]
    else:
        config["rule_files"] = [str(state.directory / "rules" / "*.yml")]
        config["alerting"]["alertmanagers"] = [
            {"static_configs": [{"targets": [f"127.0.0.1:{ports.alertmanager}"]}]}
        ]
    config["scrape_configs"] = [
        {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
        for job, port in jobs.items()
    ]
    if state.clusters:
        return yaml.safe_dump(config, sort_keys=False)
    config["scrape_configs"].insert(
        0,
        {
            "job_name": "replicas",
            "static_configs": [
                {
                    "targets": [f"127.0.0.1:{replica.port}"],
                    "labels": {"replica": replica.id, "flavour": replica.flavour},
                }
                for replica in state.replicas
            ],
        },
    )
    gateway = GATEWAYS.lookup(state.gateway)
    if gateway.metrics_path:
        config["scrape_configs"].append(
            {
                "job_name": gateway.name,
                "metrics_path": gateway.metrics_path,
                "static_configs": [{"targets": [f"127.0.0.1:{ports.gateway_admin}"]}],
            }
        )
    return yaml.safe_dump(config, sort_keys=False)


def _as_sagemaker_target(target: dict) -> None:
    """An example target turned into one of the SageMaker front's endpoint at the same port: its
    round-robin route is the endpoint without sessions (the A/B's baseline)."""
    url = target.pop("base_url")
    target["kind"] = "sagemaker"
    target["sagemaker"] = {"endpoint_name": SAGEMAKER_ENDPOINT, "region": LAB_REGION, "endpoint_url": url}
    if target["route_mode"] == "round_robin":
        target["session"] = {**target.get("session", {}), "mode": "none"}


def render_kvwatch_config(state: LabState) -> str:
    """The kvwatch config `kvwatch serve` runs in the lab: examples/kvwatch.lab.yaml with this lab's
    ports, state directory, kind of replica and gateway log format (a short probe interval with --fast,
    no probes with --no-probes). Behind the sagemaker gateway its targets are the front's endpoint:
    with stateful sessions through the affinity listener, without through the round-robin one."""
    config = yaml.safe_load((REPO / "examples" / "kvwatch.lab.yaml").read_text())
    ports, directory = state.ports, state.directory
    gateways = {"affinity": ports.affinity, "round_robin": ports.round_robin}
    kind = REPLICA_KINDS.lookup(state.engine)
    for target in config["targets"]:
        target["base_url"] = f"http://127.0.0.1:{gateways[target['route_mode']]}"
        target["model"] = state.model
        if state.fast:
            target["interval_seconds"] = kind.fast_probe_interval_s
        if kind.probe_workload:
            target["workload"] = {**target.get("workload", {}), **kind.probe_workload}
        if state.gateway == "sagemaker":
            _as_sagemaker_target(target)
    if not state.probes or state.clusters:  # the central kvwatch only receives the alerts
        config["targets"] = []
    if state.clusters:
        config["gateway_logs"] = []
    for log in config["gateway_logs"]:
        log["path"] = str(directory / "logs" / f"gateway-{log['name']}.jsonl")
        if state.gateway_log_source != "file":  # the file stays as the ground truth
            del log["path"]
            log["source"] = state.gateway_log_source
            log["listen"] = f"127.0.0.1:{getattr(ports, 'syslog_' + log['name'])}"
        if (
            log_format := GATEWAYS.lookup(state.gateway).log_format
        ) != GatewayLog.format:  # as the example, else
            log["format"] = log_format
        if state.rule_time_scale != 1:  # a detection window like the rules' own: scaled with them
            window = log.get("spread_window_seconds", GatewayLog.spread_window_seconds)
            log["spread_window_seconds"] = window * state.rule_time_scale
    config["exporter"]["listen"] = f"127.0.0.1:{ports.exporter}"
    config["exporter"]["webhook_token_file"] = str(directory / WEBHOOK_TOKEN_FILE)
    config["store"]["path"] = str(directory / "kvwatch.db")
    config["prometheus"]["url"] = f"http://127.0.0.1:{state.central.prometheus}"
    if rules_url := METRICS_STORES.lookup(state.metrics_store).rules_url(state):
        config["prometheus"]["rules_url"] = rules_url
    config["alertmanager"]["url"] = f"http://127.0.0.1:{state.central.alertmanager}"
    return yaml.safe_dump(config, sort_keys=False)
