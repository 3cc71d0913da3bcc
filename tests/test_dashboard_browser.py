"""The dashboard the lab serves, in headless Chromium: every page opens, and the numbers it shows are
what Prometheus and the store hold at the time the page says, and the probe's cached tokens what the
replicas really cached. Screenshots of every page go to test-artifacts/."""

from __future__ import annotations

import os
import re
import signal
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from collectors import queries
from collectors.store import Store
from conftest import REPO
from dashboard import data

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
ROUTE_QUERIES = (queries.PROBE_STICKY_SHARE, queries.WARM_COLD_TTFT_RATIO, queries.AFFINITY_EFFICIENCY)
ARTIFACTS = REPO / "test-artifacts"
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency")
if not CHROMIUM.exists():
    pytest.skip("Debian's chromium is not installed (make bootstrap installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def lab(start_lab):
    lab = start_lab("--replicas", "3", "--flavours", "vllm,sglang", "--users", "2", "--think", "0.2",
                    "--time-scale", "0.2")  # fmt: skip
    # The dashboard shows what Prometheus held a few seconds ago (dashboard.data.now): wait for data then.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        at = data.now()
        per_route = [prometheus(lab, as_asked(query, at), at) for query in ROUTE_QUERIES[:2]]
        if all(len(found) == 2 for found in per_route) and prometheus(lab, queries.CLUSTER_HIT_RATIO, at):
            return lab  # both targets
        time.sleep(1)
    pytest.fail("no probe results in Prometheus within 60 s")


@pytest.fixture(scope="module")
def frozen(lab):
    """The lab with its probes stopped once the dashboard has refreshed after: the store-backed pages
    and the test then read the same sessions."""
    os.kill(lab.status["processes"]["serve"], signal.SIGTERM)
    time.sleep(data.REFRESH_SECONDS - time.time() % data.REFRESH_SECONDS + 1)
    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        yield lab, store


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    yield page
    page.close()


def prometheus(lab, query: str, at: float | None = None) -> list[dict]:
    params = {"query": query} | ({"time": at} if at is not None else {})
    answer = httpx.get(f"{lab.status['prometheus']}/api/v1/query", params=params, timeout=10)
    return answer.json()["data"]["result"]


def held_alerts(lab) -> set[str]:
    held = httpx.get(f"{lab.status['alertmanager']}/api/v2/alerts", timeout=10).json()
    return {alert["labels"]["alertname"] for alert in held}


def as_asked(query: str, at: float) -> str:
    """The query as the pages ask it at `at` over their default range: an hour, a point per refresh."""
    return data.filled(query, data.Span(at - 3600, at, data.REFRESH_SECONDS))


def visit(page, lab, title: str, ready: str, name: str) -> str:
    """Open a page from the sidebar (the app stays loaded) and `settle` it."""
    if not page.url.startswith(lab.status["dashboard"]):
        page.goto(lab.status["dashboard"])
    page.get_by_role("link", name=title, exact=True).click()
    page.get_by_role("heading", level=1, name=title, exact=True).wait_for(timeout=30_000)
    return settle(page, ready, name)


def settle(page, ready: str, name: str) -> str:
    """Wait until the script has run and `ready` (a CSS selector) is drawn, and save a screenshot;
    returns the page's text."""
    try:
        page.wait_for_selector('[data-testid="stApp"][data-test-script-state="notRunning"]', timeout=60_000)
        page.wait_for_selector(ready, timeout=30_000)
        page.wait_for_timeout(1000)  # let the charts draw for the screenshot
    finally:
        # The page scrolls inside the app, not the document: grow the window to show all of it.
        height = page.evaluate("document.querySelector('[data-testid=stMain]')?.scrollHeight")
        page.set_viewport_size({"width": 1400, "height": height or 1000})
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=ARTIFACTS / f"dashboard-{name}.png")
    return page.inner_text("body")


def shown_time(text: str, before: str) -> float:
    """The UTC time the page names after `before`, e.g. "As of 2026-11-29 18:44:15 UTC"."""
    stamp = re.search(rf"{before} (\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d) UTC", text).group(1)
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()


def tiles(page) -> list[tuple[str, str]]:
    """(label, value) of every metric tile, in page order."""
    return [
        (m.locator('[data-testid="stMetricLabel"]').inner_text().strip(),
         m.locator('[data-testid="stMetricValue"]').inner_text().strip())
        for m in page.locator('[data-testid="stMetric"]').all()
    ]  # fmt: skip


def number(shown: str) -> float | None:
    """A tile's value as a number: "87%" is 0.87, "0.29×" 0.29, "no data" None."""
    if shown == "no data":
        return None
    value = float(shown.rstrip("%×"))
    return value / 100 if shown.endswith("%") else value


def table(page, index: int = 0) -> list[list[str]]:
    """The cells of an st.table, header row first."""
    rows = page.locator('[data-testid="stTable"]').nth(index).locator("tr").all()
    return [[cell.inner_text().strip() for cell in row.locator("th, td").all()] for row in rows]


def median_ms(rounds: list[dict], target: str, number: int) -> float:
    ttfts = [
        r["ttft_seconds"]
        for r in rounds
        if (r["target"], r["round"], r["error_kind"]) == (target, number, None)
    ]
    return statistics.median(ttfts) * 1000


