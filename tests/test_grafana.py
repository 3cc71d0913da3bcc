"""The Grafana boards: generated from collectors/queries.py and committed up to date, linted the way
Grafana's dashboard-linter would (it cannot be installed here), and every panel's PromQL proven against
the lab's real Prometheus, before and after the gateway's session affinity breaks: the verdict panels
turn to the alert's state, and real sessions spread."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from operator import not_
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from collectors import grafana, queries
from collectors.scheduler import GATEWAY_POLL_SECONDS
from conftest import REPO, http_get

PROVISIONED = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
IMPORTED = sorted((REPO / "grafana" / "import").glob("*.json"))
PROVISIONING = REPO / "grafana" / "provisioning"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(board: dict) -> list[dict]:
    return [panel for panel in board["panels"] if panel["type"] != "row"]


def panel_queries(board: dict) -> list[tuple[str, str]]:
    return [(panel["title"], t["expr"]) for panel in panels(board) for t in panel["targets"]]


def every_query() -> dict[str, str]:
    """Each distinct panel query of the provisioned boards, with a panel title that shows it."""
    return {expr: title for path in PROVISIONED for title, expr in panel_queries(load(path))}


def filled(expr: str) -> str:
    return queries.fill_variables(expr, window="5m", time_range="1h")


def test_committed_boards_are_exactly_the_generated_ones():
    generated = grafana.dashboard_files()
    committed = {str(path.relative_to(REPO)) for path in PROVISIONED + IMPORTED}
    assert committed == set(generated), "boards not produced by collectors/grafana.py, or missing"
    for relative, text in generated.items():
        assert (REPO / relative).read_text() == text, f"{relative} is stale: run `make generate`"


@pytest.mark.parametrize("path", PROVISIONED + IMPORTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_board_structure(path: Path):
    board = load(path)
    assert board["id"] is None and board["uid"] == grafana.uid(path.name) and 8 <= len(board["uid"]) <= 40
    assert board["schemaVersion"] == grafana.SCHEMA_VERSION and board["title"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"} and pos["w"] > 0 and pos["h"] > 0, panel["title"]
        assert pos["x"] + pos["w"] <= grafana.GRID_WIDTH, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[x, y]}"
                cells[x, y] = panel["title"]


def test_uids_and_titles_are_unique_across_boards():
    boards = [load(path) for path in PROVISIONED]
    assert len({b["uid"] for b in boards}) == len({b["title"] for b in boards}) == len(boards)


def datasource_refs(node) -> list:
    """Every `datasource` value anywhere in the board."""
    if isinstance(node, dict):
        found = [node["datasource"]] if "datasource" in node else []
        return found + [ref for value in node.values() for ref in datasource_refs(value)]
    if isinstance(node, list):
        return [ref for item in node for ref in datasource_refs(item)]
    return []


@pytest.mark.parametrize("path", PROVISIONED + IMPORTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_panel_and_query_uses_the_datasource_variable(path: Path):
    board = load(path)
    variables = board["templating"]["list"]
    (source,) = [v for v in variables if v["type"] == "datasource"]
    assert (source["name"], source["label"], source["query"]) == ("datasource", "Data source", "prometheus")
    for panel in panels(board):
        assert panel["datasource"] == grafana.DATASOURCE, panel["title"]
        assert panel["targets"] and all(t["datasource"] == grafana.DATASOURCE for t in panel["targets"])
    builtin = {"type": "grafana", "uid": "-- Grafana --"}  # the built-in annotations, in every board
    hard_coded = [ref for ref in datasource_refs(board) if ref not in (grafana.DATASOURCE, builtin)]
    assert not hard_coded, f"hard-coded data sources: {hard_coded}"
    for variable in variables:
        if variable["type"] == "query":
            assert variable["refresh"] == 2, f"{variable['name']} must reload on time-range change"


VERDICT_STATES = {verdict.state: verdict for verdict in queries.VERDICTS}


@pytest.mark.parametrize("path", PROVISIONED, ids=lambda p: p.name)
def test_rate_windows_counters_units_and_descriptions(path: Path):
    board = load(path)
    for title, expr in panel_queries(board):
        if expr in VERDICT_STATES:
            continue  # the alert's own expression, with its own windows (below)
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window in ("$__rate_interval", "$__range"), f"{title}: fixed window [{window}]"
        for counter in re.findall(r"\b\w+_total\b", expr):
            assert re.search(rf"\brate\({counter}\{{", expr), f"{title}: {counter} outside rate()"
    for panel in panels(board):
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults["unit"] and defaults["noValue"], panel["title"]
        assert "Good:" in panel["description"] and "Bad:" in panel["description"], panel["title"]


def test_panels_on_recording_rules_say_their_window_is_fixed():
    recorded = {rule.record for rule in queries.WINDOWED_RULES}
    for path in PROVISIONED:
        for panel in panels(load(path)):
            reads_a_rule = any(name in t["expr"] for t in panel["targets"] for name in recorded)
            assert reads_a_rule == (grafana.FIXED_WINDOW in panel["description"]), panel["title"]


def test_every_panel_query_is_a_named_dashboard_query():
    named = set(VERDICT_STATES)
    for name, value in vars(queries).items():
        values = value.values() if isinstance(value, dict) else [value]
        named |= {v for v in values if name.isupper() and isinstance(v, str)}
    for expr, title in every_query().items():
        assert expr in named, f"{title}: PromQL typed in the board instead of collectors/queries.py"


def test_every_verdict_is_shown_as_its_alerts_state():
    """One stat per verdict on the overview, its query the alert's own, coloured by the alert's state."""
    board = load(REPO / "grafana" / "dashboards" / grafana.OVERVIEW)
    verdicts = [p for p in panels(board) if p["type"] == "stat" and p["targets"][0]["expr"] in VERDICT_STATES]
    assert sorted(p["targets"][0]["expr"] for p in verdicts) == sorted(VERDICT_STATES)
    for panel in verdicts:
        verdict = VERDICT_STATES[panel["targets"][0]["expr"]]
        assert panel["links"] == [grafana.runbook_link(verdict.alert.name)], panel["title"]
        assert "the alert's own expression" in panel["description"], panel["title"]
        (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
        words = {int(value): (shown["text"], shown["color"]) for value, shown in mapping["options"].items()}
        assert words == {queries.OK: ("OK", "green"), queries.PENDING: ("pending", "orange"),
                         queries.FIRING: ("firing", "red")}  # fmt: skip


def test_every_board_marks_the_kvwatch_alerts():
    for path in PROVISIONED:
        marks = [a for a in load(path)["annotations"]["list"] if a.get("expr")]
        assert [(a["expr"], a["datasource"]) for a in marks] == [
            (queries.FIRING_ALERTS_BY_NAME, grafana.DATASOURCE)
        ], path.name


def github_anchors(markdown: str) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-") for heading in headings}


def test_runbook_links_point_at_runbook_sections():
    anchors = github_anchors((REPO / queries.RUNBOOK).read_text())
    links = [link for path in PROVISIONED for panel in panels(load(path)) for link in panel["links"]]
    assert links
    for link in links:
        path, anchor = link["url"].split("#")
        assert path == queries.RUNBOOK and anchor in anchors, link


def test_the_import_variant_is_the_provisioned_board_plus_inputs():
    for provisioned, imported in zip(PROVISIONED, IMPORTED, strict=True):
        assert "__inputs" not in provisioned.read_text() and "${DS_" not in provisioned.read_text()
        # Grafana's Import writes the chosen data source's uid wherever ${DS_PROMETHEUS} stands.
        variant = json.loads(imported.read_text().replace("${DS_PROMETHEUS}", "chosen-uid"))
        (needed,) = variant.pop("__inputs")
        assert (needed["name"], needed["type"], needed["pluginId"]) == (
            "DS_PROMETHEUS",
            "datasource",
            "prometheus",
        )
        assert {r["id"] for r in variant.pop("__requires")} >= {"grafana", "prometheus"}
        source = variant["templating"]["list"][0]
        assert source["current"]["value"] == "chosen-uid"
        source["current"] = {}
        assert variant == load(provisioned)


def test_every_panel_query_is_valid_promql(tmp_path: Path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make bootstrap` installs Debian's prometheus package"
    rules = [
        {"record": f"kvwatch_dashboard:check_{i}", "expr": filled(e)} for i, e in enumerate(every_query())
    ]
    assert not [rule["expr"] for rule in rules if "$" in rule["expr"]], (
        "a variable fill_variables does not set"
    )
    check = tmp_path / "dashboard-queries.yml"
    check.write_text(yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(check)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_provisioning_files():
    (datasource,) = yaml.safe_load((PROVISIONING / "datasources" / "kvwatch.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["jsonData"]["timeInterval"]
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "kvwatch.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


# --- against the lab --------------------------------------------------------------------------------

# What $__rate_interval stands for: short, so that a fault shows within the test's time budget (the lab
# probes every 5 s and scrapes every second). Panels on recording rules keep the rules' 2m window.
WINDOW = "30s"
AFFINITY_TARGET = "lab-affinity"
AFFINITY_LISTENER = {"log": "affinity", "listener": "affinity"}
# The lab runs no router: tests/test_router_prediction.py proves these panels against a replayed one.
ROUTER_ONLY = {
    queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO,
    queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
    queries.INSTANCE_ROUTER_PIN_KEPT,
    queries.ROUTER_PREDICTION_MISS.state,
}


def instant(prometheus: str, expr: str) -> list[dict]:
    expr = queries.fill_variables(expr, window=WINDOW, time_range="5m")
    answer = http_get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def value_for(prometheus: str, expr: str, **labels: str) -> float:
    """The query's value for the series with these labels; NaN while it has none."""
    found = [r for r in instant(prometheus, expr) if labels.items() <= r["metric"].items()]
    return float(found[0]["value"][1]) if found else math.nan


