"""A day of a cluster's history as Prometheus and kvwatch would have kept it: an engine fleet's and kvwatch's
exporter's scrapes as OpenMetrics (for `promtool tsdb create-blocks-from openmetrics`), the probe sessions
for the store, and the recording rules in the order promtool can backfill them."""

from __future__ import annotations

import math
import random
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.lab.flavours import vllm_legacy
from kvwatch.prometheus.rules import Rule
from kvwatch.serve.exporter import ProbeCollector, ProbeResults

DAY = 86400
PROMPT_TOKENS_PER_REQUEST = 2048
Scrape = tuple[float, dict[str, str], Iterable[Metric]]  # when, the target's labels, what it exported


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def write_openmetrics(path: Path, scrapes: Iterable[Scrape]) -> int:
    """The scrapes as one OpenMetrics file, each family's samples together as the format requires (a
    scrape interleaves families); every sample carries its scrape's time and target labels. Returns the
    number of samples written."""
    written = 0
    with tempfile.TemporaryDirectory() as parts:
        families: dict[str, tuple[str, object]] = {}  # name -> (type, its part file)
        try:
            for at, target, exported in scrapes:
                for family in exported:
                    if family.name not in families:
                        part = (Path(parts) / f"{len(families)}.om").open("w")
                        families[family.name] = (family.type, part)
                    part = families[family.name][1]
                    for sample in family.samples:
                        labels = ",".join(
                            f'{k}="{_escape(v)}"' for k, v in {**target, **sample.labels}.items()
                        )
                        part.write(f"{sample.name}{{{labels}}} {sample.value!r} {at:.3f}\n")
                        written += 1
        finally:
            for _, part in families.values():
                part.close()
        with path.open("w") as out:
            for name, (kind, part) in families.items():
                out.write(f"# TYPE {name} {kind}\n")
                out.write(Path(part.name).read_text())
            out.write("# EOF\n")
    return written


