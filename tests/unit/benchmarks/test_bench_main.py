"""`python -m benchmarks`: its help names every benchmark with what it measures, and it runs those named."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from benchmarks.__main__ import main
from paths import REPO

BENCHMARKS = sorted((REPO / "benchmarks").glob("bench_*.py"))


def summary_line(path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())).splitlines()[0]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_each_benchmark_with_its_docstring_and_exits_0(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        main([flag])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("usage: python -m benchmarks ")
    for path in BENCHMARKS:
        name = path.stem.removeprefix("bench_")
        assert any(line.split() == [name, *summary_line(path).split()] for line in lines), (name, lines)
    assert "`make bench` runs them all" in lines[-1]


def test_the_module_exits_0_on_help():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m benchmarks ")


def test_a_name_no_benchmark_has_exits_2_naming_the_known_ones(capsys):
    assert main(["nope"]) == 2
    printed = capsys.readouterr().out
    assert printed.startswith("no benchmark matches ['nope']; known: dashboard, detection, ")
