"""What every flavour shares: the parsed exposition, the reader that tracks missing series, the snapshot."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:  # router_state reads with this module's Reader
    from kvwatch.collectors.engines.router_state import IndexHealth, SessionTable

# A histogram summed over its label sets: (upper bound, cumulative count) pairs, sorted, +Inf last.
Buckets = tuple[tuple[float, float], ...]

# The series a family of each type exposes, by suffix (prometheus_client names counters without `_total`).
EXPOSED_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum"),
}
# Series that count from 0 up, whatever their declared type: a negative sample is no count.
COUNT_SUFFIXES = ("_total", "_bucket", "_count")
MAX_SHOWN_LABELS = 120  # characters of a duplicated series' label set, as `invalid` names it


class Exposition:
    """One /metrics text, parsed with prometheus_client and indexed by the series names it exposes.

    Lookups use the exposed names (`vllm:prefix_cache_hits_total`, `..._bucket`), never family names
    or prefixes, so the `_created` gauge families prometheus_client adds next to counters can never be
    mistaken for the counters themselves.
    """

    def __init__(self, text: str) -> None:
        self.samples: dict[str, list[Sample]] = defaultdict(list)
        # Series a family declares even before it has samples, e.g. a labelled counter with no children.
        self.declared: set[str] = set()
        # Series with a sample that is no measurement (NaN, infinite, a negative count) or a label set
        # exposed twice: its first such value, or "duplicate {labels}".
        self.invalid: dict[str, str] = {}
        seen: set[tuple] = set()
        for family in text_string_to_metric_families(text):
            self.declared.update(family.name + suffix for suffix in EXPOSED_SUFFIXES.get(family.type, ("",)))
            for sample in family.samples:
                self.samples[sample.name].append(sample)
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if problem := _problem(sample, key in seen):
                    self.invalid.setdefault(sample.name, problem)
                seen.add(key)

    def has(self, name: str) -> bool:
        return name in self.declared or name in self.samples

    def count(self, names: Iterable[str]) -> int:
        """How many of `names` this exposition has: a detection score."""
        return sum(self.has(name) for name in names)

    def count_prefixed(self, *prefixes: str) -> int:
        """How many series start with one of `prefixes`: a detection score for lazily created series."""
        return sum(name.startswith(prefixes) for name in self.declared | self.samples.keys())


def _problem(sample: Sample, duplicate: bool) -> str | None:
    """Why a sample is no measurement, or None. A label set seen twice has two values and no way to tell
    which one is true: keeping either would make a figure up."""
    if duplicate:
        labels = ", ".join(f"{name}={json.dumps(value)}" for name, value in sorted(sample.labels.items()))
        shown = labels if len(labels) <= MAX_SHOWN_LABELS else labels[: MAX_SHOWN_LABELS - 1] + "…"
        return f"duplicate {{{shown}}}"
    if not math.isfinite(sample.value) or (sample.value < 0 and sample.name.endswith(COUNT_SUFFIXES)):
        return floatToGoString(sample.value)
    return None


@dataclass(frozen=True)
class RatioGauge:
    """A hit ratio the engine computed itself over a window it chose; `source` says which one."""

    source: str
    value: float


@dataclass(frozen=True)
class Snapshot:
    """The cumulative values one exposition showed at one scrape, in engine-agnostic terms.

    None means the flavour has no such series, the exposition lacked it (`missing` names the expected
    series that were not found) or had it with a sample that is no measurement (`invalid` names those
    series with their first such value, e.g. "NaN", "-3.0").
    """

    flavour: str
    scraped_at: float  # time.monotonic() when the exposition was read
    hits: float | None = None  # prefix-cache tokens found: the hit ratio's numerator
    queries: float | None = None  # prefix-cache tokens looked up: its denominator
    hit_ratio_gauge: RatioGauge | None = None  # only used when hits / queries are not available
    prompt_tokens: float | None = None
    cached_tokens: float | None = None
    ttft_buckets: Buckets | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage: float | None = None
    prefix_caching_enabled: bool | None = None
    per_worker: Mapping[str, float] = field(default_factory=dict)  # routers: requests sent per worker URL
    policy_decisions: Mapping[str, float] = field(default_factory=dict)  # routers: decisions per policy
    # Routers' cache_aware policy: how often it predicted a cached prefix. A guess, not an engine hit.
    router_cache_predictions: Mapping[str, float] = field(default_factory=dict)
    # Routers that predict a hit ratio per request (llm-d's prefix indexer, Dynamo's KV router): the sum
    # of those ratios and their count, so a window's mean prediction is a ratio of increases.
    predicted_ratio_sum: float | None = None
    predictions: float | None = None
    # Routers that export the reuse decomposition's legs, token counts: the prompt tokens they routed, the
    # most any candidate replica held of them, what the chosen replica held (as predicted), and, where the
    # router counts it beside them, what the engines reused (else the delivered ratio is cached_tokens
    # over prompt_tokens of the requests it forwarded).
    routed_prompt_tokens: float | None = None
    available_tokens: float | None = None
    routed_tokens: float | None = None
    reused_tokens: float | None = None
    sticky_outcomes: Mapping[str, float] = field(default_factory=dict)  # e.g. SMG's manual-policy branches
    routing_key_sources: Mapping[str, float] = field(default_factory=dict)  # where the routing key came from
    session_table: SessionTable | None = None  # routers' session tables (router_state)
    index_health: IndexHealth | None = None  # routers' KV-event index health (router_state)
    # Decisions a cache-aware router took without its prefix index, by why (AIBrix: load_imbalance,
    # error:<reason>): sent by load, whatever the pods held.
    router_fallbacks: Mapping[str, float] = field(default_factory=dict)
    # A KV cache store's lookup hits by tier (LMCache's multi-process server: l1, l2).
    cache_tiers: Mapping[str, float] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    invalid: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Flavour:
    """One metrics dialect: how to recognise it in an exposition and how to read it."""

    name: str
    kind: str  # "engine", "router" or "cache" (a KV cache store the engines ask, such as LMCache's)
    detect: Callable[[Exposition], int]  # 0: not this flavour; higher: more of its series present
    read: Callable[[Exposition, float], Snapshot]  # (exposition, scraped_at)


class Reader:
    """Reads one flavour's series from an exposition, noting the expected ones it could not find.

    Each read takes alternative names, preferred first (a current name, then its deprecated one);
    when none is present the preferred name goes to `missing`, unless the series is optional. The first
    present one with an invalid sample reads as absent and goes to `invalid`: never a made-up number.
    Values are summed over label sets: one exposition is one replica, whatever its engines, ranks,
    models or streaming modes.
    """

    def __init__(self, exposition: Exposition) -> None:
        self.exposition = exposition
        self.missing: list[str] = []
        self.invalid: dict[str, str] = {}

    def total(self, *names: str, optional: bool = False, duplicated_by: tuple[str, ...] = ()) -> float | None:
        """The sum of a series over its label sets; 0 when declared without samples, None when absent.

        Samples that differ only in `duplicated_by` labels report the same thing (e.g. every tensor-
        parallel rank of one SGLang scheduler), so only one of each such group is counted.
        """
        values = self._values(names, optional, duplicated_by)
        return None if values is None else sum(values)

    def maximum(self, name: str, optional: bool = False) -> float | None:
        """The largest value of a gauge over its label sets (the worst rank's lag, say); None when absent
        or declared without samples."""
        found = self._pick((name,), optional)
        values = [sample.value for sample in self.exposition.samples[found]] if found else []
        return max(values) if values else None

    def fraction(
        self, *names: str, duplicated_by: tuple[str, ...] = (), no_data: float | None = None
    ) -> float | None:
        """The mean over label sets of a gauge from 0 to 1, such as KV-cache usage of several engines.

        A sample outside [0, 1] (but `no_data`, an engine's own word for "nothing to say") is no
        fraction: the series reads as absent and goes to `invalid`, never as -50 % or 300 %."""
        found = self._pick(names, optional=False)
        values = [] if found is None else self._grouped(found, duplicated_by)
        if (wrong := next((v for v in values if not 0 <= v <= 1 and v != no_data), None)) is not None:
            self.invalid[found] = floatToGoString(wrong)
            return None
        return sum(values) / len(values) if values else None

    def by_label(self, name: str, label: str, optional: bool = False) -> dict[str, float]:
        """A series summed per value of one label, e.g. requests per `worker`."""
        found = self._pick((name,), optional)
        totals: dict[str, float] = defaultdict(float)
        for sample in self.exposition.samples[found] if found else ():
            totals[sample.labels.get(label, "")] += sample.value
        return dict(totals)

    def label_values(self, name: str, label: str, optional: bool = False) -> set[str] | None:
        """The values one label takes in a series, e.g. every `worker` a router knows."""
        found = self._pick((name,), optional)
        if found is None:
            return None
        return {sample.labels[label] for sample in self.exposition.samples[found] if label in sample.labels}

    def histogram(self, name: str, optional: bool = False) -> Buckets | None:
        """A histogram's buckets summed over label sets, matching `le` numerically ("1" == "1.0")."""
        bucket = f"{name}_bucket"
        found = self._pick((bucket,), optional, report=name)
        if found is None:
            return None
        counts: dict[float, float] = defaultdict(float)
        for sample in self.exposition.samples[found]:
            if "le" not in sample.labels:
                raise ValueError(f"a {bucket} sample has no le label")
            counts[float(sample.labels["le"])] += sample.value
        return tuple(sorted(counts.items()))

    def _values(self, names: tuple[str, ...], optional: bool, duplicated_by: tuple[str, ...]) -> list | None:
        found = self._pick(names, optional)
        return None if found is None else self._grouped(found, duplicated_by)

    def _grouped(self, found: str, duplicated_by: tuple[str, ...]) -> list[float]:
        """One value per label set, but for the `duplicated_by` labels."""
        groups: dict[tuple, float] = {}
        for sample in self.exposition.samples[found]:
            key = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in duplicated_by))
            groups.setdefault(key, sample.value)
        return list(groups.values())

    def _pick(self, names: tuple[str, ...], optional: bool, report: str | None = None) -> str | None:
        for name in names:
            if name in self.exposition.invalid:
                self.invalid[name] = self.exposition.invalid[name]
                return None
            if self.exposition.has(name):
                return name
        if not optional:
            self.missing.append(report or names[0])
        return None


def prefix_caching(reader: Reader, name: str, optional: bool = False) -> bool | None:
    """Whether the engine's cache_config_info says prefix caching is on (for every engine it lists)."""
    values = reader.label_values(name, "enable_prefix_caching", optional)
    return all(value.lower() == "true" for value in values) if values else None
