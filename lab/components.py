"""The processes of a lab: each component's command line and the URL that answers once it is ready.

A component is one entry in a group of `planned_processes`. Adding one (the exporter, the dashboard) is
adding an entry there and, if it has a port, a property in `lab.state.Ports`.
"""

from __future__ import annotations

from kvwatch.lab import rsyslog
from kvwatch.lab.gateways import GATEWAYS
from kvwatch.lab.gateways.sagemaker import LAB_CREDENTIALS
from kvwatch.lab.metrics_stores import METRICS_STORES
from kvwatch.lab.metrics_stores.prometheus import prometheus_process
from kvwatch.lab.process import Process, binary
from kvwatch.lab.process import kvwatch_command as _kvwatch
from kvwatch.lab.replicas import REPLICA_KINDS
from kvwatch.lab.state import LabState, ReplicaSpec


def replica_process(state: LabState, replica: ReplicaSpec) -> Process:
    return REPLICA_KINDS.lookup(state.engine).process(state, replica)


def alertmanager_process(state: LabState) -> Process:
    port = state.ports.alertmanager
    argv = [
        binary("prometheus-alertmanager", "/usr/bin/prometheus-alertmanager"),
        f"--config.file={state.directory}/alertmanager.yml",
        f"--storage.path={state.directory}/alertmanager",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--web.external-url=http://127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    return Process("alertmanager", argv, f"http://127.0.0.1:{port}/-/ready")


# What of the user's shell botocore would take up in the lab's serve: a profile (which the lab's empty
# shared files do not have, so botocore would refuse to start), a session token (theirs, sent with the
# lab's keys) and a proxy (for AWS; the lab's front is on loopback).
NOT_FOR_THE_LAB = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
)  # fmt: skip


def serve_process(state: LabState) -> Process:
    """kvwatch itself: probes through both gateways, the gateway logs, /metrics and the webhook. Behind
    the sagemaker gateway it signs its requests with the lab's dummy AWS credentials, never the user's
    (the shared AWS files are pointed at the lab's directory, where there are none)."""
    argv = _kvwatch("serve", "--config", str(state.directory / "kvwatch.yaml"))
    ready = f"http://127.0.0.1:{state.ports.exporter}/-/healthy"
    if state.gateway != "sagemaker":
        return Process("serve", argv, ready)
    none = str(state.directory / "no-aws-files")
    env = {**LAB_CREDENTIALS, "AWS_CONFIG_FILE": none, "AWS_SHARED_CREDENTIALS_FILE": none}
    return Process("serve", argv, ready, env, unset=NOT_FOR_THE_LAB)


def dashboard_process(state: LabState) -> Process:
    port = state.ports.dashboard
    argv = _kvwatch("dashboard", "--config", str(state.directory / "kvwatch.yaml"), "--port", str(port))
    if state.fast:  # as often as the probes run
        argv += ["--refresh-seconds", str(round(REPLICA_KINDS.lookup(state.engine).fast_probe_interval_s))]
    return Process("dashboard", argv, f"http://127.0.0.1:{port}/_stcore/health")


def traffic_process(state: LabState) -> Process:
    argv = _kvwatch(
        "lab",
        "traffic",
        "--url",
        f"http://127.0.0.1:{state.ports.affinity}",
        "--users",
        str(state.users),
        "--think",
        str(state.think_seconds),
        "--control",
        str(state.directory / "traffic.json"),
    )
    return Process("traffic", argv, None)


def planned_processes(state: LabState) -> list[list[Process]]:
    """Every process of the lab, in groups started one after the other; a group starts side by side.
    The gateways and Alertmanager (and a store its rule engine reads) come before Prometheus, kvwatch
    serve and the users, so that the first probes and the first alerts find them. In a lab of several
    clusters the central lab runs Alertmanager and Prometheus, each cluster the rest."""
    if state.clusters:
        return [[alertmanager_process(state)], [prometheus_process(state)]]
    store = METRICS_STORES.lookup(state.metrics_store)
    last = [*store.processes(state), serve_process(state)]
    if state.dashboard:
        last.append(dashboard_process(state))
    if state.users:
        last.append(traffic_process(state))
    alerting = [] if state.cluster else [alertmanager_process(state)]
    relay = [rsyslog.process(state)] if state.gateway_log_source == "syslog" else []
    return [
        [replica_process(state, replica) for replica in state.replicas],
        [GATEWAYS.lookup(state.gateway).process(state), *relay, *alerting, *store.started_first(state)],
        last,
    ]
