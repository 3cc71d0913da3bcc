"""`kvwatch --help` lists the subcommands and every subcommand has its own --help."""

import argparse
import errno
import os
import sys
import tomllib
from pathlib import Path

import pytest

from kvwatch.cli.main import EXIT_CODES, build_parser, main, runnable_commands
from kvwatch.cli.options import kvwatch_command
from paths import REPO


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


def test_every_command_says_what_its_exit_codes_mean():
    commands = runnable_commands(build_parser())
    assert sorted(commands) == sorted(EXIT_CODES)  # none left out, none that no longer exists
    for path, command in commands.items():
        shown = " ".join(command.format_help().split())
        assert shown.endswith(f"Exit codes: {EXIT_CODES[path]}.") and " 0 " in shown, path


def test_the_command_suggested_for_a_new_shell_is_the_path_unless_kvwatch_on_path_is_this_one(monkeypatch):
    installed = str((Path(sys.executable).parent / "kvwatch").absolute())
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    assert kvwatch_command() == installed  # `make up`: the virtualenv's kvwatch, not on PATH
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")
    assert kvwatch_command() == "kvwatch"  # installed on PATH, e.g. by pipx
    monkeypatch.setenv("VIRTUAL_ENV", str(Path(sys.executable).parent.parent))
    assert kvwatch_command() == installed  # an activated virtualenv is not active in a new shell


@pytest.mark.parametrize(
    ("source", "gateway", "wanted"), [("syslog", "envoy", "nginx"), ("otlp", "nginx", "envoy")]
)
def test_a_lab_log_source_with_a_gateway_that_cannot_send_it_is_refused(
    source, gateway, wanted, tmp_path, capsys
):
    arguments = [
        "lab",
        "up",
        "--gateway",
        gateway,
        "--gateway-log-source",
        source,
        "--state-dir",
        str(tmp_path),
    ]
    assert main(arguments) != 0
    expected = f"--gateway-log-source {source} is for --gateway {wanted}, not {gateway}"
    assert expected in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        (
            "SSL_CERT_FILE",
            "missing.pem",
            f"cannot be read as the CAs kvwatch trusts: {os.strerror(errno.ENOENT)}",
        ),
        (
            "SSL_CERT_FILE",
            "not-pem.txt",
            "holds no PEM certificate for kvwatch to trust",
        ),
        ("SSL_CERT_DIR", "missing", "is no directory of CA certificates"),
    ],
    ids=["missing-file", "not-a-certificate", "missing-directory"],
)
def test_a_ca_bundle_the_environment_names_but_kvwatch_cannot_read_stops_the_command_first(
    variable, value, said, tmp_path, monkeypatch, capsys
):
    (tmp_path / "not-pem.txt").write_text("not a certificate\n")
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv(variable, str(tmp_path / value))
    assert main(["scrape", "http://127.0.0.1:9/metrics"]) == 2
    output = capsys.readouterr()
    assert output.out == ""  # the scrape never ran
    assert output.err == f"kvwatch: {variable}={tmp_path / value} {said}\n"
