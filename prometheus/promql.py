"""A label matcher added to every series selector of a PromQL expression, and a label kept by every
aggregation and match.

The boards and the dashboard narrow each query of prometheus/panel_queries.py to the picked clusters this way,
and the boards keep the clusters apart, rather than every query being written once per scope. A small
lexer is enough: in PromQL a name is a series selector unless it is a keyword, calls a function or
aggregation, or lists labels after `by`, `without`, `on`, `ignoring`, `group_left` or `group_right`; every
`{...}` outside a string is a selector's matchers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_STRING = r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`'
_TOKENS = re.compile(
    rf"(?P<string>{_STRING})"
    rf"|(?P<matchers>\{{(?:{_STRING}|[^}}\"'`])*\}})"
    r"|(?P<range>\[[^\]]*\])"
    r"|(?P<number>\.?\d[\w.]*)"
    r"|(?P<variable>\$\{?\w+\}?)"
    r"|(?P<name>[A-Za-z_:][\w:]*)"
    r"|(?P<other>.)",
    re.DOTALL,
)
_LABEL_LIST_AFTER = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
_LABEL_LIST = re.compile(r"(\s*)\(([^)]*)\)")
# What follows a name that is not a series: a call's arguments, or an aggregation's `by` or `without`.
_NOT_A_SERIES = re.compile(r"\s*(\(|\{|(by|without)\b)", re.IGNORECASE)
_A_CALL = re.compile(r"\s*(\(|(by|without)\b)", re.IGNORECASE)


def string(value: str) -> str:
    """`value` as a PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _tokens(expr: str) -> Iterator[tuple[str, str, re.Match | None, int]]:
    """(kind, text, label list, end) of each token of `expr`. A keyword that lists labels (`by`, `on`,
    ...) is of kind "grouping" and comes with the `(...)` after it, if any; `end` is where the next token
    starts."""
    at = 0
    while at < len(expr):
        token = _TOKENS.match(expr, at)
        kind, text, at = token.lastgroup, token[0], token.end()
        labels = None
        if kind == "name" and text.lower() in _LABEL_LIST_AFTER:
            kind, labels = "grouping", _LABEL_LIST.match(expr, at)
            at = labels.end() if labels else at
        yield kind, text, labels, at


def with_matcher(expr: str, matcher: str) -> str:
    """`expr` with `matcher` (such as `cluster=~"$cluster"`) in every series selector."""
    out = []
    for kind, text, labels, at in _tokens(expr):
        if kind == "matchers":
            inner = text[1:-1]
            text = "{" + matcher + (", " + inner.strip() if inner.strip() else "") + "}"
        elif kind == "grouping":
            text += labels[0] if labels else ""
        elif kind == "name" and text.lower() not in _KEYWORDS and not _NOT_A_SERIES.match(expr, at):
            text += "{" + matcher + "}"
        out.append(text)
    return "".join(out)


def series_names(expr: str) -> list[str]:
    """The metric names `expr` selects by name, each once, in order: what a Prometheus must hold for
    `expr` to read anything."""
    names = [
        text
        for kind, text, _, at in _tokens(expr)
        if kind == "name" and text.lower() not in _KEYWORDS and not _A_CALL.match(expr, at)
    ]
    return list(dict.fromkeys(names))


def keeping(expr: str, label: str) -> str:
    """`expr` with `label` in every `by (...)` and `on (...)` list, so that no aggregation sums, and no
    match joins, series of different `label` values. An expression over series without the label reads
    as before."""
    out = []
    for kind, text, labels, _ in _tokens(expr):
        if kind == "grouping" and labels:
            names = [name.strip() for name in labels[2].split(",") if name.strip()]
            listed = labels[0]
            if text.lower() in ("by", "on") and label not in names:
                listed = f"{labels[1]}({', '.join([label, *names])})"
            text += listed
        out.append(text)
    return "".join(out)
