"""The gateway-log sources benchmark runs end to end on a few lines: every source's receiver takes every
line its sender sent, and the table has a row per source (no timing is checked: numbers depend on the
machine)."""

from __future__ import annotations

from benchmarks.bench_gatewaylog_sources import SOURCES, measure, table

LINES = 300


def test_each_source_takes_every_line_and_has_its_row():
    baselines, rows = measure(LINES)  # raises unless every receiver took LINES lines, none malformed
    assert [row.source for row in rows] == list(SOURCES)
    assert all(row.lines_per_cpu_second > 0 for row in rows)
    assert set(baselines) == {"nginx", "envoy"}
    printed = table(baselines, rows, LINES).splitlines()
    assert [line.split(" | ")[0].removeprefix("| ") for line in printed[4:]] == list(SOURCES)