def affinity_value(prometheus: str, expr: str) -> float:
    """The query's value for the affinity route; NaN while it has none."""
    return value_for(prometheus, expr, target=AFFINITY_TARGET)


def real_spread(prometheus: str) -> float:
    """The share of real sessions through the affinity listener spread over replicas with no failover."""
    return value_for(prometheus, queries.REAL_SESSIONS_SPREAD, **AFFINITY_LISTENER, failover="false")


def logged_sessions(lab, listener: str, until: float) -> tuple[int, int]:
    """The gateway log's own sessions as of `until`: those with two or more requests, and those of them
    served by more than one upstream. The lab is younger than the spread window, so every request
    counts; this test fails no replica over."""
    upstreams: dict[str, list[str]] = {}
    for line in lab.access_log(listener):
        if line["msec"] <= until and ":" in line["upstream_addr"]:  # served by an upstream
            assert ", " not in line["upstream_addr"], line  # no failover
            upstreams.setdefault(line["session_id"], []).append(line["upstream_addr"])
    returning = [served for served in upstreams.values() if len(served) > 1]
    return len(returning), sum(len(set(served)) > 1 for served in returning)


def exported_poll(lab, log: str) -> tuple[float, int, int]:
    """The exporter's latest poll of the gateway log, once a new one has been taken: its time, its
    sessions with two or more requests, and those of them spread with no failover."""

    def snapshot() -> tuple[float, int, int]:
        found = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(http_get(f"{lab.status['exporter']}/metrics").text)
            for s in family.samples
        }
        listener = {"log": log, "listener": log}
        return (
            found["kvwatch_gateway_log_last_poll_timestamp_seconds", (("log", log),)],
            found["kvwatch_gateway_returning_sessions", tuple(sorted(listener.items()))],
            found[
                "kvwatch_gateway_session_spread_sessions",
                tuple(sorted({**listener, "failover": "false"}.items())),
            ],
        )

    first = snapshot()
    return poll(snapshot, lambda now: now[0] > first[0], GATEWAY_POLL_SECONDS + 5)


