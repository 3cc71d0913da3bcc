"""`kvwatch completion bash`: the script, sourced in a real bash, completes what kvwatch's parser has."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from kvwatch.cli.completion import script
from kvwatch.cli.main import build_parser
from kvwatch.lab.stack import FAULTS


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("completion") / "kvwatch.bash"
    path.write_text(script(build_parser(), "bash"))
    return path


def bash(bash_script: Path, commands: str, cwd: Path | None = None) -> str:
    result = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", f"source {shlex.quote(str(bash_script))}\n{commands}"],
        capture_output=True, text=True, timeout=10, cwd=cwd,
    )  # fmt: skip
    assert result.returncode == 0 and not result.stderr, result.stderr
    return result.stdout


def completions(bash_script: Path, line: str, cwd: Path | None = None) -> list[str]:
    """What bash offers for the last word of `line` (empty after a trailing space), as at a Tab."""
    words = line.split(" ")
    return bash(
        bash_script,
        f"COMP_WORDS=({' '.join(map(shlex.quote, words))}); COMP_CWORD={len(words) - 1}; _kvwatch\n"
        'printf "%s\\n" "${COMPREPLY[@]}"',
        cwd,
    ).split()


def test_the_script_registers_its_function_for_kvwatch(bash_script):
    assert bash(bash_script, "complete -p kvwatch") == "complete -F _kvwatch kvwatch\n"


@pytest.mark.parametrize(
    ("line", "offered"),
    [
        ("kvwatch ", ["init", "lab", "scrape", "probe", "config", "serve", "experiment", "doctor",
                      "dashboard", "generate", "completion"]),
        ("kvwatch l", ["lab"]),
        ("kvwatch lab ", ["up", "down", "status", "fault", "heal", "replica", "traffic"]),
        ("kvwatch lab fault ", list(FAULTS)),
        ("kvwatch lab up --eng", ["--engine"]),
        ("kvwatch lab up --engine ", ["sim", "vllm"]),
        ("kvwatch lab up --fast --gateway e", ["envoy"]),
        ("kvwatch lab status --j", ["--json"]),
        ("kvwatch --v", ["--version"]),
        ("kvwatch completion ", ["bash", "zsh"]),
        ("kvwatch lab up --replicas ", []),  # a value without choices: file names, none in an empty directory
    ],
)  # fmt: skip
def test_bash_completes_commands_options_and_choices(bash_script, tmp_path, line, offered):
    assert sorted(completions(bash_script, line, cwd=tmp_path)) == sorted(offered)


def test_an_option_without_choices_completes_file_names(bash_script, tmp_path):
    (tmp_path / "lab-a").mkdir()
    (tmp_path / "other").touch()
    assert completions(bash_script, f"kvwatch lab status --state-dir {tmp_path}/la") == [f"{tmp_path}/lab-a"]