def value_of(result: list[dict], **labels: str) -> float | None:
    """The value of the one series with these labels; None when there is none ("no data")."""
    found = [float(s["value"][1]) for s in result if all(s["metric"].get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, result
    return found[0] if found else None


def test_overview_shows_what_prometheus_holds(lab, page):
    text = visit(page, lab, "Overview", '[data-testid="stMetric"] >> nth=7', "overview")
    at = shown_time(text, "As of")
    route = ("Sessions on one replica", "Warm / cold TTFT", "Affinity efficiency")
    expected = {
        ("Cluster hit ratio", None): queries.CLUSTER_HIT_RATIO,
        ("Firing alerts", None): queries.FIRING_ALERTS,
        **{(label, "lab-affinity"): query for label, query in zip(route, ROUTE_QUERIES, strict=True)},
        **{(label, "lab-round-robin"): query for label, query in zip(route, ROUTE_QUERIES, strict=True)},
    }
    shown = tiles(page)
    assert [label for label, _ in shown] == [label for label, _ in expected]
    for (label, value), ((_, target), query) in zip(shown, expected.items(), strict=True):
        truth = value_of(prometheus(lab, as_asked(query, at), at), **({"target": target} if target else {}))
        assert number(value) == pytest.approx(truth, abs=0.0051), (label, target)  # to the digits shown
    assert shown[2] == ("Sessions on one replica", "100%")  # through the affinity gateway


def test_replicas_show_what_prometheus_holds(lab, page):
    text = visit(page, lab, "Cache & replicas", '[data-testid="stMetric"]', "replicas")
    imbalance = value_of(prometheus(lab, queries.CLUSTER_LOAD_IMBALANCE, shown_time(text, "As of")))
    assert tiles(page)[0][0] == "Load imbalance"
    assert number(tiles(page)[0][1]) == pytest.approx(imbalance, abs=0.0051)


def test_per_round_medians_are_the_stores(frozen, page):
    lab, store = frozen
    text = visit(page, lab, "Per-round TTFT", '[data-testid="stTable"]', "per-round")
    rounds = store.rounds(since=shown_time(text, "Probe sessions since"))
    header, *rows = table(page)
    assert header == ["round", "lab-affinity", "lab-round-robin", "lab-affinity / lab-round-robin"]
    for row in rows:
        for target, shown_ms in zip(header[1:3], row[1:3], strict=True):
            assert float(shown_ms) == pytest.approx(median_ms(rounds, target, int(row[0])), abs=0.051)


def test_a_sessions_rounds_are_what_the_replicas_served(frozen, page):
    lab, store = frozen
    visit(page, lab, "Sessions", '[data-testid="stTable"]', "sessions")
    picked = int(re.search(r"#(\d+)", page.get_by_role("combobox", name="Session").input_value()).group(1))
    assert picked == store.sessions(target="lab-affinity", limit=1)[0]["id"]  # the newest, by default
    stored = store.session(picked).rounds
    header, *rows = table(page)
    column = {name: index for index, name in enumerate(header)}
    assert [int(row[column["cached tokens"]]) for row in rows] == [r.cached_tokens for r in stored]
    assert [row[column["backend"]] for row in rows] == [r.backend for r in stored]
    assert [float(row[column["TTFT (ms)"]]) for row in rows] == pytest.approx(
        [r.ttft_seconds * 1000 for r in stored], abs=0.051
    )
    # The replicas' ground truth: what each of them saw of this session, in order.
    session_id = store.session(picked).session_id
    truth = sorted(
        (record for replica in lab.status["replicas"]
         for record in httpx.get(f"{replica['url']}/lab/ground-truth", timeout=10).json()["records"]
         if record.get("session_id") == session_id),
        key=lambda record: record["time"],
    )  # fmt: skip
    address = {replica["id"]: replica["url"].removeprefix("http://") for replica in lab.status["replicas"]}
    assert [r["cached_tokens"] for r in truth] == [r.cached_tokens for r in stored]
    assert [address[r["replica"]] for r in truth] == [r.backend for r in stored]  # nginx's X-Upstream


def test_experiment_says_there_is_no_report_yet(lab, page):
    text = visit(page, lab, "A/B experiment", '[data-testid="stAlert"]', "experiment")
    assert "No experiment report in .kvwatch/experiment yet" in text


def test_the_doctor_finds_nothing_wrong_with_the_healthy_lab(lab, page):
    visit(page, lab, "Doctor", '[data-testid="stButton"]', "doctor")
    page.get_by_role("button", name="Run the doctor").click()
    text = settle(page, '[data-testid="stTable"]', "doctor")
    header, *rows = table(page)
    assert header == ["status", "name", "evidence", "fix"] and rows
    assert "No cause found" in text, text


def test_alerts_show_watchdog_with_its_runbook(lab, page):
    deadline = time.monotonic() + 60  # Prometheus sends its first alerts some 45 s after it starts
    while "Watchdog" not in held_alerts(lab) and time.monotonic() < deadline:
        time.sleep(1)
    text = visit(page, lab, "Alerts", '[data-testid="stExpander"]', "alerts")
    assert "Watchdog" in held_alerts(lab) and "Runbook: Watchdog" in text
