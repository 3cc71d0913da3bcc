"""VictoriaMetrics single-node scrapes the lab's targets with the lab's scrape config and answers the
Prometheus API at the lab's Prometheus port; vmalert evaluates kvwatch's recording rules and alerts
against it, writes the recorded series back into it and sends the alerts to the lab's Alertmanager.
vmalert answers the rules and alerts API itself, on Ports.rule_engine (kvwatch's prometheus.rules_url).

Debian's vmalert (1.79) refuses a rule file holding `keep_firing_for` (added in 1.92), so the lab loads
the alerts as `kvwatch generate` writes them with `keep_firing_for: false`."""

from __future__ import annotations

import yaml

from kvwatch.lab.metrics_stores.base import MetricsStore
from kvwatch.lab.process import Process, binary
from kvwatch.lab.state import LabState

SCRAPE_CONFIG = "victoria-metrics.yml"
# What only Prometheus reads in prometheus.yml; VictoriaMetrics refuses a scrape config holding it.
PROMETHEUS_ONLY = ("rule_files", "alerting")


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def write_scrape_config(state: LabState) -> None:
    """The lab's prometheus.yml without what only Prometheus reads: the same jobs, targets and labels.

    Without its external_labels: VictoriaMetrics stores them on every scraped series (Prometheus only
    sends them out), and a label the rules drop from the raw series but keep on the recorded ones (which
    vmalert's -external.label would give them) makes their joins match nothing."""
    config = yaml.safe_load((state.directory / "prometheus.yml").read_text())
    for key in PROMETHEUS_ONLY:
        config.pop(key, None)
    config["global"] = {"scrape_interval": config["global"]["scrape_interval"]}
    (state.directory / SCRAPE_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))


def victoria_metrics_process(state: LabState) -> Process:
    """Queries see samples as old as one scrape (-search.latencyOffset, 30 s by default), as Prometheus."""
    d, port = state.directory, state.ports.prometheus
    argv = [
        binary("victoria-metrics", "/usr/bin/victoria-metrics"),
        f"-httpListenAddr=127.0.0.1:{port}",
        f"-storageDataPath={d}/victoria-metrics-data",
        "-retentionPeriod=2d",
        f"-promscrape.config={d}/{SCRAPE_CONFIG}",
        f"-search.latencyOffset={state.scrape_interval}",
    ]
    return Process("victoria-metrics", argv, f"{_url(port)}/health")


def vmalert_process(state: LabState) -> Process:
    """Evaluating as often as Prometheus would, and flushing the recorded series as often."""
    ports, interval = state.ports, state.scrape_interval
    store = _url(ports.prometheus)
    argv = [
        binary("vmalert", "/usr/bin/vmalert"),
        f"-httpListenAddr=127.0.0.1:{ports.rule_engine}",
        f"-external.url={_url(ports.rule_engine)}",
        f"-rule={state.directory}/rules/*.yml",
        f"-datasource.url={store}",
        f"-remoteWrite.url={store}",
        f"-remoteWrite.flushInterval={interval}",
        f"-notifier.url={_url(ports.alertmanager)}",
        f"-evaluationInterval={interval}",
    ]
    return Process("vmalert", argv, f"{_url(ports.rule_engine)}/health")


STORE = MetricsStore(
    "victoriametrics",
    "VictoriaMetrics single-node scrapes, vmalert evaluates kvwatch's rules (alerts without "
    "keep_firing_for) against it",
    lambda state: [vmalert_process(state)],
    scraper="victoria-metrics",
    rule_engine="vmalert",
    keeps_firing=False,
    write_configs=write_scrape_config,
    started_first=lambda state: [victoria_metrics_process(state)],
)
