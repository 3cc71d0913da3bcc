"""A new user points kvwatch at "their" cluster: the lab's gateway and replicas stand in for it (the lab's
own Prometheus is only the Prometheus that already scrapes their engines; its `kvwatch serve` is
stopped). `kvwatch init` looks at the gateway and writes the config and the pieces; a fresh Prometheus and
Alertmanager run from those pieces, `kvwatch serve` from the config; the Overview judges the target, and
`break-affinity` reaches Alertmanager, kvwatch's webhook and the page.

The rules run at the lab's test time scale (--rule-time-scale 0.1: every window, `for` and
`keep_firing_for` at a tenth), Prometheus scrapes and evaluates every second, probes run every 5 s.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import streamlit as st
import yaml

from gateway_checks import heal_if_faulted, upstreams
from kvwatch.alerts import verdicts
from kvwatch.dashboard import data, ui
from kvwatch.lab.configs import scale_durations
from kvwatch.onboarding import writers
from kvwatch.prometheus import queries
from labs import Lab, stop_lab_serve
from processes import free_port, http_get, kvwatch, poll, stop, wait_http

pytestmark = pytest.mark.integration

RULE_TIME_SCALE = 0.1
WAIT_S = 240  # generous: the machine may be busy with other tests
LAB_OPTIONS = ("--replicas", "3", "--users", "2", "--think", "0.2", "--time-scale", "0.2",
               "--rule-time-scale", str(RULE_TIME_SCALE), "--no-probes")  # fmt: skip
TARGET = "their-chat"


@pytest.fixture(scope="module")
def their_cluster(start_lab) -> Iterator[Lab]:
    lab = start_lab(*LAB_OPTIONS)
    stop_lab_serve(lab)  # the lab's kvwatch is not the user's
    # Their Prometheus has scraped every engine, as one that has run for a while has.
    query = f"{lab.status['prometheus']}/api/v1/query"

    def every_engine_scraped() -> bool:
        scraped = http_get(query, params={"query": "up{replica!=''} == 1"}).json()["data"]["result"]
        return len(scraped) == len(lab.status["replicas"])

    poll(every_engine_scraped, "the lab's Prometheus scraping every replica", WAIT_S)
    yield lab
    heal_if_faulted(lab, [])


def run_init(lab: Lab, directory: Path, *options: str) -> subprocess.CompletedProcess:
    return kvwatch("init", lab.affinity, "--dir", str(directory), "--name", TARGET, *options)


def replica_addresses(lab: Lab) -> dict[str, str]:
    return {r["id"]: r["url"].removeprefix("http://") for r in lab.status["replicas"]}


def block_size_of(replica_url: str) -> str:
    """The block size an engine itself reports (the ground truth of what init learned)."""
    (line,) = [
        x
        for x in http_get(f"{replica_url}/metrics").text.splitlines()
        if x.startswith("vllm:cache_config_info")
    ]
    return re.search(r'block_size="(\d+)"', line).group(1)


def test_init_learns_the_cluster_and_writes_pieces_its_tools_accept(their_cluster, tmp_path):
    lab, directory = their_cluster, tmp_path / "setup"
    result = run_init(lab, directory, "--prometheus", lab.status["prometheus"], "--listen", "127.0.0.1:9464")
    assert result.returncode == 0, result.stderr
    engines = ", ".join(f"{rid} ({address})" for rid, address in sorted(replica_addresses(lab).items()))
    block = block_size_of(lab.status["replicas"][0]["url"])
    for line in (
        f"models: {lab.status['model']} (using {lab.status['model']})",
        "session id: X-Session-Id echoed unchanged",
        "replica identity: X-Upstream (headers convention)",
        f"engines in Prometheus: {engines}",
        f"KV block: {block} tokens (vllm:cache_config_info in Prometheus at {lab.status['prometheus']})",
    ):
        assert line in result.stdout, result.stdout
    assert kvwatch("config", "check", str(directory / "kvwatch.yaml")).returncode == 0
    promtool = subprocess.run([shutil.which("promtool"), "check", "config", directory / "prometheus.yml"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr
    assert all(f"rules/{name}" in promtool.stdout for name in writers.rule_files()), promtool.stdout
    amtool = subprocess.run([shutil.which("amtool"), "check-config", str(directory / "alertmanager.yml")],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert amtool.returncode == 0, amtool.stdout + amtool.stderr

    written = {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    again = run_init(lab, directory)
    assert again.returncode == 1 and "would overwrite" in again.stderr and "--force" in again.stderr
    assert {p: p.read_bytes() for p in directory.rglob("*") if p.is_file()} == written


@contextlib.contextmanager
def started(name: str, argv: list[str], ready_url: str, logs: Path) -> Iterator[subprocess.Popen]:
    """A real process, ready at `ready_url` (else the test fails with its log), stopped by PID."""
    log = logs / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(ready_url, process, log, timeout=60)
        yield process
    finally:
        stop(process)


def at_test_time_scale(directory: Path) -> None:
    """The lab's test time scale on the pieces init wrote: 1 s scrapes and evaluations, rules at a tenth."""
    config_path = directory / writers.PROMETHEUS
    config = yaml.safe_load(config_path.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config_path.write_text(yaml.safe_dump(config))
    for rules in (directory / writers.RULES).glob("*.yml"):
        rules.write_text(scale_durations(rules.read_text(), RULE_TIME_SCALE))


def sticky_verdict(config: Path, monkeypatch) -> tuple[ui.Verdict, float | None]:
    """What the Overview shows for the target now: its sticky tile's verdict and value (data layer)."""
    monkeypatch.setattr(sys, "argv", ["dashboard", "--config", str(config)])
    st.cache_data.clear()
    over = data.span(600)
    states = data.instant(verdicts.ROUTE_STICKY.state, over)
    points = data.series(queries.STICKY_RATIO, over)
    assert not states.error and not points.error, (states.error, points.error)
    verdict = ui.judge(verdicts.ROUTE_STICKY, states.value, "Sessions stay on their replica.", target=TARGET)
    now = ui.matching(points.value, target=TARGET)
    now = now[now["time"] == now["time"].max()]["value"] if not now.empty else now
    return verdict, (float(now.iloc[0]) if len(now) else None)


def firing_at_alertmanager(alertmanager: str) -> list[dict]:
    held = http_get(f"{alertmanager}/api/v2/alerts", params={"active": "true"}, timeout=10).json()
    return [a for a in held if a["labels"].get("alertname") == "KVWatchSessionAffinityBroken"
            and a["labels"].get("target") == TARGET]  # fmt: skip


def test_a_new_user_watches_their_cluster_from_what_init_wrote(their_cluster, tmp_path, monkeypatch):
    lab, directory = their_cluster, tmp_path / "setup"
    prometheus, alertmanager = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    listen = f"127.0.0.1:{free_port()}"
    engines = [option for address in replica_addresses(lab).values() for option in ("--engine", address)]
    result = run_init(lab, directory, "--prometheus", prometheus, "--alertmanager", alertmanager,
                      "--listen", listen, "--interval", "5", *engines)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        "could not be asked" in result.stdout
    )  # their fresh Prometheus is not running yet: said, not hidden
    at_test_time_scale(directory)
    config = directory / writers.CONFIG
    resend = f"--rules.alert.resend-delay={round(60 * RULE_TIME_SCALE)}s"
    with (
        started("prometheus", [shutil.which("prometheus"), f"--config.file={directory / writers.PROMETHEUS}",
                               f"--storage.tsdb.path={tmp_path / 'prometheus-data'}", resend,
                               f"--web.listen-address={prometheus.removeprefix('http://')}"],
                f"{prometheus}/-/ready", tmp_path),
        started("alertmanager", [shutil.which("prometheus-alertmanager"),
                                 f"--config.file={directory / writers.ALERTMANAGER}",
                                 f"--storage.path={tmp_path / 'alertmanager-data'}",
                                 "--cluster.listen-address=",
                                 f"--web.listen-address={alertmanager.removeprefix('http://')}"],
                f"{alertmanager}/-/ready", tmp_path),
        started("serve", [sys.executable, "-m", "kvwatch.cli.main", "serve", "--config", str(config)],
                f"http://{listen}/-/healthy", tmp_path),
    ):  # fmt: skip
        # Every replica a scrape target with its replica id, and the Overview judging the target: green,
        # as the lab's affinity gateway keeps every session on one replica.
        def engines_up() -> dict[str, str]:
            targets = http_get(f"{prometheus}/api/v1/targets").json()["data"]["activeTargets"]
            engines = [t for t in targets if t["labels"]["job"] == "llm-engines" and t["health"] == "up"]
            return {t["labels"]["instance"]: t["labels"]["replica"] for t in engines}

        scraped = poll(
            lambda: len(engines_up()) == len(lab.status["replicas"]) and engines_up(),
            "every engine up",
            WAIT_S,
        )
        assert set(scraped) == set(replica_addresses(lab).values()) and len(set(scraped.values())) == len(
            scraped
        )
        assert all(len(set(rounds)) == 1 for rounds in upstreams(lab.affinity, ["a", "b", "c"]).values())
        verdict, value = poll(lambda: (v := sticky_verdict(config, monkeypatch))[0].color == "green" and v,
                              "the Overview judging the target healthy", WAIT_S)  # fmt: skip
        assert value == 1.0

        since = time.time()
        assert lab.cli("fault", "break-affinity").returncode == 0
        (alert,) = poll(
            lambda: firing_at_alertmanager(alertmanager),
            "KVWatchSessionAffinityBroken at Alertmanager",
            WAIT_S,
        )
        assert alert["labels"]["severity"] == "critical"

        def on_the_alerts_page() -> bool:
            st.cache_data.clear()
            received = data.received_alerts(since)
            assert not received.error, received.error
            frame = received.value
            return not frame.empty and bool(
                ((frame["alertname"] == "KVWatchSessionAffinityBroken") & (frame["target"] == TARGET)).any()
            )

        poll(on_the_alerts_page, "the alert stored by kvwatch's webhook (the token was accepted)", WAIT_S)
        verdict, value = poll(lambda: (v := sticky_verdict(config, monkeypatch))[0].color == "red" and v,
                              "the Overview's verdict turning red", WAIT_S)  # fmt: skip
        assert "KVWatchSessionAffinityBroken fires" in verdict.text and value < 0.5
    assert lab.cli("heal").returncode == 0