class Fleet:
    """vLLM V1 replicas (>= 0.16 names) with traffic that follows the day: each replica its own request
    rate, prefix-cache hit ratio and TTFT, and its cached tokens split by source. Counters add each
    interval's increments, so that they never fall as the ratios move."""

    def __init__(self, replicas: int, base_port: int = 20000):
        self.addresses = [f"127.0.0.1:{base_port + i}" for i in range(replicas)]
        self.targets = [
            {"job": "replicas", "instance": address, "replica": f"r{i + 1}", "flavour": "vllm"}
            for i, address in enumerate(self.addresses)
        ]
        self.totals = [[0.0] * (4 + len(vllm_legacy.TTFT_BUCKETS)) for _ in self.addresses]

    @staticmethod
    def hit_ratio(replica: int, at: float) -> float:
        return 0.55 + 0.3 * (replica % 5) / 4 + 0.05 * math.sin(2 * math.pi * at / DAY)

    @staticmethod
    def request_rate(replica: int, at: float) -> float:
        return (1.5 + replica % 3) * (1.2 + math.sin(2 * math.pi * at / DAY))

    def advance(self, replica: int, at: float, seconds: float) -> None:
        """Add `seconds` of traffic ending at `at`: requests, prompt tokens, hits, TTFT sum and buckets."""
        requests = self.request_rate(replica, at) * seconds
        ratio = self.hit_ratio(replica, at)
        median = 0.05 + 0.2 * (1 - ratio)  # less reuse, longer prefills
        below = [
            0.5 * math.erfc(-math.log(bound / median) / (0.6 * math.sqrt(2)))
            for bound in vllm_legacy.TTFT_BUCKETS
        ]
        prompt = requests * PROMPT_TOKENS_PER_REQUEST
        added = [requests, prompt, prompt * ratio, requests * median * 1.2, *(requests * b for b in below)]
        self.totals[replica] = [total + more for total, more in zip(self.totals[replica], added, strict=True)]

    def exported(self, replica: int) -> list[Metric]:
        requests, prompt, hits, ttft_sum, *buckets = self.totals[replica]

        def counter(name: str, value: float, **labels: str) -> CounterMetricFamily:
            family = CounterMetricFamily(name, "", labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        by_source = CounterMetricFamily("vllm:prompt_tokens_cached_by_source", "", labels=["source"])
        by_source.add_metric(["device"], 0.9 * hits)
        by_source.add_metric(["host"], 0.1 * hits)
        ttft = HistogramMetricFamily("vllm:time_to_first_token_seconds", "")
        bounds = [
            (repr(bound), count) for bound, count in zip(vllm_legacy.TTFT_BUCKETS, buckets, strict=True)
        ]
        ttft.add_metric([], [*bounds, ("+Inf", requests)], ttft_sum)
        config = GaugeMetricFamily("vllm:cache_config_info", "", labels=["enable_prefix_caching"])
        config.add_metric(["True"], 1)
        return [
            GaugeMetricFamily("up", "", value=1),
            counter("vllm:request_success", requests, finished_reason="stop"),
            counter("vllm:prompt_tokens", prompt),
            counter("vllm:prefix_cache_queries", prompt),
            counter("vllm:prefix_cache_hits", hits),
            counter("vllm:prompt_tokens_cached", hits),
            by_source,
            ttft,
            GaugeMetricFamily("vllm:num_requests_running", "", value=self.request_rate(replica, 0)),
            config,
        ]

    def scrapes(self, start: float, end: float, interval: float) -> Iterator[Scrape]:
        at = start
        while at <= end:
            for replica, target in enumerate(self.targets):
                self.advance(replica, at, interval)
                yield at, target, self.exported(replica)
            at += interval


ROUTES = (("lab-affinity", "affinity"), ("lab-round-robin", "round_robin"))


def probe_runs(
    backends: list[str], start: float, end: float, interval: float, sessions: int = 2, rounds: int = 6
) -> Iterator[tuple[float, tuple[str, str], list[SessionResult]]]:
    """Probe runs of both lab routes every `interval`, as the scheduler makes them: the affinity route
    keeps a session on one replica and reuses its history; round robin moves it and recomputes it all.
    One round in a hundred times out. Yields (finished at, route, sessions)."""
    rng = random.Random(0)
    at = start
    while at + interval <= end:
        for target, mode in ROUTES:
            sticky = mode == "affinity"
            results = []
            for _ in range(sessions):
                home, clock, done = rng.choice(backends), at + rng.random(), []
                for number in range(1, rounds + 1):
                    prompt, history = 600 + 300 * number, 600 + 300 * (number - 1) if number > 1 else 0
                    cached = int(history * 0.95) if sticky else rng.choice((0, 0, 0, history // 2))
                    ttft = (0.04 + 0.0001 * (prompt - cached)) * rng.lognormvariate(0, 0.15)
                    failed = rng.random() < 0.01
                    done.append(
                        RoundResult(
                            number, clock, None if failed else 200, "timeout" if failed else None,
                            "no answer within 60 s" if failed else None, None if failed else ttft,
                            None if failed else ttft + 0.3, None if failed else prompt,
                            None if failed else cached, history, None if failed else 40,
                            home if sticky else rng.choice(backends), f"s{at:.0f}", f"s{at:.0f}",
                        )
                    )  # fmt: skip
                    clock += ttft + 0.3
                    if failed:
                        break
                results.append(SessionResult(target, mode, f"s{at:.0f}", at, clock, tuple(done)))
            yield at + interval / 2, (target, mode), results
        at += interval


def exporter_scrapes(
    runs: Iterable[tuple[float, tuple[str, str], list[SessionResult]]], end: float, interval: float
) -> Iterator[Scrape]:
    """kvwatch's exporter scraped every `interval` while the runs finish (runs in finishing order)."""
    results = ProbeResults()
    collector = ProbeCollector(results, {target: interval for target, _ in ROUTES})
    target = {"job": "kvwatch", "instance": "127.0.0.1:18004"}
    pending = iter(runs)
    upcoming = next(pending, None)
    at = upcoming[0] if upcoming else end
    while at <= end:
        while upcoming and upcoming[0] <= at:
            finished, route, sessions = upcoming
            results.add_run(route, sessions, min(s.started_at for s in sessions), finished)
            upcoming = next(pending, None)
        yield at, target, list(collector.collect())
        at += interval


def backfill_order(rules: Iterable[Rule]) -> list[list[Rule]]:
    """The recording rules in passes: promtool backfills a rule only from series already stored, so a
    rule that reads another recorded series comes one pass after it."""
    rules = list(rules)
    names = {rule.record for rule in rules}
    reads = {
        rule.record: {
            name for name in names if re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", rule.expr)
        }
        for rule in rules
    }
    depth: dict[str, int] = {}

    def depth_of(name: str) -> int:
        if name not in depth:
            depth[name] = 1 + max((depth_of(read) for read in reads[name] - {name}), default=-1)
        return depth[name]

    passes: list[list[Rule]] = [[] for _ in range(1 + max(map(depth_of, names), default=-1))]
    for rule in rules:
        passes[depth_of(rule.record)].append(rule)
    return passes
