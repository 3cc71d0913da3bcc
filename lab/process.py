"""What the lab starts: a command line, its environment and how to tell that it serves."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Process:
    name: str
    argv: list[str]
    ready_url: str | None
    env: dict[str, str] = field(default_factory=dict)  # added to the lab's own environment
    ready_timeout_s: float = READY_TIMEOUT_S


def kvwatch_command(*args: str) -> list[str]:
    """kvwatch itself, run by the interpreter the lab runs in."""
    return [sys.executable, "-m", "collectors.cli", *args]


class LabError(RuntimeError):
    """Something the user can act on; the CLI prints it without a traceback."""
