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
