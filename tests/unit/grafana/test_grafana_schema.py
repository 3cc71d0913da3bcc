"""The Grafana boards checked by Grafana's own definitions.

Schema: @grafana/schema, the types Grafana publishes for its dashboards and panel plugins, for Grafana
11.6 and 12.4 (tools/grafana-schema, pinned by its lockfile, installed by `make test`). The package ships
TypeScript types only, so tools/grafana-schema/check.mjs type-checks each board with the TypeScript
compiler.

Lint: Grafana's dashboard-linter is a Go tool released as GitHub binaries, which cannot be installed
here, so its rules that tests/unit/grafana/test_grafana.py does not already check are re-implemented
below on the parsed PromQL (promql-parser), the way its Go code applies them. Where a rule does not fit
a kvwatch board, an exclusion below says why.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import promql_parser
import pytest

import kvwatch.grafana.boards
from kvwatch.alerts.verdicts import VERDICTS
from kvwatch.cli.generate import generated_files
from kvwatch.core.labels import CLUSTER_LABEL
from kvwatch.grafana import boards, panels
from kvwatch.prometheus import panel_queries, promql
from paths import REPO

SCHEMA_TOOL = REPO / "tools" / "grafana-schema"
PROVISIONED = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
BOARDS = PROVISIONED + sorted((REPO / "grafana" / "import").glob("*.json"))


def load(path: Path) -> dict:
    return json.loads(path.read_text())


# --- @grafana/schema ----------------------------------------------------------------------------------


def broken_board() -> tuple[str, dict[str, int]]:
    """The drill-down with three mistakes the schema knows, and the line of each."""
    board = boards.drilldown()
    panel = next(p for p in board["panels"] if p["type"] == "timeseries")
    panel["options"]["tooltip"]["mode"] = "several"  # not a tooltip mode
    panel["fieldConfig"]["defaults"]["custom"]["lineWidht"] = 1  # no such option
    board["graphTooltip"] = "shared"  # a number
    text = json.dumps(board, indent=2)
    lines = text.splitlines()
    mistakes = ('"mode": "several"', '"lineWidht"', '"graphTooltip"')
    return text, {m: next(i for i, line in enumerate(lines, 1) if m in line) for m in mistakes}


@pytest.fixture(scope="module")
def schema_check(tmp_path_factory) -> tuple[str, Path, dict[str, int]]:
    """One run of the check over every board and a broken one (node starts TypeScript once): its
    output, the broken board and the line of each of its mistakes."""
    node = shutil.which("node")
    assert node, "node is missing: `make test` installs Debian's nodejs"
    assert (SCHEMA_TOOL / "node_modules").is_dir(), "@grafana/schema is missing: run `make grafana-schema`"
    text, mistakes = broken_board()
    broken = tmp_path_factory.mktemp("schema") / "broken.json"
    broken.write_text(text)
    result = subprocess.run(
        [node, str(SCHEMA_TOOL / "check.mjs"), *map(str, BOARDS), str(broken)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return result.stdout + result.stderr, broken, mistakes


@pytest.mark.integration  # runs Node with Grafana's published schema
def test_every_board_fits_grafanas_schema(schema_check):
    output, broken, _ = schema_check
    errors = [line for line in output.splitlines() if not line.startswith(str(broken))]
    assert errors == [], output


@pytest.mark.integration  # runs Node with Grafana's published schema
def test_the_schema_check_finds_each_mistake_in_every_release(schema_check):
    output, broken, mistakes = schema_check
    releases = [spec.split("@")[-1] for spec in json.loads((SCHEMA_TOOL / "package.json").read_text())[
        "dependencies"].values() if spec.startswith("npm:@grafana/schema@")]  # fmt: skip
    assert [release.split(".")[0] for release in releases] == ["11", "12"]
    found = output.splitlines()
    for mistake, line_number in mistakes.items():
        for release in releases:
            where = f"{broken}:{line_number}:"
            assert any(line.startswith(where) and f"Grafana {release}:" in line for line in found), (
                f"{mistake} on line {line_number} is not reported for Grafana {release}:\n{output}"
            )


# --- dashboard-linter's rules -----------------------------------------------------------------------

# What the linter puts for Grafana's interval variables before parsing, so that it can tell them apart.
MAGIC = {
    name: timedelta(milliseconds=ms)
    for name, ms in {"__rate_interval": 8869990787, "__interval": 4867856611, "__range": 6069770749}.items()
}
RATE_INTERVAL = MAGIC["__rate_interval"]

# target-job-rule and target-instance-rule: series that carry no engine job or instance, so that the
# engine filters would only hide them. Every pattern must still match a series on some board.
NO_ENGINE_JOB_OR_INSTANCE = {
    r"cluster:.+": "a cluster-wide recording rule: summed over every engine, no job or instance left",
    r"(route:)?kvwatch_probe_.+": "kvwatch's own probe, filtered by $target: its job and instance are "
    "kvwatch serve's",
    r"(listener:)?kvwatch_gateway_.+": "read from the gateway's access log, per log and listener",
    r"instance(_reason)?:kvwatch_router_.+": "a router's: its job and instance are the router's, not an "
    "engine's",
    r"ALERTS": "the alerts' state, labelled by what each alert watches",
    r"instance:kvwatch_prompt_tokens:rate2m": "the divisor of a join on (job, instance) to a filtered "
    "numerator, which picks its series",
}
# Every rule on targets: a verdict shows the alert's own expression, with its own windows, which the
# board's filters do not narrow (see panels.verdict_stat).
VERDICTS = {panels.as_board_runs(v.state, CLUSTER_LABEL) for v in VERDICTS}
# target-rate-interval-rule: rates over the board's whole time range on purpose.
WHOLE_RANGE = {
    promql.with_matcher(
        panel_queries.PROBE_TTFT_BY_ROUND, panel_queries.cluster_matcher()
    ): "the per-round chart: one instant query over the time range"
}
# template-job-rule's warning that the label be "Job": the variable lists the engines' jobs only.
JOB_LABEL = "Engine job"
# panel-units-rule: the units of Grafana's misc, time and throughput categories.
UNITS = {
    *("none", "string", "short", "percent", "percentunit", "sci", "locale", "bool", "bool_yes_no"),
    *("ns", "µs", "ms", "s", "m", "h", "d", "dtdurationms", "dtdurations", "dthms", "dtdhms"),
    *("cps", "ops", "reqps", "rps", "wps", "iops", "cpm", "opm", "rpm", "wpm"),
}
UNIT_PANELS = {"stat", "singlestat", "graph", "table", "timeseries", "gauge"}


def expand(expr: str) -> str:
    """Grafana's variables outside quoted strings set as the linter sets them (those inside are label
    values, matched below as they are)."""
    parts = expr.split('"')
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"\$\{?(\w+)\}?", lambda match: promql_duration(MAGIC[match[1]]), parts[i])
    return '"'.join(parts)


def promql_duration(duration: timedelta) -> str:
    """In days, seconds and milliseconds: promql-parser's milliseconds stop at 2**32."""
    return f"{duration.days}d{duration.seconds}s{duration.microseconds // 1000}ms"


