"""The gateway access log follower reading its file: missing or unreadable, rotated, truncated, bad lines."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import pytest
from gatewaylog_lines import R1, Clock, append, entry
from gatewaylog_lines import follow as follow  # the fixture
from gatewaylog_lines import log as log  # the fixture
from prometheus_client import CollectorRegistry

from kvwatch.collectors.gatewaylogs import MALFORMED_REASONS
from kvwatch.collectors.gatewaylogs.follower import MAX_LINE_BYTES, GatewayLogFollower, unreadable_reason
from kvwatch.collectors.gatewaylogs.metrics import GatewayLogCollector


def test_a_missing_log_is_reported_and_read_once_it_appears(log, follow):
    follower = follow()
    snapshot = follower.poll()
    assert not snapshot.readable and snapshot.problem == "not_found" and snapshot.lines == 0
    append(log, entry())
    snapshot = follower.poll()
    assert snapshot.readable and snapshot.lines == 1
    assert snapshot.unread_files == {"rotated_unopened": 0}  # created, then opened: read


def test_an_unreadable_log_is_reported_not_raised(log, follow):
    log.mkdir()
    snapshot = follow().poll()
    assert not snapshot.readable and snapshot.problem == "is_directory"


@pytest.mark.timeout(5)  # before: open() waited for a writer and read() never ended
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_a_device_is_refused_at_once_and_never_read(tmp_path, kind):
    path = tmp_path / "fifo"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    with GatewayLogFollower(path, "lab", clock=Clock()) as follower:
        snapshot = follower.poll()
    assert snapshot.problem == "not_regular_file" and snapshot.lines == 0
    assert snapshot.unreadable_polls["not_regular_file"] == 1


def test_errors_a_root_test_cannot_cause_have_their_reason_too():
    assert unreadable_reason(PermissionError(errno.EACCES, "Permission denied")) == "permission_denied"
    assert unreadable_reason(OSError(errno.EIO, "Input/output error")) == "read_error"


def test_why_a_log_is_unreadable_is_logged_once_per_change_and_counted(log, follow, caplog):
    follower = follow()
    with caplog.at_level(logging.INFO, logger="kvwatch.gatewaylog"):
        follower.poll()
        follower.poll()
        log.mkdir()
        follower.poll()
        follower.poll()
        log.rmdir()
        append(log, entry())
        snapshot = follower.poll()
        follower.poll()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"gateway log lab: cannot read {log} (not_found: No such file or directory); "
                    "kvwatch tries again on every poll"),
        ("WARNING", f"gateway log lab: cannot read {log} (is_directory: Is a directory); "
                    "kvwatch tries again on every poll"),
        ("INFO", f"gateway log lab: reading {log} again"),
    ]  # fmt: skip
    assert snapshot.readable and snapshot.lines == 1
    assert snapshot.unreadable_polls == {
        "not_found": 2, "permission_denied": 0, "is_directory": 2, "not_regular_file": 0, "read_error": 0,
    }  # fmt: skip


def test_reading_is_bounded_per_poll_and_goes_on_where_it_stopped(log, follow):
    lines = [entry(f"s{i}") for i in range(10)]
    append(log, *lines)
    follower = follow(max_bytes_per_poll=len(lines[0]) * 3 + 10)  # a line is cut at the bound
    counted = [(s.lines, s.unread_bytes) for s in (follower.poll() for _ in range(4))]
    size = len("".join(lines))
    assert counted == [(3, size - 3 * len(lines[0]) - 10), (6, size - 6 * len(lines[0]) - 20),
                       (9, len(lines[0]) - 30), (10, 0)]  # fmt: skip
    assert follower.latest.malformed == dict.fromkeys(MALFORMED_REASONS, 0)


def test_rotation_finishes_the_old_file_then_reads_the_new_one_from_its_start(log, follow):
    follower = follow()
    append(log, entry("a"), entry("b"))
    assert follower.poll().lines == 2
    append(log, entry("c"))  # written after the last poll, just before the rotation
    log.rename(log.with_name("gateway.jsonl.1"))
    snapshot = follower.poll()
    assert snapshot.lines == 3 and snapshot.readable  # nginx may still write the renamed file
    append(log, entry("d"), entry("e"))
    # The poll that sees the new file reads it at once, after the rest of the old one.
    assert follower.poll().lines == 5
    assert follower.latest.active_sessions == {"affinity": 5}


def test_rotation_with_the_new_file_already_there(log, follow):
    follower = follow()
    append(log, entry("a"))
    follower.poll()
    append(log, entry("b"))
    log.rename(log.with_name("gateway.jsonl.1"))
    append(log, entry("c"), entry("d"))
    assert follower.poll().lines == 4


def test_what_nginx_writes_to_the_renamed_file_until_it_reopens_its_log_is_read(log, follow):
    follower = follow()
    append(log, entry("a"))
    follower.poll()
    rotated = log.with_name("gateway.jsonl.1")
    log.rename(rotated)
    assert follower.poll().readable
    log.touch()  # logrotate's `create`: the new file is there before nginx reopens its log
    follower.poll()
    append(rotated, entry("b"))  # nginx has not reopened yet
    follower.poll()
    append(log, entry("c"))  # now it has
    snapshot = [follower.poll() for _ in range(2)][-1]
    assert snapshot.lines == 3 and snapshot.active_sessions == {"affinity": 3}


class RotatingWriter:
    """A gateway writing its log through its own open file and rotating it as logrotate's `create` with
    `nginx -s reopen` does: rename the file, then write a new one. Each rotation renames over the last
    rotated file, so a file no one holds open is gone at the next rotation."""

    def __init__(self, path: Path):
        self.path = path
        self.out = path.open("a")
        self.lines = 0

    def write(self, *lines: str) -> None:
        self.out.write("".join(lines))
        self.out.flush()
        self.lines += len(lines)

    def rotate(self) -> None:
        self.path.rename(self.path.with_name(self.path.name + ".1"))
        self.out.close()
        self.out = self.path.open("a")

    def __enter__(self) -> RotatingWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.out.close()


def test_a_log_rotated_faster_than_it_is_polled_loses_no_line_of_a_file_kvwatch_opened(log, follow):
    """Rotations between two polls, in a fixed order: every file a poll found at the path is read to its
    end, even once renamed over; each file created and rotated away between two polls is counted."""
    follower = follow()
    with RotatingWriter(log) as writer:
        writer.write(entry("a1"), entry("a2"))
        assert follower.poll().unread_files == {"rotated_unopened": 0}
        writer.write(entry("a3"))
        writer.rotate()  # A -> gateway.jsonl.1; B at the path
        writer.write(entry("b1"), entry("b2"))
        writer.rotate()  # B over A, which only the follower's open file keeps; C at the path
        writer.write(entry("c1"))
        snapshot = follower.poll()
        assert snapshot.unread_files == {"rotated_unopened": 1}
        assert snapshot.lines == writer.lines - 2  # all but B's
        writer.write(entry("c2"))
        for name in ("d", "e", "f"):
            writer.rotate()
            writer.write(entry(name))
        snapshot = follower.poll()
        assert snapshot.unread_files == {"rotated_unopened": 3}
        assert snapshot.lines == writer.lines - 4  # all but B's, D's and E's
        assert snapshot.active_sessions == {"affinity": snapshot.lines}  # each line its own session
        assert snapshot.malformed == dict.fromkeys(MALFORMED_REASONS, 0)
        writer.write(entry("f2"))
        assert follower.poll().lines == writer.lines - 4
    registry = CollectorRegistry()
    registry.register(GatewayLogCollector([follower]))
    unread = {"log": "lab", "reason": "rotated_unopened"}
    assert registry.get_sample_value("kvwatch_gateway_log_unread_files_total", unread) == 3


def test_truncation_restarts_from_the_beginning(log, follow):
    follower = follow()
    append(log, entry("a"), entry("b"), entry("c"))
    assert follower.poll().lines == 3
    log.write_text(entry("d"))
    snapshot = follower.poll()
    assert snapshot.lines == 4 and snapshot.active_sessions == {"affinity": 4}


def test_a_rotated_file_is_read_to_its_end_before_the_new_one_even_over_several_polls(log, follow):
    follower = follow(max_bytes_per_poll=len(entry("a")) * 2)
    append(log, entry("a"))
    follower.poll()
    append(log, entry("b"), entry("c"), entry("d"))
    log.rename(log.with_name("gateway.jsonl.1"))
    append(log, entry("e"))
    # b and c fill the second poll, d and then the new file's e the third.
    assert [follower.poll().lines for _ in range(2)] == [3, 5]
    assert follower.latest.active_sessions == {"affinity": 5}


def test_copytruncate_loses_no_line_written_after_the_truncation(log, follow):
    """logrotate's copytruncate: the file is copied, then truncated in place and written again; by the
    next poll it can be longer than the offset read up to, so its size alone does not show the cut."""
    follower = follow()
    append(log, entry("a"), entry("b"))
    assert follower.poll().lines == 2
    shutil.copy(log, log.with_name("gateway.jsonl.1"))
    with log.open("r+") as same_inode:
        same_inode.truncate(0)
    append(log, entry("c"), entry("d"), entry("e"))
    snapshot = follower.poll()
    assert snapshot.lines == 5 and snapshot.malformed == dict.fromkeys(MALFORMED_REASONS, 0)
    assert snapshot.active_sessions == {"affinity": 5}


def test_a_partial_line_is_kept_until_it_is_completed(log, follow):
    follower = follow()
    line = entry("a")
    append(log, entry("first"), line[:40])
    snapshot = follower.poll()
    assert snapshot.lines == 1 and snapshot.malformed["invalid_json"] == 0
    append(log, line[40:])
    snapshot = follower.poll()
    assert snapshot.lines == 2 and snapshot.malformed["invalid_json"] == 0
    assert snapshot.requests == {("affinity", R1): 2}


def test_a_partial_line_cut_off_by_truncation_is_malformed(log, follow):
    follower = follow()
    append(log, entry("a"), entry("b")[:40])
    assert follower.poll().lines == 1
    log.write_text(entry("c"))
    snapshot = follower.poll()
    assert snapshot.lines == 3 and snapshot.malformed["invalid_json"] == 1
    assert snapshot.requests == {("affinity", R1): 2}


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("not json\n", "invalid_json"),
        ('{"msec": 1.0, \n', "invalid_json"),
        ("[1, 2]\n", "invalid_json"),
        ("\n", "invalid_json"),
        ("[" * 60_000 + "\n", "invalid_json"),
        (entry().replace('"status": 200', '"code": 200'), "missing_field"),
        (entry().replace('"status": 200', '"status": "200"'), "wrong_type"),
        (entry().replace('"msec": 1800000000.0', '"msec": true'), "wrong_type"),
        (entry(source="cookie"), "bad_value"),
        (entry(session_id=""), "bad_value"),
        (entry(status=1000), "bad_value"),
        # Python's json reads these; no request ended at such a time.
        (entry().replace('"msec": 1800000000.0', '"msec": NaN'), "bad_value"),
        (entry().replace('"msec": 1800000000.0', '"msec": Infinity'), "bad_value"),
        (entry().replace('"msec": 1800000000.0', '"msec": -Infinity'), "bad_value"),
        ('{"pad": "' + "x" * (3 * MAX_LINE_BYTES) + '"}\n', "too_long"),
    ],
)
def test_malformed_lines_are_counted_by_reason_and_reading_goes_on(log, follow, line, reason):
    append(log, entry("before"), line, entry("after"))
    snapshot = follow().poll()
    assert snapshot.lines == 3
    assert snapshot.malformed == {**dict.fromkeys(MALFORMED_REASONS, 0), reason: 1}
    assert snapshot.requests == {("affinity", R1): 2}


def test_invalid_utf8_is_a_malformed_line(log, follow):
    log.write_bytes(b'{"session_id": "\xff\xfe"}\n' + entry().encode())
    snapshot = follow().poll()
    assert snapshot.malformed["invalid_json"] == 1 and snapshot.lines == 2
