"""Recording rules: generated from collectors/queries.py, valid for promtool, and unit-tested by it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from collectors import generate, queries
from conftest import REPO

RULE_FILES = sorted((REPO / "prometheus" / "rules").glob("*.yml")) + sorted(
    (REPO / "alerts").glob("*.rules.yml")
)
TEST_FILES = sorted((REPO / "prometheus" / "tests").glob("*-test.yml")) + sorted(
    (REPO / "alerts" / "tests").glob("*-test.yml")
)


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: `make bootstrap` installs Debian's prometheus package"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_generated_rule_files_are_up_to_date():
    for relative, text in generate.generated_files().items():
        assert (REPO / relative).read_text() == text, f"{relative} is stale: run `make generate`"


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_accepts_the_rules(path: Path):
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_every_rules_file_has_a_promtool_test_file(path: Path):
    assert any(path.name in test.read_text() for test in TEST_FILES), f"no promtool test loads {path.name}"


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(path: Path):
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_recording_rule_is_exercised_by_a_unit_test():
    tested = "\n".join(path.read_text() for path in TEST_FILES)
    for rule in queries.RECORDING_RULES:
        assert rule.record in tested, f"{rule.record} has no promtool test"
