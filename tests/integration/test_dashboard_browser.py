"""The dashboard the lab serves, in headless Chromium: every page opens, the numbers it shows are what
Prometheus and the store hold at the time the page says, each verdict is its alert's state then (red in
the evaluation the alert fires after `break-affinity`, green again when it resolves after `heal`), and
the probe's cached tokens are what the replicas really cached. Screenshots of every page go to
test-artifacts/."""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from playwright import sync_api

from conftest import behind_a_dead_proxy
from kvwatch.alerts.verdicts import (
    CLUSTER_HIT_RATIO_DROP,
    FIRING,
    LISTENER_SPREAD,
    LOAD_IMBALANCE,
    PENDING,
    PROBES_DOMINATE,
    ROUTE_STICKY,
    ROUTE_WARM_ROUNDS,
    Verdict,
)
from kvwatch.collectors.probe.records import SessionResult
from kvwatch.config.settings import load_config
from kvwatch.core.naming import replica_name
from kvwatch.dashboard import data
from kvwatch.lab.replicas import REPLICA_KINDS
from kvwatch.prometheus import panel_queries, queries
from kvwatch.store.history import Store
from labs import stop_lab_serve
from paths import REPO
from processes import http_get

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts"
EVALUATION_S = 1  # --fast: Prometheus scrapes and evaluates the rules every second
WAIT_S = 240  # generous: the machine may be busy with other tests
LAB_PAGE_CACHE_S = REPLICA_KINDS[
    "sim"
].fast_probe_interval_s  # --fast: the lab's pages refresh and cache this long


@pytest.fixture(scope="module")
def started(start_lab):
    """Rules at a tenth of production: the affinity alert keeps firing 12 s after its condition clears.
    Started behind a proxy that refuses everything: the pages show data only if kvwatch's processes
    reach Prometheus, the store and the engines directly, as they must."""
    with behind_a_dead_proxy():
        return start_lab("--replicas", "3", "--flavours", "vllm,sglang", "--users", "2", "--think", "0.2",
                         "--time-scale", "0.2", "--rule-time-scale", "0.1", dashboard=True)  # fmt: skip


@pytest.fixture(scope="module")
def lab(started, page):
    # The dashboard shows what Prometheus held a few seconds ago (dashboard.data.now): wait for data then.
    both = {queries.STICKY_RATIO: 2, queries.WARM_COLD_RATIO: 2, queries.GATEWAY_SPREAD: 2}
    wait_for_data(started, page, both | {queries.CLUSTER_HIT_RATIO: 1})
    return started


