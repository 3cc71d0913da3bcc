"""The Grafana boards: generated from prometheus/panel_queries.py and committed up to date, linted the way
Grafana's dashboard-linter would (it cannot be installed here), every panel query valid PromQL for
promtool. tests/integration/test_grafana_lab.py proves every panel against the lab's real Prometheus."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvwatch.alerts.verdicts import (
    FIRING,
    OK,
    PENDING,
    VERDICTS,
)
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.core.naming import RUNBOOK, RUNBOOK_URL
from kvwatch.grafana import boards
from kvwatch.grafana.panels import (
    DATASOURCE,
    FIXED_WINDOW,
    GRID_WIDTH,
    OVERVIEW,
    SCHEMA_VERSION,
    as_board_runs,
    cluster_legend,
    runbook_link,
    uid,
)
from kvwatch.prometheus import panel_queries, promql, queries
from kvwatch.prometheus.rules import WINDOWED_RULES
from paths import REPO
from tools import board_preview

PROVISIONED = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
IMPORTED = sorted((REPO / "grafana" / "import").glob("*.json"))
PROVISIONING = REPO / "grafana" / "provisioning"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(board: dict) -> list[dict]:
    return [panel for panel in board["panels"] if panel["type"] != "row"]


def queries_of(board: dict) -> list[tuple[str, str]]:
    return [(panel["title"], t["expr"]) for panel in panels(board) for t in panel["targets"]]


def every_query() -> dict[str, str]:
    """Each distinct panel query of the provisioned boards, with a panel title that shows it."""
    return {expr: title for path in PROVISIONED for title, expr in queries_of(load(path))}


def in_clusters(expr: str) -> str:
    """A panel query (prometheus/panel_queries.py) as the boards' time series and stats run it: narrowed
    to the picked clusters, one series per cluster."""
    return as_board_runs(expr, CLUSTER_LABEL)


def filled(expr: str) -> str:
    return panel_queries.fill_variables(expr, window="5m", time_range="1h")


def test_committed_boards_are_exactly_the_generated_ones():
    generated = boards.dashboard_files()
    committed = {str(path.relative_to(REPO)) for path in PROVISIONED + IMPORTED}
    assert committed == set(generated), "boards not produced by grafana/boards.py, or missing"
    for relative, text in generated.items():
        assert (REPO / relative).read_text() == text, f"{relative} is stale: run `make generate`"


@pytest.mark.parametrize("path", PROVISIONED + IMPORTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_board_structure(path: Path):
    board = load(path)
    assert board["id"] is None and board["uid"] == uid(path.name) and 8 <= len(board["uid"]) <= 40
    assert board["schemaVersion"] == SCHEMA_VERSION and board["title"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"} and pos["w"] > 0 and pos["h"] > 0, panel["title"]
        assert pos["x"] + pos["w"] <= GRID_WIDTH, panel["title"]
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
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"] and all(t["datasource"] == DATASOURCE for t in panel["targets"])
    builtin = {"type": "grafana", "uid": "-- Grafana --"}  # the built-in annotations, in every board
    hard_coded = [ref for ref in datasource_refs(board) if ref not in (DATASOURCE, builtin)]
    assert not hard_coded, f"hard-coded data sources: {hard_coded}"
    for variable in variables:
        if variable["type"] == "query":
            assert variable["refresh"] == 2, f"{variable['name']} must reload on time-range change"


VERDICT_STATES = {in_clusters(verdict.state): verdict for verdict in VERDICTS}


@pytest.mark.parametrize("path", PROVISIONED, ids=lambda p: p.name)
def test_rate_windows_counters_units_and_descriptions(path: Path):
    board = load(path)
    for title, expr in queries_of(board):
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
    recorded = {rule.record for rule in WINDOWED_RULES}
    for path in PROVISIONED:
        for panel in panels(load(path)):
            reads_a_rule = any(name in t["expr"] for t in panel["targets"] for name in recorded)
            assert reads_a_rule == (FIXED_WINDOW in panel["description"]), panel["title"]


def test_every_panel_query_is_a_named_dashboard_query():
    """Each as the board runs it: a time series or stat per cluster, a table or heatmap over them."""
    named = {True: set(VERDICT_STATES), False: set()}
    for name, value in (vars(queries) | vars(panel_queries)).items():
        values = [v for v in (value.values() if isinstance(value, dict) else [value]) if isinstance(v, str)]
        for per_cluster in named:
            named[per_cluster] |= {
                as_board_runs(v, CLUSTER_LABEL, per_cluster=per_cluster) for v in values if name.isupper()
            }
    for path in PROVISIONED:
        for panel in panels(load(path)):
            for query in panel["targets"]:
                per_cluster = query["format"] == "time_series"
                assert query["expr"] in named[per_cluster], (
                    f"{panel['title']}: PromQL typed in the board instead of prometheus/panel_queries.py"
                )


GROUPINGS = re.compile(r"\b(by|on)\s*\(([^)]*)\)")


@pytest.mark.parametrize("path", PROVISIONED, ids=lambda p: p.name)
def test_with_all_clusters_every_line_and_stat_keeps_its_cluster_and_names_it(path: Path):
    """Issue 18: no sum or join across clusters, and a legend that names the cluster first, so that
    with All picked two clusters' instances or routes of one name read apart."""
    for panel in panels(load(path)):
        for query in (q for q in panel["targets"] if q["format"] == "time_series"):
            lists = GROUPINGS.findall(query["expr"])
            assert all(CLUSTER_LABEL in labels.split(", ") for _, labels in lists), panel["title"]
            legend = query["legendFormat"]
            assert legend == "__auto" or legend.startswith("{{cluster}}"), panel["title"]


