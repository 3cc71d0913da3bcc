"""Count the files created at one path, from Linux's inotify: a log rotated more than once between two polls
leaves no other trace of the files in between (collectors/gatewaylogs/follower.py counts them as unread).

Elsewhere, or while the path's directory does not exist, nothing is counted and `take()` says so.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from pathlib import Path
from typing import BinaryIO

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_IN_MOVED_TO, _IN_CREATE, _IN_IGNORED = 0x80, 0x100, 0x8000  # <sys/inotify.h>
_EVENT = struct.Struct("iIII")  # watch descriptor, mask, cookie, length of the name that follows
_READ_BYTES = 64 * 1024
# The kernel queues at most 16,384 events per instance (fs.inotify.max_queued_events): about 1 MiB of them.
_MAX_READS = 32


class Creations:
    """Files created at, or renamed to, `path` between two calls of `take()`."""

    def __init__(self, path: Path) -> None:
        self._directory, self._name = os.fsencode(path.parent), os.fsencode(path.name)
        self._events: BinaryIO | None = None  # the inotify instance while it watches the directory
        self.started = False  # whether the last take() began watching: earlier files were not seen
        self.watched = False  # whether it ever watched: without it nothing was counted

    def take(self) -> int | None:
        """How many files appeared at the path since the last call; None when nothing is watched."""
        self.started = self._events is None and self._watch()
        if self._events is None:
            return None
        created, gone = 0, False
        for _ in range(_MAX_READS):
            if not (events := self._events.read(_READ_BYTES)):  # None: none left (non-blocking)
                break
            for mask, name in _events(events):
                if mask & (_IN_CREATE | _IN_MOVED_TO) and name == self._name:
                    created += 1
                gone |= mask & _IN_IGNORED != 0
        if gone:  # the directory was deleted or unmounted: watch it again once it is back
            self.close()
        return created

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None

    def _watch(self) -> bool:
        if _LIBC is None:
            return False
        fd = _LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:  # e.g. the user's limit of inotify instances
            return False
        if _LIBC.inotify_add_watch(fd, self._directory, _IN_CREATE | _IN_MOVED_TO) < 0:
            os.close(fd)
            return False
        self._events, self.watched = os.fdopen(fd, "rb", buffering=0), True
        return True


def _events(data: bytes):
    """(mask, name) of each event in what one read returned; the kernel pads names with NULs."""
    offset = 0
    while offset < len(data):
        _, mask, _, length = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size
        yield mask, data[offset : offset + length].rstrip(b"\0")
        offset += length