def cluster_hit_ratio(prometheus: str) -> float:
    found = instant(prometheus, queries.CLUSTER_HIT_RATIO)
    return float(found[0]["value"][1]) if found else math.nan


def poll(probe, done, timeout: float):
    """Call `probe` every second until `done(value)` or `timeout` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while not done(value := probe()) and time.monotonic() < deadline:
        time.sleep(1)
    return value


def settled(changes: list[float]) -> bool:
    """The hit ratio moved less than 0.01 in the last 10 s (see below)."""
    return bool(changes) and abs(changes[0]) < 0.01


@pytest.mark.integration
def test_panels_show_data_and_follow_a_broken_affinity(start_lab):
    lab = start_lab("--replicas", "4", "--flavours", "vllm,sglang", "--users", "4", "--think", "0.2",
                    "--time-scale", "0.1")  # fmt: skip
    prometheus = lab.status["prometheus"]
    # Healthy: every panel shows data, except the firing alerts, which are empty when all is well, and
    # the routers'.
    unexpected = {queries.FIRING_ALERTS_BY_NAME, *ROUTER_ONLY}
    expected = {expr: title for expr, title in every_query().items() if expr not in unexpected}
    empty = poll(
        lambda: [title for expr, title in expected.items() if not instant(prometheus, expr)], not_, 60
    )
    assert not empty, f"panels without data: {empty}"
    sticky, switches = queries.PROBE_STICKY_SHARE, queries.PROBE_BACKEND_SWITCHES_PER_SESSION
    # The round-robin route's first run may land before the affinity route's: wait for the latter too.
    healthy_sticky = poll(lambda: affinity_value(prometheus, sticky), lambda v: not math.isnan(v), 60)
    assert healthy_sticky == 1 and affinity_value(prometheus, switches) == 0
    assert affinity_value(prometheus, queries.ROUTE_STICKY.state) == queries.OK
    efficiency = affinity_value(prometheus, queries.AFFINITY_EFFICIENCY)
    healthy_spread = real_spread(prometheus)
    assert healthy_spread == 0, "real sessions spread while affinity holds"
    # The hit ratio's recording rule averages 2 minutes, which at first still hold the cold start: let it
    # settle, or a fall after the fault could hide in the warm-up.
    change = f"{queries.CLUSTER_HIT_RATIO} - {queries.CLUSTER_HIT_RATIO} offset 10s"
    changes = poll(lambda: [float(r["value"][1]) for r in instant(prometheus, change)], settled, 60)
    assert settled(changes), f"the cluster hit ratio does not settle: {changes}"
    hit_ratio = cluster_hit_ratio(prometheus)

    assert lab.cli("fault", "break-affinity").returncode == 0
    try:
        value = poll(lambda: affinity_value(prometheus, sticky), lambda v: v < 1, 30)
        assert value < 1, f"the affinity route stays sticky: {value}"
        value = poll(lambda: affinity_value(prometheus, switches), lambda v: v > 0, 10)
        assert value > 0, f"no backend switches on the affinity route: {value}"
        assert affinity_value(prometheus, queries.AFFINITY_EFFICIENCY) < efficiency
        firing = poll(lambda: instant(prometheus, queries.FIRING_ALERTS_BY_NAME), bool, 15)
        assert "KVWatchSessionAffinityBroken" in {alert["metric"]["alertname"] for alert in firing}
        assert affinity_value(prometheus, queries.ROUTE_STICKY.state) == queries.FIRING  # the verdict panel
        value = poll(lambda: real_spread(prometheus), lambda v: v > 0, 30)
        assert value > 0, "real sessions through the affinity listener do not spread"
        # The panel against the gateway log itself, at the exporter's last poll: Prometheus scrapes the
        # exporter and records the share every second, well before the next poll.
        taken_at, returning, spread = exported_poll(lab, AFFINITY_LISTENER["log"])
        assert (returning, spread) == logged_sessions(lab, AFFINITY_LISTENER["listener"], taken_at)
        time.sleep(3)
        assert real_spread(prometheus) == pytest.approx(spread / returning)
        # Round robin still reuses the shared system prompt and the rule averages 2 minutes, so the hit
        # ratio sinks slowly: about 0.01 in 20 s in this lab.
        value = poll(lambda: cluster_hit_ratio(prometheus), lambda v: v < hit_ratio - 0.01, 45)
        assert value < hit_ratio - 0.01, f"the cluster hit ratio stays near {hit_ratio:.3f}: {value:.3f}"
    finally:
        assert lab.cli("heal").returncode == 0
