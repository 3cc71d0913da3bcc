"""One registry per family of interchangeable kinds (engine flavours, log formats, gateways...): a
name -> implementation mapping whose `lookup` refuses an unknown name the same way in every family."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar


class Named(Protocol):
    name: str


T = TypeVar("T", bound=Named)


def unknown(noun: str, name: object, known: Iterable[str]) -> str:
    """The error for a name no member of a family has, e.g. `unknown format "ngix"; did you mean
    "nginx"? known: envoy, nginx`."""
    known = sorted(known)
    return f'unknown {noun} "{name}";{did_you_mean(name, known)} known: {", ".join(known)}'


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """` did you mean "x"?` for the known name closest to a misspelt `name`; "" when none is close."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f' did you mean "{close[0]}"?' if close else ""


class Registry(dict[str, T], Generic[T]):
    """The members of one family by name, in the order given; `noun` names a member in errors."""

    def __init__(self, noun: str, members: Iterable[T]) -> None:
        super().__init__((member.name, member) for member in members)
        self.noun = noun

    def lookup(self, name: str) -> T:
        """The member called `name`; a ValueError naming the known ones for any other."""
        if name not in self:
            raise ValueError(unknown(self.noun, name, self))
        return self[name]
