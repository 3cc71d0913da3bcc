"""The progress line of `probe`, `experiment` and `doctor`: on a terminal only, never with --json or piped."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pty
import sys
from collections.abc import Iterator

import pytest
from loopback import QuietHandler, loopback_http

from kvwatch.cli.main import main
from kvwatch.core.progress import Progress
from kvwatch.doctor.checks import CHECKS
from paths import REPO
from processes import free_port

USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
STREAM = "".join(
    f"data: {event}\n\n"
    for event in (
        '{"choices": [{"delta": {"role": "assistant", "content": "hello"}}]}',
        json.dumps({"choices": [], "usage": USAGE}),
        "[DONE]",
    )
).encode()
WORKLOAD = ["--rounds", "2", "--system-tokens", "20", "--turn-tokens", "5", "--max-tokens", "2"]
# Each command's arguments but the route, and what it counts. The experiment's route refuses every
# connection: its sessions fail quickly, and nothing is drawn.
COMMANDS = {
    "probe": (["probe", "--sessions", "2", *WORKLOAD, "--base-url"], "2 sessions"),
    "experiment": (
        [
            "experiment",
            "--model",
            "m",
            "--sessions",
            "1",
            *WORKLOAD,
            "--out",
            "{out}",
            "--b",
            "{closed}",
            "--a",
        ],
        "2 sessions",
    ),
    "doctor": (["doctor", "--base-url"], f"{CHECKS} checks"),
}


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """One model, streamed answers of one token: a route the commands go through in moments."""

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            self.answer(200, json.dumps({"data": [{"id": "m"}]}).encode())

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/chat/completions":
                self.answer(200, STREAM, "text/event-stream")
            else:
                self.answer(404, b"not found", "text/plain")

    with loopback_http(Handler) as url:
        yield url


def command_line(name: str, url: str, tmp_path) -> list[str]:
    args, _ = COMMANDS[name]
    closed = f"http://127.0.0.1:{free_port()}"
    route = closed if name == "experiment" else url
    return [arg.format(out=tmp_path / "out", closed=closed) for arg in args] + [route]


def on_a_terminal(args: list[str]) -> tuple[int, str]:
    """`kvwatch ARGS` with stderr on a pseudo-terminal (stdout piped): its exit code and what the
    terminal showed."""

    async def run() -> int:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvwatch.cli.main", *args, cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL, stderr=terminal,
        )  # fmt: skip
        return await asyncio.wait_for(process.wait(), timeout=60)

    control, terminal = pty.openpty()
    try:
        code = asyncio.run(run())
    finally:
        os.close(terminal)
    shown = b""
    try:
        while chunk := os.read(control, 4096):  # EIO once the terminal is closed and read empty
            shown += chunk
    except OSError:
        pass
    finally:
        os.close(control)
    return code, shown.decode()


def pretend_a_terminal(monkeypatch) -> None:
    """The captured stderr is a terminal as far as the commands can tell (pytest swaps the capture
    object between a fixture and the test, so each test calls this itself)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


def test_the_line_counts_elapsed_time_and_an_eta_and_goes_at_the_end():
    now, stream = [100.0], io.StringIO()
    with Progress("probe", "sessions", shown=True, stream=stream, clock=lambda: now[0]) as progress:
        progress.start(4)
        now[0] += 10
        progress.advance()
    assert stream.getvalue().split("\r") == [
        "",
        "kvwatch probe: 0/4 sessions, 0:00 elapsed, ETA -\033[K",
        "kvwatch probe: 1/4 sessions, 0:10 elapsed, ETA 0:30\033[K",
        "\033[K",
    ]


def shows_progress(name: str, shown: str) -> bool:
    done, unit = COMMANDS[name][1].split()
    steps = [f"\rkvwatch {name}: {n}/{done} {unit}, " for n in range(int(done) + 1)]
    cleared = shown.rfind("\r\033[K") > shown.rfind(steps[-1])  # the line goes before what follows
    return all(step in shown for step in steps) and cleared


def test_progress_on_a_pseudo_terminal_and_none_with_json(engine, tmp_path):
    code, shown = on_a_terminal(command_line("probe", engine, tmp_path))
    assert code == 0 and shows_progress("probe", shown), shown
    assert "kvwatch probe: 0/2 sessions, 0:00 elapsed, ETA -" in shown
    code, shown = on_a_terminal([*command_line("probe", engine, tmp_path), "--json"])
    assert code == 0 and shown == f"kvwatch probe: model m, the one {engine}/v1/models lists\r\n"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_long_command_shows_progress_on_a_terminal(engine, name, tmp_path, capsys, monkeypatch):
    pretend_a_terminal(monkeypatch)
    main(command_line(name, engine, tmp_path))
    assert shows_progress(name, capsys.readouterr().err)


@pytest.mark.parametrize("name", ["probe", "doctor"])
def test_no_progress_with_json(engine, name, tmp_path, capsys, monkeypatch):
    pretend_a_terminal(monkeypatch)
    main([*command_line(name, engine, tmp_path), "--json"])
    assert capsys.readouterr().err == f"kvwatch {name}: model m, the one {engine}/v1/models lists\n"


@pytest.mark.parametrize("name", COMMANDS)
def test_no_progress_when_stderr_is_no_terminal(engine, name, tmp_path, capsys):
    main(command_line(name, engine, tmp_path))
    assert "elapsed, ETA" not in capsys.readouterr().err