def test_cluster_legends_read_well_without_the_label():
    """Grafana shows a label the series lacks as its name: one cluster without the label reads
    "cluster" for the cluster's line and "cluster / ..." before an instance's."""
    assert cluster_legend("cluster", "cluster") == "{{cluster}}"
    assert cluster_legend("{{instance}}", "region") == "{{region}} / {{instance}}"
    one_cluster = {"instance": "10.0.0.7:8000"}
    assert board_preview._legend(cluster_legend("{{instance}}", "cluster"), one_cluster) == (
        "cluster / 10.0.0.7:8000"
    )
    assert board_preview._legend(cluster_legend("cluster", "cluster"), one_cluster) == "cluster"


def test_board_queries_keep_every_grouping_and_match_per_cluster():
    expr = (
        'histogram_quantile(0.5, sum by (le) (rate(x{a="by (le)"}[5m]))) / on(job) group_left() y'
        " + sum without (z) (w) + group by () (v) + max by (cluster, k) (u)"
    )
    assert promql.keeping(expr, "cluster") == (
        'histogram_quantile(0.5, sum by (cluster, le) (rate(x{a="by (le)"}[5m]))) / on(cluster, job) '
        "group_left() y + sum without (z) (w) + group by (cluster) (v) + max by (cluster, k) (u)"
    )


def test_every_verdict_is_shown_as_its_alerts_state():
    """One stat per verdict on the overview, its query the alert's own, coloured by the alert's state."""
    board = load(REPO / "grafana" / "dashboards" / OVERVIEW)
    verdicts = [p for p in panels(board) if p["type"] == "stat" and p["targets"][0]["expr"] in VERDICT_STATES]
    assert sorted(p["targets"][0]["expr"] for p in verdicts) == sorted(VERDICT_STATES)
    for panel in verdicts:
        verdict = VERDICT_STATES[panel["targets"][0]["expr"]]
        assert panel["links"] == [runbook_link(verdict.alert.name)], panel["title"]
        assert "the alert's own expression" in panel["description"], panel["title"]
        mapping, absent = panel["fieldConfig"]["defaults"]["mappings"]
        words = {int(value): (shown["text"], shown["color"]) for value, shown in mapping["options"].items()}
        assert words == {OK: ("OK", "green"), PENDING: ("pending", "orange"),
                         FIRING: ("firing", "red")}  # fmt: skip
        # No series: gray, not the first threshold step's green that Grafana gives an unmapped null.
        assert absent == {
            "type": "special",
            "options": {"match": "null", "result": {"color": "gray", "text": "Not watching"}},
        }, panel["title"]
        assert panel["fieldConfig"]["defaults"]["noValue"] == "Not watching"


def test_every_board_marks_the_kvwatch_alerts():
    for path in PROVISIONED:
        marks = [a for a in load(path)["annotations"]["list"] if a.get("expr")]
        assert [(a["expr"], a["datasource"]) for a in marks] == [
            (
                as_board_runs(panel_queries.FIRING_ALERTS_BY_NAME, "cluster", per_cluster=False),
                DATASOURCE,
            )
        ], path.name


def github_anchors(markdown: str) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-") for heading in headings}


def test_runbook_links_point_at_runbook_sections():
    anchors = github_anchors((REPO / RUNBOOK).read_text())
    links = [link for path in PROVISIONED for panel in panels(load(path)) for link in panel["links"]]
    assert links
    for link in links:
        path, anchor = link["url"].split("#")
        assert path == RUNBOOK_URL and anchor in anchors, link


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


@pytest.mark.integration  # runs promtool
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