def wait_for_data(lab, page, expected: dict[str, int]) -> None:
    """Until each query has as many series as expected (both targets, both logs) at the pages' time,
    and the page's first run has drawn the sidebar the tests navigate by."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        at = data.now()
        if all(len(prometheus(lab, as_asked(q, at), at)) == n for q, n in expected.items()):
            page.wait_for_selector(
                '[data-testid="stSidebarNavLink"]', timeout=(deadline - time.monotonic()) * 1000
            )
            return
        time.sleep(1)
    pytest.fail(f"no data for the Refresh in Prometheus within {WAIT_S} s")


@pytest.fixture(scope="module")
def frozen(lab):
    """The lab with its probes stopped and what the pages had read of the store before expired from
    their cache: the store-backed pages and the test then read the same sessions."""
    stop_lab_serve(lab)
    time.sleep(LAB_PAGE_CACHE_S + 1)
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
def page(browser, started):
    """The dashboard opening before the lab has data: its first run (imports, Chromium's first draw)
    takes place while the lab fixture waits for the data."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(started.status["dashboard"], wait_until="commit")  # it loads on meanwhile
    yield page
    page.close()


def prometheus(lab, query: str, at: float | None = None) -> list[dict]:
    params = {"query": query} | ({"time": at} if at is not None else {})
    answer = http_get(f"{lab.status['prometheus']}/api/v1/query", params=params, timeout=10)
    return answer.json()["data"]["result"]


def held_alerts(lab) -> set[str]:
    held = http_get(f"{lab.status['alertmanager']}/api/v2/alerts", timeout=10).json()
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


# Every Plotly chart and every tile's sparkline has drawn its picture.
CHARTS_DRAWN = """() => [...document.querySelectorAll(
    '[data-testid="stPlotlyChart"], [data-testid="stMetricChart"]'
)].every(chart => chart.querySelector('svg, canvas'))"""


def settle(page, ready: str, name: str) -> str:
    """Wait until the script has run and `ready` (a CSS selector) is drawn, and save a screenshot;
    returns the page's text."""
    try:
        page.wait_for_selector('[data-testid="stApp"][data-test-script-state="notRunning"]', timeout=60_000)
        page.wait_for_selector(ready, timeout=30_000)
        page.wait_for_function(CHARTS_DRAWN, timeout=30_000)  # for the screenshot
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


AFFINITY, ROUND_ROBIN = {"target": "lab-affinity"}, {"target": "lab-round-robin"}
AFFINITY_LOG, ROUND_ROBIN_LOG = (
    {"log": "affinity", "listener": "affinity"},
    {"log": "round_robin", "listener": "round_robin"},
)
# Every tile of the lab's Overview in page order, stickiness and its cost first: label, query, labels of
# its series, and its verdict where an alert judges it (the round-robin route and log are not expected
# sticky).
OVERVIEW_TILES = [
    ("Sessions on one replica", queries.STICKY_RATIO, AFFINITY, ROUTE_STICKY),
    ("Warm / cold TTFT", queries.WARM_COLD_RATIO, AFFINITY, ROUTE_WARM_ROUNDS),
    ("Affinity efficiency", panel_queries.AFFINITY_EFFICIENCY, AFFINITY, None),
    ("Sessions on one replica", queries.STICKY_RATIO, ROUND_ROBIN, None),
    ("Warm / cold TTFT", queries.WARM_COLD_RATIO, ROUND_ROBIN, None),
    ("Affinity efficiency", panel_queries.AFFINITY_EFFICIENCY, ROUND_ROBIN, None),
    ("Real sessions on several replicas", queries.GATEWAY_SPREAD, AFFINITY_LOG, LISTENER_SPREAD),
    ("Moved by a failover", panel_queries.REAL_SESSIONS_SPREAD, {**AFFINITY_LOG, "failover": "true"}, None),
    ("Real sessions on several replicas", queries.GATEWAY_SPREAD, ROUND_ROBIN_LOG, None),
    (
        "Moved by a failover",
        panel_queries.REAL_SESSIONS_SPREAD,
        {**ROUND_ROBIN_LOG, "failover": "true"},
        None,
    ),
    ("Cluster hit ratio", queries.CLUSTER_HIT_RATIO, {}, CLUSTER_HIT_RATIO_DROP),
    ("Real traffic's hit ratio", queries.CLUSTER_REAL_HIT_RATIO, {}, None),
    ("Probes' share of prompt tokens", queries.CLUSTER_PROBE_SHARE, {}, PROBES_DOMINATE),
]


@dataclass(frozen=True)
class Tile:
    label: str
    value: str
    verdict: str  # its words under it


@dataclass(frozen=True)
class Refresh:
    """What a page showed at one refresh: its "As of" time, its tiles and its text."""

    as_of: float
    tiles: list[Tile]
    text: str


def refresh(page) -> Refresh | None:
    """The page as its last run left it; None while a run is drawing it. Read in one go, so that no
    refresh lands in between."""
    found = page.evaluate(
        """() => {
          const app = document.querySelector('[data-testid="stApp"]');
          if (app.dataset.testScriptState !== 'notRunning') return null;
          const tiles = [...document.querySelectorAll('[data-testid="stMetric"]')].map(metric => {
            let box = metric;
            while (box && !box.querySelector('.stMarkdownColoredText')) box = box.parentElement;
            return [metric.querySelector('[data-testid="stMetricLabel"]').innerText.trim(),
                    metric.querySelector('[data-testid="stMetricValue"]').innerText.trim(),
                    box.querySelector('.stMarkdownColoredText').innerText.trim()];
          });
          return {text: document.body.innerText, tiles};
        }"""
    )  # fmt: skip
    if found is None or "As of" not in found["text"]:
        return None
    return Refresh(shown_time(found["text"], "As of"), [Tile(*t) for t in found["tiles"]], found["text"])


def state_of(verdict: Verdict, words: str) -> str:
    """The colour the page gave the verdict, from its words: the alert's name says red or orange, "healthy
    again" blue (the alert still fires, or fired at the page's time, after the signal recovered)."""
    if words.startswith(f"{verdict.alert.name} fires:"):
        return "red"
    if words.startswith("Healthy again"):
        return "blue"
    return "orange" if words.startswith(f"{verdict.alert.name} is pending:") else "green"


def expected_state(lab, verdict: Verdict, at: float, **labels: str) -> str:
    """What Prometheus says of the verdict's series at `at`: the colour the page must show."""
    state = value_of(prometheus(lab, verdict.state, at), **labels)
    return {FIRING: "red", PENDING: "orange"}.get(state, "green")


def test_overview_shows_what_prometheus_holds(lab, page):
    visit(page, lab, "Overview", f'[data-testid="stMetric"] >> nth={len(OVERVIEW_TILES) - 1}', "overview")
    (shown,) = refreshes(page, lambda _: True)
    assert [tile.label for tile in shown.tiles] == [label for label, *_ in OVERVIEW_TILES]
    at = shown.as_of
    for tile, (label, query, labels, verdict) in zip(shown.tiles, OVERVIEW_TILES, strict=True):
        truth = value_of(prometheus(lab, as_asked(query, at), at), **labels)
        assert number(tile.value) == pytest.approx(truth, abs=0.0051), (label, labels)  # to the digits shown
        if verdict:
            judged = {k: v for k, v in labels.items() if k != "failover"}
            assert state_of(verdict, tile.verdict) == expected_state(lab, verdict, at, **judged), (
                label,
                labels,
            )
    assert shown.tiles[0] == Tile("Sessions on one replica", "100%", "Sessions stay on their replica.")
    assert "Local lookups found" in shown.text  # beside the hit ratio, not a second tile like it
    # The lab probes every 5 s: its probes are about 60 % of the prompt tokens, so KVWatchProbesDominate
    # may rightly fire; nothing else does in a healthy lab.
    probes_dominate = "Firing now: KVWatchProbesDominate (warning) on the cluster. See the Alerts page"
    assert "No kvwatch alert is firing." in shown.text or probes_dominate in shown.text


def last_run(lab, target: str, at: float) -> list[SessionResult]:
    """The sessions of the target's last probe run as Prometheus held it at `at`, from the store: the
    newest of the run's size that finished by the time the run did. The pages' `at` is seconds ago
    (data.now), long after the run handed its sessions to the store's writer."""
    age = value_of(prometheus(lab, as_asked(panel_queries.PROBE_LAST_RUN_AGE, at), at), target=target)
    (settings,) = [t for t in load_config(lab.state_dir / "kvwatch.yaml").targets if t.name == target]
    with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
        finished = at - age + 0.001  # the run's end, give or take the rounding of time() - end
        done = [s for s in store.sessions(target=target) if s["finished_at"] <= finished]
        return [store.session(s["id"]) for s in done[: settings.sessions_per_run]]


def test_the_last_run_tiles_are_the_stores_last_run(lab):
    """The tiles read the exporter's last-run gauges (the test above); these are the stored sessions'."""
    at = data.now()
    for labels in (AFFINITY, ROUND_ROBIN):
        run = last_run(lab, labels["target"], at)
        judged = [s.sticky for s in run if s.sticky is not None]
        rounds = [r for s in run for r in s.rounds if r.ok and r.ttft_seconds is not None]
        cold = statistics.median(r.ttft_seconds for r in rounds if r.round == 1)
        warm = statistics.median(r.ttft_seconds for r in rounds if r.round > 1)
        sticky = value_of(prometheus(lab, as_asked(queries.STICKY_RATIO, at), at), **labels)
        warm_cold = value_of(prometheus(lab, as_asked(queries.WARM_COLD_RATIO, at), at), **labels)
        assert judged and sticky == pytest.approx(sum(judged) / len(judged)), (labels, run)
        assert warm_cold == pytest.approx(warm / cold), labels
    assert sticky == 0  # round robin's: the comparison above is not all ones


def refreshes(page, until, timeout: float = WAIT_S) -> list[Refresh]:
    """Every refresh of the Refresh (one per "As of" time) until `until(refresh)`."""
    seen: list[Refresh] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = refresh(page)
        if found and (not seen or found.as_of > seen[-1].as_of):
            seen.append(found)
            if until(found):
                return seen
        time.sleep(0.5)
    pytest.fail(f"the Refresh did not get there within {timeout} s ({len(seen)} refreshes)")


def alert_now(lab, verdict: Verdict, **labels: str) -> dict:
    """The alert as Prometheus holds it now (/api/v1/alerts): its state and activeAt."""
    held = http_get(f"{lab.status['prometheus']}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    (found,) = [a for a in held if a["labels"]["alertname"] == verdict.alert.name
                and labels.items() <= a["labels"].items()]  # fmt: skip
    return found


def unix(stamp: str) -> float:
    """An RFC 3339 time from Prometheus (nanoseconds and all) as unix seconds."""
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", stamp.replace("Z", "+00:00"))).timestamp()


def notified(lab, verdict: Verdict, status: str, since: float, **labels: str) -> dict:
    """The alert as kvwatch's webhook received it, firing (startsAt: when it fired) or resolved (endsAt)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
            for alert in store.alerts(since=since, status=status):
                if alert["alertname"] == verdict.alert.name and labels.items() <= alert["labels"].items():
                    return alert
        time.sleep(1)
    pytest.fail(f"kvwatch's webhook received no {status} {verdict.alert.name} within {WAIT_S} s")


def assert_follows_the_alert(seen: list[Refresh], state, active_at: float, fired_at: float) -> None:
    """Green before the alert went active, orange while pending, red once it fired: each within the
    evaluation it happened in (the page asks at its "As of" time, the rules run every EVALUATION_S)."""
    for shown in seen:
        at, color = shown.as_of, state(shown)
        if color == "red":
            assert at > fired_at - EVALUATION_S, (at, fired_at)
        elif color == "orange":
            assert active_at - EVALUATION_S < at < fired_at, (at, active_at, fired_at)
        else:
            assert at < active_at, (at, active_at)


def test_the_route_verdict_is_red_exactly_while_the_affinity_alert_fires(lab, page):
    verdict = ROUTE_STICKY

    def affinity_route(shown: Refresh) -> str:
        tile = shown.tiles[0]  # lab-affinity's first
        assert tile.label == "Sessions on one replica"
        return state_of(verdict, tile.verdict)

    visit(page, lab, "Overview", '[data-testid="stMetric"]', "overview-healthy")
    refreshes(page, lambda shown: affinity_route(shown) == "green")
    assert lab.cli("fault", "break-affinity").returncode == 0
    try:
        seen = refreshes(page, lambda shown: affinity_route(shown) == "red")
        active_at = unix(alert_now(lab, verdict, target="lab-affinity")["activeAt"])
        settle(page, '[data-testid="stMetric"]', "overview-affinity-broken")
    finally:
        healed = time.time()
        assert lab.cli("heal").returncode == 0
    assert_follows_the_alert(seen, affinity_route, active_at, active_at)  # no `for`: fires when active
    # the banner names every alert firing: break-affinity also moves real sessions that return
    banner = next(line for line in seen[-1].text.splitlines() if line.startswith("Firing now: "))
    assert "KVWatchSessionAffinityBroken (critical) on lab-affinity" in banner, banner

    seen = refreshes(page, lambda shown: affinity_route(shown) == "green")
    resolved_at = notified(lab, verdict, "resolved", healed, target="lab-affinity")["ends_at"]
    for shown in seen:  # red or blue while the alert still fires: it keeps firing a while after the heal
        color = affinity_route(shown)
        assert (color in ("red", "blue")) == (shown.as_of < resolved_at), (shown.as_of, color, resolved_at)
        clears = re.search(r"clears at (\d\d:\d\d:\d\d) UTC", shown.tiles[0].verdict)
        if clears:  # blue, healthy again: the time it said is the time Alertmanager was told it resolved
            said = datetime.strptime(clears.group(1), "%H:%M:%S").time()
            told = datetime.fromtimestamp(resolved_at, UTC)
            gap = abs(datetime.combine(told.date(), said, UTC).timestamp() - resolved_at)
            assert min(gap, 86400 - gap) <= EVALUATION_S + 1, (clears.group(1), told)


def test_replicas_show_what_prometheus_holds(lab, page):
    visit(page, lab, "Cache & replicas", '[data-testid="stMetric"]', "replicas")
    (shown,) = refreshes(page, lambda _: True)
    (tile,) = shown.tiles
    imbalance = value_of(prometheus(lab, queries.CLUSTER_LOAD_IMBALANCE, shown.as_of))
    assert tile.label == "Load imbalance"
    assert number(tile.value) == pytest.approx(imbalance, abs=0.0051)
    verdict = LOAD_IMBALANCE
    assert state_of(verdict, tile.verdict) == expected_state(lab, verdict, shown.as_of)


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
    assert [float(row[column["TTFT (ms)"]]) for row in rows] == pytest.approx(
        [r.ttft_seconds * 1000 for r in stored], abs=0.051
    )
    # The replicas' ground truth: what each of them saw of this session, in order.
    session_id = store.session(picked).session_id
    truth = sorted(
        (record for replica in lab.status["replicas"]
         for record in http_get(f"{replica['url']}/lab/ground-truth", timeout=10).json()["records"]
         if record.get("session_id") == session_id),
        key=lambda record: record["time"],
    )  # fmt: skip
    if store.session(picked).interrupted:
        # Cut by the fixture's SIGTERM: stored with its finished rounds, while the replica may still have
        # served the one in flight.
        assert len(truth) - len(stored) in (0, 1)
        truth = truth[: len(stored)]
    address = {replica["id"]: replica["url"].removeprefix("http://") for replica in lab.status["replicas"]}
    assert [r["cached_tokens"] for r in truth] == [r.cached_tokens for r in stored]
    assert [address[r["replica"]] for r in truth] == [r.backend for r in stored]  # nginx's X-Upstream
    # The page names each backend by the replica's id (its Prometheus target's label) and address.
    assert [row[column["backend"]] for row in rows] == [
        replica_name(address[r["replica"]], r["replica"]) for r in truth
    ]


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


def test_alerts_show_watchdog_as_the_pipelines_heartbeat(lab, page):
    deadline = time.monotonic() + 60  # Prometheus sends its first alerts some 45 s after it starts
    while "Watchdog" not in held_alerts(lab) and time.monotonic() < deadline:
        time.sleep(1)
    text = visit(page, lab, "Alerts", '[data-testid="stAlert"]', "alerts")
    assert "Watchdog" in held_alerts(lab)
    assert "Heartbeat: Alertmanager holds Watchdog, the alert that always fires" in text  # not as an alert
