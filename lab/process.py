"""What the lab starts: a command line, its environment and how to tell that it serves."""

from __future__ import annotations

import contextlib
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvwatch.core.errors import KVWatchError

if TYPE_CHECKING:
    from kvwatch.lab.state import LabState

READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Process:
    name: str
    argv: list[str]
    ready_url: str | None
    env: dict[str, str] = field(default_factory=dict)  # added to the lab's own environment
    unset: tuple[str, ...] = ()  # taken out of the lab's own environment
    ready_timeout_s: float = READY_TIMEOUT_S
    ready_udp_port: int | None = None  # a server without HTTP serves once it holds this port on 127.0.0.1


def kvwatch_command(*args: str) -> list[str]:
    """kvwatch itself, run by the interpreter the lab runs in."""
    return [sys.executable, "-m", "kvwatch.cli.main", *args]


class LabError(KVWatchError, RuntimeError):
    """Something the user can act on; the CLI prints it without a traceback."""


def binary(name: str, fallback: str) -> str:
    found = shutil.which(name) or (fallback if Path(fallback).exists() else None)
    if not found:
        raise LabError(f"{name} is not installed (run `make bootstrap`, or apt-get install it)")
    return found


def is_ours(state: LabState, pid: int) -> bool:
    """True when `pid` is alive and still one of this lab's processes (not a recycled PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return status != "Z" and str(state.directory) in cmdline


def log_tail(state: LabState, name: str, lines: int = 15) -> str:
    """The end of logs/<name>.log."""
    log = state.directory / "logs" / f"{name}.log"
    with contextlib.suppress(FileNotFoundError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"
