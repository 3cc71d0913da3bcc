"""`kvwatch serve --shard I/N`: N instances split the targets, each probing and exporting its share.

A target belongs to the shard that Prometheus' `hashmod` relabeling gives its name (the MD5 digest's last
8 bytes as a big-endian integer, modulo N), so the split depends on the names and N only: every
instance computes the same one from the same config, and adding a target moves no other. Instances I and
I + N probe the same share, so that a StatefulSet of 2N pods passing its pod index as I runs every shard
twice; the alerts aggregate by target and fire once however many instances export it.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvwatch.config.settings import Target

_SHARD = re.compile(r"(\d{1,6})/(\d{1,6})")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0 <= index < count)."""

    index: int = 0
    count: int = 1

    def owns(self, name: str) -> bool:
        return hashmod(name, self.count) == self.index

    def select(self, targets: Iterable[Target]) -> tuple[Target, ...]:
        return tuple(target for target in targets if self.owns(target.name))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


WHOLE = Shard()  # one instance probes every target


def hashmod(value: str, modulus: int) -> int:
    """What Prometheus' `action: hashmod` with this `modulus` makes of `value`."""
    digest = hashlib.md5(value.encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[8:], "big") % modulus


def parse(text: str) -> Shard:
    """`I/N` as --shard takes it: instance I (from 0) of a split into N shards, I taken modulo N."""
    match = _SHARD.fullmatch(text)
    if not match or int(match[2]) == 0:
        raise argparse.ArgumentTypeError(
            f'must be I/N, this instance\'s number from 0 and the number of shards (>= 1), got "{text}"'
        )
    index, count = int(match[1]), int(match[2])
    return Shard(index % count, count)