def children(node) -> list:
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    return [node.expr] if hasattr(node, "expr") else []


def walk(node, parents: tuple = ()) -> Iterator[tuple[object, tuple]]:
    """Every node of a parsed query with its ancestors, nearest last."""
    yield node, parents
    for child in children(node):
        yield from walk(child, (*parents, node))


def targets(board: dict) -> Iterator[tuple[str, str]]:
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"]


def selectors(expr: str) -> Iterator[promql_parser.VectorSelector]:
    for node, _ in walk(promql_parser.parse(expand(expr))):
        if isinstance(node, promql_parser.VectorSelector):
            yield node


def matcher_problem(selector: promql_parser.VectorSelector, label: str) -> str | None:
    """What target-job-rule and target-instance-rule say of a selector: it must match label=~"$label"."""
    found = [m for m in selector.matchers.matchers if m.name == label]
    if any(m.op == promql_parser.MatchOp.Re and m.value == f"${label}" for m in found):
        return None
    return f'{selector.name} has no {label}=~"${label}"'


def excused(selector: promql_parser.VectorSelector) -> bool:
    return any(re.fullmatch(pattern, selector.name or "") for pattern in NO_ENGINE_JOB_OR_INSTANCE)


def rate_interval_problem(node, parents: tuple) -> str | None:
    """target-rate-interval-rule: rate and irate over $__rate_interval, which goes in a function only."""
    call = parents[-1] if parents else None
    if not isinstance(call, promql_parser.Call):
        return "$__rate_interval outside a function" if node.range == RATE_INTERVAL else None
    if call.func.name in ("rate", "irate") and node.range != RATE_INTERVAL:
        return f"{call.func.name} over [{node.range}]"
    return None


