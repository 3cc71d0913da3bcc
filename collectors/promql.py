"""A label matcher added to every series selector of a PromQL expression.

The boards and the dashboard narrow each query of collectors/queries.py to the picked clusters this way,
rather than every query being written once per scope. A small lexer is enough: in PromQL a name is a
series selector unless it is a keyword, calls a function or aggregation, or lists labels after `by`,
`without`, `on`, `ignoring`, `group_left` or `group_right`; every `{...}` outside a string is a selector's
matchers.
"""

from __future__ import annotations

import re

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
_LABEL_LIST = re.compile(r"\s*\([^)]*\)")
# What follows a name that is not a series: a call's arguments, or an aggregation's `by` or `without`.
_NOT_A_SERIES = re.compile(r"\s*(\(|\{|(by|without)\b)", re.IGNORECASE)


def string(value: str) -> str:
    """`value` as a PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def with_matcher(expr: str, matcher: str) -> str:
    """`expr` with `matcher` (such as `cluster=~"$cluster"`) in every series selector."""
    out, at = [], 0
    while at < len(expr):
        token = _TOKENS.match(expr, at)
        kind, text, at = token.lastgroup, token[0], token.end()
        if kind == "matchers":
            inner = text[1:-1]
            text = "{" + matcher + (", " + inner.strip() if inner.strip() else "") + "}"
        elif kind == "name" and text.lower() in _LABEL_LIST_AFTER:
            labels = _LABEL_LIST.match(expr, at)
            if labels:
                text, at = text + labels[0], labels.end()
        elif kind == "name" and text.lower() not in _KEYWORDS and not _NOT_A_SERIES.match(expr, at):
            text += "{" + matcher + "}"
        out.append(text)
    return "".join(out)
