"""`kvwatch --help` lists the subcommands and every subcommand has its own --help."""

import argparse
import tomllib

import pytest

from collectors.cli import build_parser, main
from conftest import REPO


def subcommand_paths(parser: argparse.ArgumentParser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from subcommand_paths(sub, (*prefix, name))


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "lab" in capsys.readouterr().out


@pytest.mark.parametrize("path", list(subcommand_paths(build_parser())), ids=" ".join)
def test_every_subcommand_has_help(path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*path, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvwatch " + " ".join(path))


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out == f"kvwatch {project['version']}\n"