def counter_problem(node, parents: tuple) -> str | None:
    """target-counter-agg-rule: a counter (`_total`) is read through rate, irate or increase only."""
    if not (node.name or "").endswith("_total"):
        return None
    call, matrix = parents[-2:] if len(parents) >= 2 else (None, None)
    counted = isinstance(matrix, promql_parser.MatrixSelector) and isinstance(call, promql_parser.Call)
    return None if counted and call.func.name in ("rate", "irate", "increase") else f"{node.name} unrated"


def lint_targets(board: dict) -> list[str]:
    """target-promql, target-job, target-instance, target-rate-interval and target-counter-agg."""
    problems = []
    for title, expr in targets(board):
        if expr in VERDICTS:
            continue
        try:
            tree = promql_parser.parse(expand(expr))
        except ValueError as error:
            problems.append(f"{title}: target-promql-rule: {error}")
            continue
        for selector in selectors(expr):
            for label in ("job", "instance"):
                problem = None if excused(selector) else matcher_problem(selector, label)
                if problem:
                    problems.append(f"{title}: target-{label}-rule: {problem}")
        for node, parents in walk(tree):
            if isinstance(node, promql_parser.MatrixSelector) and expr not in WHOLE_RANGE:
                problem = rate_interval_problem(node, parents)
                problems += [f"{title}: target-rate-interval-rule: {problem}"] if problem else []
            if isinstance(node, promql_parser.VectorSelector):
                problem = counter_problem(node, parents)
                problems += [f"{title}: target-counter-agg-rule: {problem}"] if problem else []
    return problems


def lint_variables(board: dict) -> list[str]:
    """template-job, template-instance and template-label-promql."""
    variables = {v["name"]: v for v in board["templating"]["list"]}
    problems = []
    for name in ("job", "instance"):
        variable = variables.get(name)
        if variable is None:
            problems.append(f"template-{name}-rule: no {name} variable")
            continue
        label = JOB_LABEL if name == "job" else name.title()
        wanted = {"datasource": panels.DATASOURCE, "type": "query", "label": label, "multi": True,
                  "allValue": ".+"}  # fmt: skip
        for key, value in wanted.items():
            if variable.get(key) != value:
                problems.append(f"template-{name}-rule: {key} is {variable.get(key)!r}, not {value!r}")
    for variable in variables.values():
        if variable["type"] != "query":
            continue
        call = re.fullmatch(r"([a-z_]+)\((.+?)(?:,\s*\w+)?\)", variable["query"])
        if not call or call[1] not in ("label_names", "label_values", "metrics", "query_result"):
            problems.append(f"template-label-promql-rule: {variable['name']}: {variable['query']}")
            continue
        try:
            promql_parser.parse(expand(call[2]))
        except ValueError as error:
            problems.append(f"template-label-promql-rule: {variable['name']}: {error}")
    return problems


def lint_panels(board: dict) -> list[str]:
    """panel-units-rule and uneditable-dashboard."""
    problems = [] if board["editable"] is False else ["uneditable-dashboard: the board is editable"]
    for panel in board["panels"]:
        if panel["type"] not in UNIT_PANELS:
            continue
        defaults = panel["fieldConfig"]["defaults"]
        mapped = defaults.get("mappings") or panel.get("options", {}).get("reduceOptions", {}).get("fields")
        if not mapped and defaults.get("unit") not in UNITS:
            problems.append(f"{panel['title']}: panel-units-rule: unit {defaults.get('unit')!r}")
    return problems


