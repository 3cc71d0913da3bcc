"""The dashboard's real data layer, quantile intervals, and the options `kvwatch dashboard` passes."""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pandas as pd
import pytest
import streamlit as st
import yaml
from fake_dashboard import (
    BROKEN,
    CONFIG,
    FAULT,
    KEY,
    KEY_ENV,
    LOAD,
    REPLICAS,
    REPORTS,
    SESSIONS,
    T0,
)
from fake_dashboard import config_file as config_file  # the fixtures
from fake_dashboard import fake as fake
from fake_dashboard import no_component_scan as no_component_scan

from kvwatch.cli.main import main
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.config.settings import DashboardSettings, Target
from kvwatch.core.naming import RUNBOOK_URL
from kvwatch.core.stats import quantile_interval
from kvwatch.dashboard import data
from kvwatch.dashboard.data import Result
from kvwatch.doctor import checks
from kvwatch.doctor.caching import Cluster
from kvwatch.experiment.report import FILES
from kvwatch.grafana import panels
from kvwatch.prometheus import panel_queries, queries
from kvwatch.store.history import Store
from processes import free_port, start_prometheus, stop


def test_the_data_layer_names_what_it_could_not_reach(config_file):
    url = data.settings().value.prometheus.url
    assert data.series(queries.CLUSTER_HIT_RATIO, data.span(900)).error == (
        f"Cannot reach Prometheus at {url}: Connection refused. Is it running?"
    )
    assert data.alerts().error == (
        f"Cannot reach Alertmanager at {url}/api/v2/alerts: Connection refused. Is it running?"
    )
    store = config_file.parent / "kvwatch.db"
    assert data.sessions(0).error == (
        f"no kvwatch store at {store}: `kvwatch serve` creates it (store.path in {config_file})."
    )


def test_the_data_layer_names_a_bad_config(config_file):
    config_file.write_text("targets: [{name: t}]\n")
    assert data.settings().error == (
        f"error in {config_file}: targets[0].base_url: required key is missing. "
        "Start the dashboard with `kvwatch dashboard --config FILE`."
    )


def test_the_data_layer_reads_the_store(config_file):
    alert = {"status": "firing", "labels": {"alertname": "Watchdog"}, "annotations": {"summary": "alive"},
             "startsAt": "2026-11-29T18:00:00Z", "fingerprint": "f1"}  # fmt: skip
    with Store(config_file.parent / "kvwatch.db") as store:
        for result in SESSIONS.values():
            store.add_session(result)
        store.add_alerts({"version": "4", "alerts": [alert]}, received_at=T0)
    assert list(data.sessions(0).value["session_id"]) == ["sid-4", "sid-3", "sid-2", "sid-1"]
    assert len(data.rounds(0).value) == 16  # 4 sessions of 4 rounds, the last one failed
    summary = data.ttft_by_round(0).value.set_index(["target", "round"])
    assert summary.loc[("lab-affinity", 1), "median"] == pytest.approx(0.41)
    (received,) = data.received_alerts(0).value.to_dict("records")
    assert received["alertname"] == "Watchdog" and received["state"] == "firing"
    assert received["starts_at"] == pd.Timestamp("2026-11-29T18:00:00Z")
    assert received["received_at"] == pd.Timestamp(T0, unit="s", tz="UTC")


def test_the_data_layer_splits_the_stores_rounds_at_a_moment(config_file):
    with Store(config_file.parent / "kvwatch.db") as store:
        for result in BROKEN.values():
            store.add_session(result)
    split = data.ttft_by_round(0, FAULT).value.set_index(["target", "period", "round"])
    assert list(split.loc[("lab-affinity", "before"), "n"]) == [3, 3, 2, 2]  # session 13 straddles it
    assert list(split.loc[("lab-affinity", "after"), "n"]) == [2, 2, 3, 3]
    assert split.loc[("lab-affinity", "after", 3), "median"] == pytest.approx(0.60)  # 0.52, 0.60, 0.61
    whole = data.ttft_by_round(0).value
    assert set(whole["period"]) == {"all"} and list(whole["n"]) == [5] * 4 + [2] * 4


def test_queries_get_a_rate_window_of_ten_minutes_or_one_step():
    hour, week = data.Span(0, 3600, 15), data.Span(0, 7 * 86400, 2520)
    assert "[600s]" in data.filled(panel_queries.AFFINITY_EFFICIENCY, hour)
    assert "[2520s]" in data.filled(panel_queries.AFFINITY_EFFICIENCY, week)
    assert "$" not in data.filled(panel_queries.PROBE_STICKY_SHARE, hour)


