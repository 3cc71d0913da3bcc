"""`kvwatch serve --shard I/N`: the split of the targets between N instances, as Prometheus' hashmod."""

from __future__ import annotations

import argparse

import pytest

from kvwatch.cli.main import build_parser
from kvwatch.config.settings import Config, StoreSettings, Target
from kvwatch.serve import shard
from kvwatch.serve.scheduler import Service

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


def test_serve_probes_and_exports_only_its_share(tmp_path):
    def config(store: str) -> Config:
        return Config(targets=targets(NAMES[:6]), store=StoreSettings(path=tmp_path / store))

    args = build_parser().parse_args(["serve", "--config", "kvwatch.yaml", "--shard", "3/2"])
    share, others = Service(config("a.db"), args.shard), Service(config("b.db"), shard.Shard(0, 2))
    try:
        assert args.shard == shard.Shard(1, 2)
        assert set(share.probes) == {name for name in NAMES[:6] if shard.hashmod(name, 2) == 1}
        assert set(share.probes) | set(others.probes) == set(NAMES[:6])
        assert not set(share.probes) & set(others.probes)
        exported = {
            s.labels["target"]
            for family in share.registry.collect()
            for s in family.samples
            if "target" in s.labels
        }
        assert exported == set(share.probes)
    finally:
        share.store.close()
        others.store.close()
