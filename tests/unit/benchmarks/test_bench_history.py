"""The dashboard benchmark's history: its OpenMetrics is what promtool backfills, and its recording
rules come in passes that read only what earlier passes stored."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from benchmarks.history import Fleet, backfill_order, write_openmetrics
from kvwatch.prometheus.rules import GATEWAY_RULES, RECORDING_RULES, ROUTER_RULES, Rule

TARGET = {"job": "replicas", "instance": "127.0.0.1:20000"}


def scrape(at: float, requests: float) -> tuple[float, dict, list]:
    counter = CounterMetricFamily("vllm:request_success", "", labels=["reason"])
    counter.add_metric(['st"op'], requests)
    histogram = HistogramMetricFamily("vllm:time_to_first_token_seconds", "")
    histogram.add_metric([], [("0.1", requests / 2), ("+Inf", requests)], requests * 0.2)
    return at, TARGET, [counter, GaugeMetricFamily("up", "", value=1), histogram]


def test_each_family_is_written_once_with_every_scrape_timed_and_labelled(tmp_path):
    path = tmp_path / "scrapes.om"
    written = write_openmetrics(path, [scrape(100, 4), scrape(130, 10)])
    target = 'job="replicas",instance="127.0.0.1:20000"'
    assert path.read_text().splitlines() == [
        "# TYPE vllm:request_success counter",
        f'vllm:request_success_total{{{target},reason="st\\"op"}} 4 100.000',
        f'vllm:request_success_total{{{target},reason="st\\"op"}} 10 130.000',
        "# TYPE up gauge",
        f"up{{{target}}} 1 100.000",
        f"up{{{target}}} 1 130.000",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        *(
            line
            for at, requests in ((100, 4), (130, 10))
            for line in (
                f'vllm:time_to_first_token_seconds_bucket{{{target},le="0.1"}} {requests / 2!r} {at}.000',
                f'vllm:time_to_first_token_seconds_bucket{{{target},le="+Inf"}} {requests} {at}.000',
                f"vllm:time_to_first_token_seconds_count{{{target}}} {requests} {at}.000",
                f"vllm:time_to_first_token_seconds_sum{{{target}}} {requests * 0.2!r} {at}.000",
            )
        ),
        "# EOF",
    ]
    assert written == 2 * (1 + 1 + 4)


@pytest.mark.integration  # runs promtool
def test_promtool_backfills_what_it_writes(tmp_path):
    fleet = Fleet(2)
    write_openmetrics(tmp_path / "scrapes.om", fleet.scrapes(1_800_000_000, 1_800_000_600, 30))
    data = tmp_path / "data"
    (data / "wal").mkdir(parents=True)  # promtool tsdb dump reads a write-ahead log too
    run = ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(tmp_path / "scrapes.om"), str(data)]
    subprocess.run(run, check=True, capture_output=True, timeout=60)
    dumped = subprocess.run(
        ["promtool", "tsdb", "dump", str(data)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    prompts = [
        line for line in dumped.splitlines() if line.startswith('{__name__="vllm:prompt_tokens_total"')
    ]
    assert len(prompts) == 2 * 21  # both replicas, every 30 s of the 10 minutes


def test_the_fleets_counters_never_fall_while_its_ratios_move():
    fleet = Fleet(3)
    totals = [
        [s.value for f in exported for s in f.samples] for _, _, exported in fleet.scrapes(0, 86400, 3600)
    ]
    per_replica = [totals[i::3] for i in range(3)]
    for scrapes in per_replica:
        assert all(
            b >= a
            for earlier, later in zip(scrapes, scrapes[1:], strict=False)
            for a, b in zip(earlier, later, strict=True)
        )


def test_each_recording_rule_is_backfilled_after_the_rules_it_reads():
    rules = (*RECORDING_RULES, *GATEWAY_RULES, *ROUTER_RULES)
    passes = backfill_order(rules)
    assert sorted(r.record for p in passes for r in p) == sorted(r.record for r in rules)
    done: set[str] = set()
    for rules_of_pass in passes:
        recorded = {r.record for r in rules_of_pass}
        for rule in rules_of_pass:
            reads = {name for name in {r.record for r in rules} if name in rule.expr}
            assert reads - {rule.record} <= done, rule.record
        done |= recorded
    assert len(passes) == 4  # totals, hits, ratios, the routers' delivered per predicted


def test_a_name_that_only_starts_like_a_recorded_one_is_not_read():
    total = Rule("level:x:rate2m", "sum(rate(x[2m]))")
    ratio = Rule("level:x_per_y:ratio_rate2m", "level:x:rate2m / sum(rate(y[2m]))")
    raw = Rule("level:z:rate2m", "sum(rate(level:x:rate2m_total[2m]))")  # a metric named like a rule
    assert backfill_order([ratio, raw, total]) == [[raw, total], [ratio]]
