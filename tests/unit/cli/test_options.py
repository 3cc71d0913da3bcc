"""A command refuses a bad option before any request: exit 2 and one line that names the option."""

from __future__ import annotations

import pytest

from kvwatch.cli.main import main

MODEL = "lab-model"
UNSET = "KVW_UNSET_VARIABLE"
# Each command with all it needs but the option under test; {tmp} is the test's directory.
COMMANDS = {
    "probe": ["probe", "--base-url", "http://127.0.0.1:1", "--model", MODEL],
    "experiment": ["experiment", "--a", "http://127.0.0.1:1", "--b", "http://127.0.0.1:2", "--out", "{tmp}"],
    "doctor": ["doctor", "--base-url", "http://127.0.0.1:1", "--model", MODEL],
    "lab traffic": ["lab", "traffic", "--url", "http://127.0.0.1:1"],
}
# The block size and engine metrics options that probe, experiment and doctor share (cli/options.py).
SHARED = [
    (["--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["--block-size", "2097152"], "--block-size must be <= 1048576 (1 << 20), got 2097152"),
    (["--metrics-url", "127.0.0.1:8000/metrics"], "--metrics-url must start with http:// or https://"),
    (["--prometheus", "prometheus:9090"], "--prometheus must start with http:// or https://"),
    (
        ["--prometheus", "http://kvw:pw@h:99999"],
        "--prometheus http://kvw:[redacted]@h:99999 is not a valid URL: port 99999 is not 1 to 65535",
    ),
]
OWN = [
    ("doctor", ["--prometheus", "127.0.0.1:9090"], "--prometheus must start with http:// or https://"),
    (
        "doctor",
        ["--requests-sample", "/nonexistent.jsonl"],
        "--requests-sample /nonexistent.jsonl: no such file",
    ),
    ("doctor", ["--api-key-env", UNSET], f"environment variable {UNSET} is not set or empty"),
    ("doctor", ["--timeout", "0"], "timeout_seconds must be positive"),
    ("doctor", ["--cluster", "a"], "--cluster names a cluster in --prometheus: give --prometheus too"),
    ("doctor", ["--prometheus", "http://127.0.0.1:9", "--cluster", ""], "the cluster needs a name"),
    (
        "doctor",
        ["--prometheus", "http://127.0.0.1:9", "--cluster", "a", "--cluster-label", "a-b"],
        'the cluster label must be a Prometheus label name (letters, digits and _, not starting with "__"), '
        'got "a-b"',
    ),
    ("lab traffic", ["--users", "0"], "--users must be positive"),
    ("lab traffic", ["--rounds", "-1"], "--rounds must be positive"),
    ("lab traffic", ["--think", "-0.5"], "--think must not be negative"),
    ("lab traffic", ["--max-tokens", "0"], "--max-tokens must be positive"),
    ("lab traffic", ["--url", "127.0.0.1:18000"], "--url must start with http:// or https://"),
]
CASES = [*((command, *case) for command in ("probe", "experiment", "doctor") for case in SHARED), *OWN]


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    CASES,
    ids=[f"{command} {' '.join(flags)}" for command, flags, _ in CASES],
)
def test_a_bad_option_exits_2_naming_it(command, flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    args = [arg.format(tmp=tmp_path) for arg in COMMANDS[command]]
    assert main([*args, *flags]) == 2
    assert capsys.readouterr().err == f"kvwatch {command}: {message}\n"
