"""promql.with_matcher, checked by promql-parser: every series selector of every query kvwatch runs
gets the matcher, and nothing else changes."""

from __future__ import annotations

import promql_parser
import pytest
from test_grafana_schema import expand, selectors

from kvwatch.alerts.verdicts import VERDICTS
from kvwatch.cli.generate import RULE_FILES
from kvwatch.prometheus import panel_queries, promql, queries

MATCHER = 'cluster=~"$cluster"'


def parses(expr: str) -> bool:
    try:
        promql_parser.parse(expand(expr))
    except ValueError:
        return False
    return True


def every_query() -> set[str]:
    """The rules', the alerts', the verdicts' and every named query (the boards' and the pages'), but
    the parts of queries (`and on(...) ...`) and the names alone."""
    rules = {rule.expr for _, rules in RULE_FILES.values() for rule in rules}
    every_name = vars(queries) | vars(panel_queries)
    named = {v for name, v in every_name.items() if name.isupper() and isinstance(v, str) and "(" in v}
    return {e for e in rules | named | {v.state for v in VERDICTS} if parses(e)}


@pytest.mark.parametrize(
    ("expr", "narrowed"),
    [
        ("up", 'up{k="v"}'),
        ('up{job="a"} == 0', 'up{k="v", job="a"} == 0'),
        ('{__name__=~"a|b"}', '{k="v", __name__=~"a|b"}'),
        ("sum by (job) (rate(x[$__rate_interval]))", 'sum by (job) (rate(x{k="v"}[$__rate_interval]))'),
        (
            "sum(x) without (le) / on(job) group_left() y",
            'sum(x{k="v"}) without (le) / on(job) group_left() y{k="v"}',
        ),
        (
            'label_replace(x, "dst", "$1", "src", "(.+)")',
            'label_replace(x{k="v"}, "dst", "$1", "src", "(.+)")',
        ),
        ("a and bool b offset 1h or vector(1)", 'a{k="v"} and bool b{k="v"} offset 1h or vector(1)'),
        ('x{a="}{"} @ start()', 'x{k="v", a="}{"} @ start()'),
        ("max_over_time(x[1h:5m]) > 1e-9", 'max_over_time(x{k="v"}[1h:5m]) > 1e-9'),
    ],
)
def test_the_matcher_goes_into_every_selector(expr, narrowed):
    assert promql.with_matcher(expr, 'k="v"') == narrowed


@pytest.mark.parametrize("expr", sorted(every_query()))
def test_every_query_kvwatch_runs_is_narrowed_selector_by_selector(expr):
    before, after = list(selectors(expr)), list(selectors(promql.with_matcher(expr, MATCHER)))
    assert [s.name for s in after] == [s.name for s in before]
    for selector, original in zip(after, before, strict=True):
        added = [m for m in selector.matchers.matchers if (m.name, m.value) == ("cluster", "$cluster")]
        assert len(added) == 1 and added[0].op == promql_parser.MatchOp.Re, selector
        assert len(selector.matchers.matchers) == len(original.matchers.matchers) + 1
    # the rest of the query as it was: the same tree once the matcher is taken out again
    again = promql.with_matcher(expr, MATCHER).replace(f"{MATCHER}, ", "").replace(f"{{{MATCHER}}}", "")
    assert promql_parser.parse(expand(again)).prettify() == promql_parser.parse(expand(expr)).prettify()


def test_a_value_is_quoted_as_a_promql_string():
    assert promql.string('eu "west"\\1') == '"eu \\"west\\"\\\\1"'


@pytest.mark.parametrize("expr", sorted(every_query()))
def test_the_series_names_of_a_query_are_its_named_selectors(expr):
    named = [s.name for s in selectors(expr) if s.name]
    assert promql.series_names(expr) == list(dict.fromkeys(named))
