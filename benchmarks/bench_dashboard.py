"""Seconds to render each dashboard page over a day of history: 64 replicas and two probe routes.

A real Prometheus (the one the lab runs, with kvwatch's rule files) is backfilled with `promtool tsdb
create-blocks-from openmetrics` from 24 h of scrapes every 30 s: 64 vLLM replicas (token and request
counters, cached tokens by source, the TTFT histogram) and kvwatch's exporter with the probe runs of two
routes (2 sessions of 6 rounds every 30 s each); the recording rules are then backfilled from them with
`promtool tsdb create-blocks-from rules`, pass after pass as they read each other. The store holds the
same probe sessions. Each page runs in Streamlit's AppTest over its "1 day" range, the clock set to the
history's end: once first (imports, cold caches), then again with its caches cleared and with them warm.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import httpx
import yaml

from benchmarks.history import DAY, Fleet, backfill_order, exporter_scrapes, probe_runs, write_openmetrics
from kvwatch.core.stats import median
from kvwatch.lab.configs import REPO, RULE_PATTERNS
from kvwatch.lab.process import binary
from kvwatch.prometheus.rules import GATEWAY_RULES, RECORDING_RULES, ROUTER_RULES
from kvwatch.store.history import Store

REPLICAS = 64
SCRAPE_SECONDS = 30
PROBE_INTERVAL_SECONDS = 30
RENDERS = 3
PAGES = sorted((REPO / "dashboard" / "app_pages").glob("*.py"))
LEFT_EMPTY = (
    "Left empty: the alerts' own series (ALERTS: promtool backfills no alerting rule), so the verdicts "
    "come from the signals and nothing fires; Alertmanager and the gateway logs (none configured); "
    "the routers' figures (no router in the fleet)."
)


@contextlib.contextmanager
def prometheus(directory: Path, port: int) -> Iterator[str]:
    """The lab's Prometheus on `directory`/data with kvwatch's rule files and nothing to scrape, until
    it serves; stopped by its PID."""
    config = directory / "prometheus.yml"
    rules = [str(REPO / pattern) for pattern in RULE_PATTERNS]
    config.write_text(yaml.safe_dump({"global": {"evaluation_interval": "30s"}, "rule_files": rules}))
    url = f"http://127.0.0.1:{port}"
    log = directory / "prometheus.log"
    argv = [
        binary("prometheus", "/usr/bin/prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=30d",
    ]
    with log.open("a") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"Prometheus did not serve at {url}; its log ends:\n{tail}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _promtool(*args: str) -> None:
    done = subprocess.run([binary("promtool", "/usr/bin/promtool"), *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"promtool {args[0]} {args[1]} failed: {done.stderr[-2000:]}")


def backfill(directory: Path, port: int, start: float, end: float) -> tuple[int, int]:
    """The day's scrapes, then the recording rules over them; returns (scraped samples, rule passes)."""
    fleet = Fleet(REPLICAS)
    runs = list(probe_runs(fleet.addresses, start, end, PROBE_INTERVAL_SECONDS))
    with Store(directory / "kvwatch.db") as store:
        for _, _, sessions in runs:
            for session in sessions:
                store.add_session(session)
    scrapes = directory / "scrapes.om"
    samples = write_openmetrics(
        scrapes,
        chain(fleet.scrapes(start, end, SCRAPE_SECONDS), exporter_scrapes(runs, end, SCRAPE_SECONDS)),
    )
    _promtool("tsdb", "create-blocks-from", "openmetrics", str(scrapes), str(directory / "data"))
    scrapes.unlink()
    passes = backfill_order((*RECORDING_RULES, *GATEWAY_RULES, *ROUTER_RULES))
    for number, rules in enumerate(passes):
        rule_file, blocks = directory / f"pass-{number}.yml", directory / f"pass-{number}"
        group = {"name": f"pass-{number}", "rules": [_rule(rule) for rule in rules]}
        rule_file.write_text(yaml.safe_dump({"groups": [group]}))
        with prometheus(directory, port) as url:
            _promtool(
                "tsdb", "create-blocks-from", "rules", f"--url={url}", f"--start={start:.0f}",
                f"--end={end:.0f}", f"--eval-interval={SCRAPE_SECONDS}s", f"--output-dir={blocks}",
                str(rule_file),
            )  # fmt: skip
        for block in blocks.iterdir():
            block.rename(directory / "data" / block.name)
    return samples, len(passes)


def _rule(rule) -> dict:
    return {"record": rule.record, "expr": rule.expr, **({"labels": rule.labels} if rule.labels else {})}


def render_times(at: float) -> list[tuple[str, float, float, float, str]]:
    """Per page: first render, median with caches cleared, median warm (seconds), and what it showed
    as errors."""
    import streamlit as st
    from streamlit import logger
    from streamlit.components.v2 import manifest_scanner
    from streamlit.testing.v1 import AppTest

    from kvwatch.dashboard import data

    logger.set_log_level("error")  # AppTest runs pages without a server, and says so at every run
    data.now = lambda: at  # the history ends at `at`
    # AppTest scans every installed distribution for components at each run; a served app does it once
    manifest_scanner.scan_component_manifests = lambda: []
    st.cache_data.clear()

    def render(page: Path) -> tuple[float, AppTest]:
        app = AppTest.from_file(str(page), default_timeout=120)
        app.session_state[f"{page.stem}_range"] = "1 day"
        started = time.perf_counter()
        app.run()
        return time.perf_counter() - started, app

    rows = []
    for page in PAGES:
        first, app = render(page)
        if app.exception:
            raise RuntimeError(f"{page.name} raised: {app.exception[0].message}")
        errors = "; ".join(e.value for e in app.error)
        cold = []
        for _ in range(RENDERS):
            st.cache_data.clear()
            cold.append(render(page)[0])
        warm = [render(page)[0] for _ in range(RENDERS)]
        rows.append((page.stem, first, median(cold), median(warm), errors))
    return rows


def run() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        from kvwatch.dashboard import data

        end, port = data.now(), free_port()
        started = time.perf_counter()
        samples, passes = backfill(directory, port, end - DAY, end)
        backfilled = time.perf_counter() - started
        config = directory / "kvwatch.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "targets": [
                        {"name": "lab-affinity", "base_url": "http://127.0.0.1:9", "model": "m",
                         "route_mode": "affinity"},
                        {"name": "lab-round-robin", "base_url": "http://127.0.0.1:9", "model": "m",
                         "route_mode": "round_robin"},
                    ],
                    "store": {"path": str(directory / "kvwatch.db")},
                    "prometheus": {"url": f"http://127.0.0.1:{port}"},
                }
            )
        )  # fmt: skip
        argv = sys.argv
        sys.argv = [argv[0], "--config", str(config)]
        try:
            with prometheus(directory, port):
                rows = render_times(end)
                load = os.getloadavg()[0]
        finally:
            sys.argv = argv
    lines = [
        f"{samples:,} samples scraped, backfilled with {passes} passes of recording rules in "
        f"{backfilled:.0f} s. {LEFT_EMPTY}",
        "",
        f"Load average over the last minute of renders: {load:.1f} on {os.cpu_count()} cores.",
        "",
        "| page | first render (s) | median, caches cleared (s) | median, warm (s) | errors shown |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {p} | {a:.2f} | {b:.2f} | {c:.2f} | {e or '-'} |" for p, a, b, c, e in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