class Clusters(BaseHTTPRequestHandler):
    """Two clusters' kvwatch exporters on one port, /a and /b: each route's last run stuck differently."""

    STICKY = {"a": 1.0, "b": 0.25}
    WARM_COLD = {"a": 0.4, "b": 0.9}
    CACHING = {"a": ("True", 32), "b": ("False", 16)}  # each cluster's engine: prefix caching, block size

    def do_GET(self) -> None:
        cluster = self.path.strip("/").partition("/")[0]
        labels = 'target="lab-affinity",route_mode="affinity"'
        caching, block = self.CACHING[cluster]
        body = (
            f"kvwatch_probe_sticky_ratio{{{labels}}} {self.STICKY[cluster]}\n"
            f"kvwatch_probe_warm_cold_ttft_ratio{{{labels}}} {self.WARM_COLD[cluster]}\n"
            f'vllm:cache_config_info{{enable_prefix_caching="{caching}",block_size="{block}"}} 1\n'
        )
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.mark.integration
def test_the_data_layer_reads_each_cluster_apart_in_a_real_prometheus(tmp_path, monkeypatch):
    """One real Prometheus scraping two clusters (the target label `cluster`, as external_labels or
    relabelling set it): the clusters are listed, and each cluster's read holds its series alone. The
    Grafana boards' per-route line, with All clusters picked, is one line per cluster, never their max.
    The doctor of one cluster reads that cluster's engines alone, and says which it read."""
    exporters = ThreadingHTTPServer(("127.0.0.1", 0), Clusters)
    threading.Thread(target=exporters.serve_forever, daemon=True).start()
    address, port = f"127.0.0.1:{exporters.server_address[1]}", free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "kvwatch", "static_configs": [
            {"targets": [address], "labels": {"cluster": name, "__metrics_path__": f"/{name}/metrics"}}
            for name in Clusters.STICKY]}],
    }))  # fmt: skip
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        "targets: [{name: lab-affinity, base_url: 'http://127.0.0.1:1', model: m}]\n"
        f"prometheus: {{url: 'http://127.0.0.1:{port}'}}\n"
    )
    monkeypatch.setattr(sys, "argv", ["app.py", "--config", str(config)])
    monkeypatch.setattr(data, "now", time.time)  # Prometheus holds nothing before it started
    prometheus, log = start_prometheus(tmp_path, port)
    try:
        deadline = time.monotonic() + 15
        while True:
            st.cache_data.clear()
            over = data.span(60)
            read = {name: data.instant(queries.STICKY_RATIO, over, name) for name in Clusters.STICKY}
            if all(not r.error and len(r.value) for r in read.values()):
                break
            assert time.monotonic() < deadline, f"{read}\n{log.read_text()[-2000:]}"
            time.sleep(0.2)
        assert data.clusters().value == ["a", "b"]
        assert {name: list(r.value["value"]) for name, r in read.items()} == {"a": [1.0], "b": [0.25]}
        board = data.instant_query(
            panels.as_board_runs(panel_queries.WARM_COLD_TTFT_RATIO, "cluster"), over
        ).value
        assert dict(zip(board["cluster"], board["value"], strict=True)) == Clusters.WARM_COLD
        prometheus_url = f"http://127.0.0.1:{port}"
        route = ProbeSettings(base_url="http://127.0.0.1:1", model="m", timeout_seconds=2)
        found = {}
        for name in (None, *Clusters.CACHING, "c"):
            cluster = Cluster(name) if name else None
            judged = checks.diagnose(route, prometheus_url, cluster=cluster).checks
            found[name] = next(c for c in judged if c.name == "prefix caching")
        unknown = found.pop("c")  # a cluster Prometheus holds no engine of: named, with those it holds
        assert unknown.cause == "cluster_not_found"
        said = 'no engine series has cluster="c", so none is judged; its engines\' cluster values are a, b'
        assert said in unknown.evidence
        found = {name: check.evidence for name, check in found.items()}
        off = f"{address} in cluster b reports enable_prefix_caching=False"
        assert f"Prometheus: {off}" in found[None]
        assert "Prometheus (cluster a): no engine has prefix caching off" in found["a"]
        assert off not in found["a"]
        assert f"Prometheus (cluster b): {off}" in found["b"]
        for name, (_, block) in Clusters.CACHING.items():  # the block size the doctor learns, per cluster
            narrowed = Cluster(name).narrowed(blocksize.PROMETHEUS_QUERY)
            sources = blocksize.BlockSizeSources(prometheus_url=prometheus_url, prometheus_query=narrowed)
            assert asyncio.run(blocksize.learn(sources, [])).tokens == block
    finally:
        stop(prometheus)
        exporters.shutdown()
        exporters.server_close()
        st.cache_data.clear()


def test_the_doctor_names_a_missing_api_key(config_file, monkeypatch):
    monkeypatch.delenv("KVWATCH_TEST_KEY", raising=False)
    target = Target("t", "http://127.0.0.1:1", "m", api_key_env="KVWATCH_TEST_KEY")
    assert data.run_doctor(target).error == "target t: environment variable KVWATCH_TEST_KEY is not set"


