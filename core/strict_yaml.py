"""YAML as a config file must be read: a key given twice, nesting without end or an impossible date are
errors with a position, not a silent last value or a Python exception."""

from __future__ import annotations

import yaml

# A real config is five levels deep; far more would recurse past Python's limit.
MAX_YAML_DEPTH = 32


class StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a key given twice in one mapping instead of keeping the last silently.

    Keys brought in by a merge (`<<: *anchor`) may still be overridden, as YAML intends. Nesting deeper than
    MAX_YAML_DEPTH and a scalar that resolves to no valid date or integer are YAML errors with a position,
    where SafeLoader would raise RecursionError or ValueError.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        if self.depth == MAX_YAML_DEPTH:
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {MAX_YAML_DEPTH} levels deep", mark
            )
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except ValueError:  # 2026-13-45, an integer of more than 4,300 digits
            kind = node.tag.rpartition(":")[2]
            raise yaml.constructor.ConstructorError(
                None, None, f"not a valid {kind}", node.start_mark
            ) from None

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f'duplicate key "{key.value}"', key.start_mark
                    )
                seen.add(key.value)
        return super().construct_mapping(node, deep)


# PyYAML's words for the slips people make in a config, and what to say instead: what is wrong and the fix.
_PLAIN_WORDS = (
    (
        "found character '\\t' that cannot start any token",
        "a tab: YAML indents with spaces only; replace the tab with spaces",
    ),
    (
        "cannot start any token",
        "a value cannot start with this character unquoted; put the value in quotes",
    ),
    (
        "mapping values are not allowed here",
        'an unexpected ":" here: this line is indented deeper than the key it follows, or a value holds '
        '": "; line the keys of one mapping up in one column, or quote the value',
    ),
    (
        "expected <block end>",
        "the indentation does not match: this line is indented less than the lines before it of the same "
        "block, and more than the block around it; line it up with the keys or list items it belongs to",
    ),
    (
        "did not find expected key",
        "the indentation does not match: line this key up with the keys of its mapping",
    ),
    (
        "did not find expected '-' indicator",
        'the indentation does not match: line this list item ("- ") up with the items before it',
    ),
    ("could not find expected ':'", 'a key without ": " after it; write key: value'),
    ("found unexpected end of stream", "the file ends inside a quoted value: close the quote"),
    ("but got '<stream end>'", 'the file ends inside a [ ] or { } list: close it with "]" or "}"'),
    ("found undefined alias", "an alias (*name) without an anchor (&name) before it"),
)


def plain_problem(error: yaml.MarkedYAMLError) -> str:
    """PyYAML's problem in plain words with the fix, for the slips a hand-written config makes; any
    other problem as PyYAML says it. A quote left open is placed where it was opened."""
    problem = str(error.problem)
    for words, plain in _PLAIN_WORDS:
        if words in problem:
            if "quoted" in str(error.context or "") and error.context_mark is not None:
                mark = error.context_mark
                return f"{plain} (opened at line {mark.line + 1}, column {mark.column + 1})"
            return plain
    return problem
