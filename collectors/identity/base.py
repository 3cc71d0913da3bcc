"""The interface every replica-identity convention implements: where it looks and how it reads a value."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Convention:
    """One way a response names the replica that served it.

    `read` turns the value of one of its response headers or stream-chunk fields into the replica's name,
    or None when the value names none. `request_extras` is what the request must carry before the answer
    names the replica at all (merged into the request body); most conventions need nothing.
    """

    name: str
    read: Callable[[object], str | None]
    headers: tuple[str, ...] = ()
    json_paths: tuple[str, ...] = ()
    request_extras: Mapping[str, object] = field(default_factory=dict)


def plain_name(value: object) -> str | None:
    """A string or integer value as the replica's name; anything else (an object, true) names none."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return str(value).strip() or None