def test_an_experiment_report_reads_the_load_and_replica_files_the_experiment_wrote(tmp_path):
    files = {name: tmp_path / FILES[name] for name in ("report", "load", "replicas")}
    files["report"].write_text("## A/B experiment: rr vs aff\n")
    assert data.experiment_report(tmp_path).value == data.Report(
        tmp_path, "## A/B experiment: rr vs aff\n", None
    )
    LOAD.to_csv(files["load"], index=False)
    REPLICAS.to_csv(files["replicas"], index=False)
    data.experiment_report.clear()
    report = data.experiment_report(tmp_path).value
    pd.testing.assert_frame_equal(report.load, LOAD)
    pd.testing.assert_frame_equal(report.replicas, REPLICAS)
    files["load"].write_text('route,requests\n"rr,1\n')
    data.experiment_report.clear()
    assert data.experiment_report(tmp_path).error.startswith(
        f"Cannot read the experiment report in {tmp_path}: "
    )


def test_an_experiment_run_reads_each_targets_own_key_and_says_why_it_failed(config_file, monkeypatch):
    closed = f"http://127.0.0.1:{free_port()}"
    keyed, plain = Target("keyed", closed, "m", api_key_env=KEY_ENV), Target("plain", closed, "m")
    out = config_file.parent / "reports" / "ab-1"
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert data.run_experiment(keyed, plain, out, 1, 2, 0).error == (
        f"The experiment cannot run: target keyed: environment variable {KEY_ENV} is not set"
    )
    monkeypatch.setenv(KEY_ENV, KEY)
    failed = data.run_experiment(keyed, plain, out, 1, 2, 0).error
    assert failed.startswith("2 of 2 sessions failed; connection_refused (") and KEY not in failed
    assert list(out.iterdir()) == []  # made before the run, and nothing written when every session failed


def test_runbook_sections_come_from_the_runbook_kvwatch_ships(fake):
    section = data.runbook(f"{RUNBOOK_URL}#kvwatchprobestale").value
    assert section.startswith("## KVWatchProbeStale\n")
    missing = data.runbook(f"{RUNBOOK_URL}#nothing").error
    assert missing.startswith("No section #nothing in the runbook")
    assert data.runbook("https://wiki.example.net/other-runbook#kvwatchprobestale") == Result(None)
    wiki = "https://wiki.example.net/sre/kvwatch-runbook"  # where `make generate RUNBOOK_URL=...` put it
    fake.settings = Result(replace(CONFIG, dashboard=DashboardSettings(REPORTS, runbook_url=wiki)))
    assert data.runbook(f"{wiki}#kvwatchprobestale").value == section


def test_quantile_intervals_hold_the_quantile():
    values = pd.Series(range(1, 101), dtype=float).to_numpy()
    median, low, high = quantile_interval(values, 0.5)
    assert median == 50.5 and low < median < high
    assert (low, high) == (40.0, 61.0)  # 1.76 % of Binomial(100, 0.5) lies below 40, 1.76 % above 60
    assert quantile_interval(values[:1], 0.9) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("n", [5, 20, 28, 30, 45, 100, 1000])
@pytest.mark.parametrize("q", [0.5, 0.9])
def test_quantile_intervals_are_95_percent_or_the_widest_there_is(n, q):
    """The samples ranked low and high hold the true quantile when B, the number of samples below it
    (Binomial(n, q)), is at least low's rank and below high's."""
    _, low, high = quantile_interval(np.arange(1, n + 1, dtype=float), q)
    held = sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(int(low), int(high)))
    assert held >= min(0.95, 1 - q**n - (1 - q) ** n) - 1e-12  # [smallest, largest] when too few for 95 %


def test_the_app_takes_its_config_and_refresh_from_what_kvwatch_dashboard_passes(monkeypatch, tmp_path):
    execs = []
    monkeypatch.setattr("os.execv", lambda path, argv: execs.append(argv))
    config = tmp_path / "kvwatch.yaml"
    assert main(["dashboard", "--config", str(config), "--refresh-seconds", "5"]) is None
    passed = execs[0][execs[0].index("--") + 1 :]  # what Streamlit hands the app as its sys.argv[1:]
    assert (data.app_options(passed).config, data.app_options(passed).refresh_seconds) == (config, 5)
    assert data.app_options(["-q", "tests"]).refresh_seconds == 15  # any other command line: defaults


def test_a_refresh_out_of_range_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["dashboard", "--refresh-seconds", "0"])
    assert (
        exit_.value.code == 2
        and capsys.readouterr().err == "kvwatch dashboard: --refresh-seconds must be 1 to 3600\n"
    )
