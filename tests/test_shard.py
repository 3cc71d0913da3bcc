"""`kvwatch serve --shard I/N`: the split of the targets between N instances, as Prometheus' hashmod."""

from __future__ import annotations

import argparse

import pytest

from collectors import shard
from collectors.config import Target

NAMES = [f"route-{i}" for i in range(60)]


def targets(names: list[str]) -> tuple[Target, ...]:
    return tuple(Target(name=name, base_url="http://gateway:8080", model="m") for name in names)


def test_a_name_lands_where_prometheus_hashmod_puts_it():
    # prometheus/model/relabel's own case: hashmod of "baz" with modulus 1000 is 976.
    assert shard.hashmod("baz", 1000) == 976
    assert shard.hashmod("baz", 1) == 0


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_every_target_is_in_exactly_one_shard_and_each_gets_a_share(count):
    shares = [shard.Shard(i, count).select(targets(NAMES)) for i in range(count)]
    names = [t.name for share in shares for t in share]
    assert sorted(names) == sorted(NAMES)
    assert all(shares)


def test_the_split_depends_on_the_names_only():
    before = {t.name for t in shard.Shard(1, 3).select(targets(NAMES))}
    added = {t.name for t in shard.Shard(1, 3).select(targets(["new-route", *reversed(NAMES)]))}
    assert added - {"new-route"} == before  # order or a new target moves none of the others


@pytest.mark.parametrize(
    "text, parsed", [("0/1", shard.WHOLE), ("1/3", shard.Shard(1, 3)), ("5/3", shard.Shard(2, 3))]
)
def test_instance_i_and_i_plus_n_are_replicas_of_one_shard(text, parsed):
    assert shard.parse(text) == parsed


@pytest.mark.parametrize("text", ["1", "1/0", "-1/2", "a/2", "1/2/3", " 1/2", "1/1234567"])
def test_a_malformed_shard_is_refused_saying_what_it_must_be(text):
    with pytest.raises(argparse.ArgumentTypeError, match=f'must be I/N, .*got "{text}"'):
        shard.parse(text)