def lint(board: dict) -> list[str]:
    return lint_variables(board) + lint_panels(board) + lint_targets(board)


@pytest.mark.parametrize("path", PROVISIONED, ids=lambda p: p.name)
def test_boards_follow_the_dashboard_linters_rules(path: Path):
    assert lint(load(path)) == []


def test_every_exclusion_is_still_needed():
    names = {s.name for path in PROVISIONED for _, e in targets(load(path)) if e not in VERDICTS
             for s in selectors(e)}  # fmt: skip
    unused = [p for p in NO_ENGINE_JOB_OR_INSTANCE if not any(re.fullmatch(p, name) for name in names)]
    assert unused == []
    expressions = {e for path in PROVISIONED for _, e in targets(load(path))}
    assert set(WHOLE_RANGE) <= expressions


def test_the_linter_rules_find_each_mistake():
    board = boards.drilldown()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    variables["job"]["allValue"] = ".*"
    variables["instance"]["multi"] = False
    board["editable"] = True
    panel = next(p for p in board["panels"] if p["type"] == "timeseries")
    panel["fieldConfig"]["defaults"]["unit"] = "seconds"
    panel["targets"] = [
        {"expr": 'rate(vllm:num_requests_total{job=~"$job"}[5m])'},
        {"expr": 'vllm:num_requests_total{job=~"$job", instance=~"$instance"}'},
    ]
    assert sorted(lint(board)) == sorted([
        "template-job-rule: allValue is '.*', not '.+'",
        "template-instance-rule: multi is False, not True",
        "uneditable-dashboard: the board is editable",
        f"{panel['title']}: panel-units-rule: unit 'seconds'",
        f'{panel["title"]}: target-instance-rule: vllm:num_requests_total has no instance=~"$instance"',
        f"{panel['title']}: target-rate-interval-rule: rate over [0:05:00]",
        f"{panel['title']}: target-counter-agg-rule: vllm:num_requests_total unrated",
    ])  # fmt: skip


# --- the Cluster variable -----------------------------------------------------------------------------


def board_queries(board: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target, annotation and variable query but the Cluster variable's."""
    yield from targets(board)
    yield from (("annotation", a["expr"]) for a in board["annotations"]["list"] if "expr" in a)
    for variable in board["templating"]["list"]:
        if variable["type"] == "query" and variable["name"] != panel_queries.CLUSTER_VARIABLE:
            assert variable["definition"] == variable["query"]
            yield variable["name"], re.fullmatch(r"label_values\((.+), \w+\)", variable["query"])[1]


def unnarrowed(board: dict, label: str) -> list[str]:
    """Each selector of the board's queries without `label`=~"$cluster"."""
    wanted = (label, promql_parser.MatchOp.Re, "$cluster")
    return [f"{where}: {s.name}" for where, expr in board_queries(board) for s in selectors(expr)
            if wanted not in [(m.name, m.op, m.value) for m in s.matchers.matchers]]  # fmt: skip


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_query_of_a_board_matches_the_picked_clusters(path: Path):
    board = load(path)
    assert len(list(board_queries(board))) > len(board["panels"])
    assert unnarrowed(board, CLUSTER_LABEL) == []
    source, cluster = board["templating"]["list"][:2]
    assert source["type"] == "datasource"
    assert {key: cluster[key] for key in ("name", "label", "query", "multi", "includeAll", "allValue")} == {
        "name": "cluster", "label": "Cluster", "query": "label_values(up, cluster)", "multi": True,
        "includeAll": True, "allValue": ".*"}  # fmt: skip


def test_the_cluster_label_is_the_generators_to_set():
    generated = generated_files(cluster_label="region").items()
    boards = {name: text for name, text in generated if name.startswith("grafana/") and ".json" in name}
    assert len(boards) == 2 * len(kvwatch.grafana.boards.BOARDS)
    for name, text in boards.items():
        board = json.loads(text)
        assert unnarrowed(board, "region") == [], name
        assert 'cluster=~"$cluster"' not in text, name
        (cluster,) = [v for v in board["templating"]["list"] if v["name"] == "cluster"]
        assert cluster["query"] == cluster["definition"] == "label_values(up, region)"
