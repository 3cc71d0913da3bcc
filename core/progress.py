"""A progress line on stderr for the commands that run for minutes: `probe`, `experiment`, `doctor`."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}:{seconds:02d}"


class Progress:
    """`kvwatch probe: 3/10 sessions, 0:12 elapsed, ETA 0:28`, rewritten in place and cleared at the end.

    Only for a person at a terminal: on a pipe, in a log or with --json the output stays the result alone.
    The total is told by `start`, from the run that knows it (a ShareGPT file may hold fewer sessions).
    """

    def __init__(
        self,
        command: str,
        unit: str,
        *,
        shown: bool,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.command, self.unit, self.shown = command, unit, shown
        self.stream = stream or sys.stderr
        self.clock = clock
        self.total = self.done = 0
        self.started = clock()

    @classmethod
    def on_terminal(cls, command: str, unit: str, *, json: bool) -> Progress:
        """Shown when stderr is a terminal and the output is not JSON."""
        return cls(command, unit, shown=not json and sys.stderr.isatty())

    def line(self) -> str:
        elapsed = self.clock() - self.started
        eta = _clock(elapsed / self.done * (self.total - self.done)) if self.done else "-"
        return (
            f"kvwatch {self.command}: {self.done}/{self.total} {self.unit}, "
            f"{_clock(elapsed)} elapsed, ETA {eta}"
        )

    def start(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, self.clock()
        self._draw()

    def advance(self, *_finished: object) -> None:
        """One more done; takes and ignores what finished, so that it can be any callback."""
        self.done += 1
        self._draw()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_exception: object) -> None:
        if self.total:
            self._write("\r\033[K")  # the line goes: the report follows on a clean line

    def _draw(self) -> None:
        self._write(f"\r{self.line()}\033[K")

    def _write(self, text: str) -> None:
        if self.shown:
            self.stream.write(text)
            self.stream.flush()
