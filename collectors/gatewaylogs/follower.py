"""The `file` source of a gateway log: follow the JSON access log a gateway writes, as `tail -F` does.

A scheduler job calls `GatewayLogFollower.poll()`; it reads what the gateway appended since the last call,
hands each line to the log's `SessionTally` (collectors/gatewaylogs/tally.py: what a line means is up to
the log's format, counting is the same for every source) and publishes an immutable `GatewayLogSnapshot`.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from kvwatch.collectors.gatewaylogs.creations import Creations
from kvwatch.collectors.gatewaylogs.tally import (
    UNREADABLE_REASONS,
    GatewayLogSnapshot,
    SessionTally,
    SourceState,
    by_reason,
)
from kvwatch.core.errors import KVWatchError

log = logging.getLogger("kvwatch.gatewaylog")

# A gateway's request line limit (nginx: 8 KiB by default) keeps real lines far shorter; a longer one is
# garbage and must not grow memory.
MAX_LINE_BYTES = 64 * 1024
# About 0.7 s of parsing (docs/benchmarks.md), so that a huge or endless log keeps neither
# the other logs nor a shutdown waiting; at one poll per 5 s it still follows ~3 MB/s per log.
MAX_BYTES_PER_POLL = 16 * 1024 * 1024
# Lines handed to the tally at once: a batch is counted for less than its lines one by one (tally.py), and
# this few keeps the tally's lock held briefly.
LINES_PER_BATCH = 256
# A file truncated in place (copytruncate) and written past the offset read up to by the next poll is
# told only by its first bytes, which an appended file keeps: a line or more of them.
HEAD_BYTES = 4096


class _NotARegularFile(KVWatchError, OSError):
    """A FIFO, socket or device: opening it may wait for a writer, reading it may never end."""


def unreadable_reason(error: OSError) -> str:
    """The reason of UNREADABLE_REASONS that an error opening or reading a log stands for."""
    for kind, reason in (
        (FileNotFoundError, "not_found"),
        (PermissionError, "permission_denied"),
        (IsADirectoryError, "is_directory"),
        (_NotARegularFile, "not_regular_file"),
    ):
        if isinstance(error, kind):
            return reason
    return "read_error"


def _open_regular_file(path: Path) -> BinaryIO:
    """Open `path` for reading unless it is not a regular file; never blocks, whatever it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(mode):
            raise _NotARegularFile("not a regular file (a FIFO, socket or device)")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _HeldFile:
    """A file of the log that the follower holds open: the one at the path, and renamed ones that the
    gateway may still write. Each keeps its own unfinished line, so that two files' lines are never joined."""

    __slots__ = ("file", "identity", "head", "pending", "skipping_long_line", "superseded")

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        status = os.fstat(file.fileno())
        self.identity = (status.st_dev, status.st_ino)
        self.head = b""  # the file's first bytes read, up to HEAD_BYTES: changed, it was truncated
        self.pending = b""  # the start of a line the gateway has not finished writing yet
        self.skipping_long_line = False
        self.superseded = False  # whether a newer file was held at the end of the last poll


class GatewayLogFollower:
    """Reads a gateway's JSON access log incrementally into its `tally` (a `SessionTally`, made from the
    counting options when none is given).

    Owns no thread: one scheduler job at a time calls `poll()`; any thread may read `latest`, an
    immutable snapshot that each poll swaps in whole. The file is followed as `tail -F` does: a new file
    at the path is opened by the poll that sees it and read from its start, and a renamed one is held
    open and read to its end for as long as the gateway may still write it (until a whole poll interval
    after the new file appeared brought nothing new), even once it is renamed over or deleted. A file
    created and rotated away between two polls is never seen: `Creations` counts it. A truncated file
    is read again from its start, and a missing file is not an error. Anything but a regular file is
    refused, and a poll reads at most `max_bytes_per_poll` of a log, so one log never stalls the others.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        name: str,
        *,
        max_bytes_per_poll: int = MAX_BYTES_PER_POLL,
        tally: SessionTally | None = None,
        clock: Callable[[], float] = time.time,
        **counting,
    ):
        self.tally = tally or SessionTally(name, clock=clock, **counting)
        self.path = Path(path)
        self.name = self.tally.name
        self.max_bytes_per_poll = max_bytes_per_poll
        self._clock = self.tally.clock
        self._held: list[_HeldFile] = []  # oldest first; the last one is the file at the path
        self._creations = Creations(self.path)
        self._unopened = 0  # files created at the path that no poll opened (one too few, for a while)
        self._rotated_unopened = 0  # the most `_unopened` was: a count that never goes down
        self._budget = 0  # bytes this poll may still read
        self._unread_bytes = 0
        self._problem: str | None = "not_polled"
        self._unreadable_polls: Counter[str] = Counter()
        self._polled_at = 0.0  # the clock's time when the current poll started
        self.latest = self._snapshot()

    def poll(self) -> GatewayLogSnapshot:
        """Read what was appended since the last poll and publish a new snapshot as `latest`."""
        self._polled_at = self._clock()
        try:
            self._follow()
        except OSError as error:
            reason = unreadable_reason(error)
            self._unreadable_polls[reason] += 1
            if reason != self._problem:  # logged once per change, not on every poll
                log.warning(
                    "gateway log %s: cannot read %s (%s: %s); kvwatch tries again on every poll",
                    self.name, self.path, reason, error.strerror or error,
                )  # fmt: skip
            self._problem = reason
        else:
            if self._problem not in (None, "not_polled"):
                log.info("gateway log %s: reading %s again", self.name, self.path)
            self._problem = None
        self.latest = self._snapshot()
        return self.latest

    def close(self) -> None:
        for held in self._held:
            held.file.close()
        self._held = []
        self._creations.close()

    def __enter__(self) -> GatewayLogFollower:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- reading ----------------------------------------------------------------------------------

    def _follow(self) -> None:
        self._budget, self._unread_bytes = self.max_bytes_per_poll, 0
        try:
            self._count_created_files()  # before the path is opened: a file created since is counted later
            self._hold_new_file()
        finally:  # a path that cannot be opened (now) keeps no held file from being read
            self._read_held_files()

    def _count_created_files(self) -> None:
        """Files created at the path that no poll opened were rotated away unread: count them. A file
        created between this count and the open below is opened before it is counted, so the count lags
        by at most one file until the next poll, and never counts a file that was read."""
        created = self._creations.take()
        if created is None:
            return
        if self._creations.started:  # the file already there is opened like a new one, and counted so
            self._unopened = self._rotated_unopened + self._new_file_at_path()
        self._unopened += created

    def _new_file_at_path(self) -> bool:
        """Whether the path names a file none of the held ones is: the log was rotated."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:  # while it names none, the gateway may still write the renamed file
            return False
        return (current.st_dev, current.st_ino) not in {held.identity for held in self._held}

    def _hold_new_file(self) -> None:
        """Open the file at the path as soon as a poll sees it, so that it stays readable (and is read to
        its end) whatever happens to the path before the next poll."""
        if not self._held or self._new_file_at_path():  # nothing held: a missing file is not_found
            self._held.append(_HeldFile(_open_regular_file(self.path)))
            self._unopened -= 1
        self._rotated_unopened = max(self._rotated_unopened, self._unopened)

    def _read_held_files(self) -> None:
        """Read the held files, oldest first. The gateway writes a renamed file until it reopens its log,
        which can be after the new file appeared (logrotate's `create`): a renamed one is let go once a
        whole poll brought nothing new to it."""
        still_held = []
        for held in self._held:
            quiet = self._read(held)
            if quiet and held.superseded:
                self._take_partial_line(held)
                held.file.close()
            else:
                held.superseded = held is not self._held[-1]
                still_held.append(held)
        self._held = still_held

    def _read(self, held: _HeldFile) -> bool:
        """Read to the end of the file or of this poll's byte budget; whether it had nothing new."""
        if self._truncated(held):
            self._take_partial_line(held)
            held.file.seek(0)
            held.head = b""
        start = held.file.tell()
        at_end = self._read_lines(held)
        fd = held.file.fileno()
        if len(held.head) < HEAD_BYTES:
            held.head = os.pread(fd, min(HEAD_BYTES, held.file.tell()), 0)
        self._unread_bytes += max(0, os.fstat(fd).st_size - held.file.tell())
        return at_end and held.file.tell() == start

    @staticmethod
    def _truncated(held: _HeldFile) -> bool:
        """Shorter than what was read, or (copytruncate, then written again) not the same first bytes."""
        fd = held.file.fileno()
        return os.fstat(fd).st_size < held.file.tell() or os.pread(fd, len(held.head), 0) != held.head

    def _read_lines(self, held: _HeldFile) -> bool:
        """Take the lines from where `held` was read up to; whether its end came before the budget's.
        They reach the tally LINES_PER_BATCH at a time, which counts a batch for less than its lines."""
        lines: list[bytes] = []
        try:
            while self._budget > 0:
                chunk = held.file.readline(min(MAX_LINE_BYTES, self._budget))
                if not chunk:
                    return True
                self._budget -= len(chunk)
                complete = chunk.endswith(b"\n")
                if held.skipping_long_line:
                    held.skipping_long_line = not complete
                    continue
                held.pending += chunk
                if complete:
                    lines.append(held.pending)
                    held.pending = b""
                    if len(lines) >= LINES_PER_BATCH:
                        self.tally.take_lines(lines, self._polled_at)
                        lines = []
                elif len(held.pending) >= MAX_LINE_BYTES:
                    self.tally.line_too_long(self._polled_at)
                    held.pending = b""
                    held.skipping_long_line = True
            return False
        finally:
            self.tally.take_lines(lines, self._polled_at)

    def _take_partial_line(self, held: _HeldFile) -> None:
        """Its file was rotated or truncated, so the partial line will never be completed: take it as is."""
        if held.pending:
            self._take(held.pending)
        held.pending = b""
        held.skipping_long_line = False

    # --- what the lines say -------------------------------------------------------------------------

    def _take(self, line: bytes) -> None:
        self.tally.take_line(line, self._polled_at)

    def _snapshot(self) -> GatewayLogSnapshot:
        return self.tally.snapshot(
            SourceState(
                problem=self._problem,
                unreadable_polls=by_reason(self._unreadable_polls, UNREADABLE_REASONS),
                unread_bytes=self._unread_bytes,
                unread_files={"rotated_unopened": self._rotated_unopened} if self._creations.watched else {},
            )
        )
