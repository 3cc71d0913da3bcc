"""The gateway access log follower: counts, sessions, rotation, bad lines, the Collector (the lab's
nginx: tests/integration/test_gatewaylog_lab.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, free_port, http_get, stop, wait_http
from kvwatch.collectors.gatewaylogs import MALFORMED_REASONS
from kvwatch.collectors.gatewaylogs.follower import MAX_LINE_BYTES, GatewayLogFollower, unreadable_reason
from kvwatch.collectors.gatewaylogs.metrics import GatewayLogCollector
from kvwatch.core.labels import MAX_LABEL_VALUE_LENGTH, MAX_VALUES_PER_LABEL, OTHER

T0 = 1_800_000_000.0
R1, R2, R3 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def spread(listener: str = "affinity", *, moved: int = 0, failed_over: int = 0) -> dict:
    """A snapshot's spread sessions of one listener: moved for no known reason, or by a failover."""
    return {(listener, "false"): moved, (listener, "true"): failed_over}


class Clock:
    """A clock the test moves by hand: TTLs and windows expire without sleeping."""

    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def entry(
    session_id: str = "s1",
    upstream: str = R1,
    *,
    listener: str = "affinity",
    source: str = "client",
    status: int = 200,
    msec: float = T0,
) -> str:
    """One access log line as the lab's `kvwatch_json` log_format writes it."""
    record = {
        "time": "2027-01-15T08:00:00+00:00",
        "msec": msec,
        "listener": listener,
        "request": "POST /v1/chat/completions",
        "status": status,
        "upstream_addr": upstream,
        "upstream_status": str(status),
        "session_id": session_id,
        "session_source": source,
        "request_time": 0.012,
        "upstream_response_time": "0.012",
    }
    return json.dumps(record) + "\n"


@pytest.fixture
def log(tmp_path):
    return tmp_path / "gateway.jsonl"


@pytest.fixture
def follow(log):
    """Make followers of `log` (closed at teardown) with an injected clock."""
    followers: list[GatewayLogFollower] = []

    def make(name: str = "lab", clock: Clock | None = None, **options) -> GatewayLogFollower:
        follower = GatewayLogFollower(log, name, clock=clock or Clock(), **options)
        followers.append(follower)
        return follower

    yield make
    for follower in followers:
        follower.close()


def append(path, *lines: str) -> None:
    with path.open("a") as out:
        out.write("".join(lines))


def test_counts_requests_per_listener_upstream_and_status_class(log, follow):
    append(
        log,
        entry("a", R1),
        entry("a", R1, status=503),
        entry("b", R2, listener="round_robin"),
        entry("c", "", status=400),  # answered by nginx itself
        entry("d", "kvwatch_affinity", status=502),  # the upstream group's name: no live server
    )
    snapshot = follow().poll()
    assert snapshot.readable and snapshot.lines == 5
    assert snapshot.requests == {("affinity", R1): 2, ("round_robin", R2): 1, ("affinity", "none"): 2}
    assert snapshot.responses == {
        ("affinity", "2xx"): 1,
        ("affinity", "4xx"): 1,
        ("affinity", "5xx"): 2,
        ("round_robin", "2xx"): 1,
    }
    assert snapshot.failovers == {"affinity": 0, "round_robin": 0}
    assert snapshot.active_sessions == {"affinity": 1, "round_robin": 1}  # served sessions only
    assert snapshot.malformed == dict.fromkeys(MALFORMED_REASONS, 0)


def test_a_failover_counts_for_the_upstream_that_answered(log, follow):
    append(log, entry("a", f"{R1}, {R2}"), entry("a", f"{R1}, {R3} : {R2}"), entry("a", R2))
    append(log, entry("a", f"{R1}, kvwatch_affinity", status=502))  # every server failed
    snapshot = follow().poll()
    assert snapshot.requests == {("affinity", R2): 3, ("affinity", "none"): 1}
    assert snapshot.failovers == {"affinity": 3}
    assert snapshot.spread_sessions == spread()


def test_requests_without_a_client_key_are_counted_with_the_ids_the_gateway_assigned(log, follow):
    append(
        log,
        entry("x1", source="assigned"),
        entry("x2", source="assigned"),
        entry("x2", source="assigned"),  # a gateway may hand out the same id twice
        entry("c1"),
        entry("c2", listener="round_robin"),
    )
    snapshot = follow().poll()
    assert snapshot.without_session_key == {"affinity": 3, "round_robin": 0}
    assert snapshot.assigned_session_ids == {"affinity": 2, "round_robin": 0}
    assert snapshot.active_sessions == {"affinity": 3, "round_robin": 1}


def test_a_session_seen_on_two_upstreams_within_the_window_is_spread(log, follow):
    clock = Clock(T0 + 60)
    follower = follow(clock=clock, spread_window_seconds=600)
    append(log, entry("moved", R1), entry("moved", R2, msec=T0 + 30))
    append(log, entry("pinned", R3), entry("pinned", R3))
    append(log, entry("moved", R1, listener="round_robin"))  # another listener, another session
    snapshot = follower.poll()
    assert snapshot.spread_sessions == spread(moved=1) | spread("round_robin")
    assert snapshot.returning_sessions == {"affinity": 2, "round_robin": 0}

    clock.now = T0 + 620  # R1 was 620 s ago, R2 590 s ago: only one upstream is left in the window
    snapshot = follower.poll()
    assert snapshot.spread_sessions == spread() | spread("round_robin")
    assert snapshot.returning_sessions == {"affinity": 0, "round_robin": 0}
    assert snapshot.active_sessions == {"affinity": 2, "round_robin": 1}


def test_returning_sessions_came_twice_within_the_window(log, follow):
    clock = Clock(T0 + 700)
    follower = follow(clock=clock, spread_window_seconds=600)
    append(log, entry("once", msec=T0 + 650))
    append(log, entry("twice", msec=T0 + 50), entry("twice", msec=T0 + 650))  # the first is too old
    append(log, entry("late", msec=T0 + 690), entry("late", msec=T0 + 680))  # logged out of order
    assert follower.poll().returning_sessions == {"affinity": 1}


def test_a_session_moved_by_a_failover_is_counted_apart_until_it_is_back_and_settled(log, follow):
    clock = Clock(T0 + 100)
    follower = follow(clock=clock, spread_window_seconds=600)
    # R1 dies: nginx tries it, then R2 answers; the session stays on R2 until R1 is back.
    append(
        log, entry("s", R1, msec=T0), entry("s", f"{R1}, {R2}", msec=T0 + 10), entry("s", R2, msec=T0 + 20)
    )
    append(log, entry("s", R1, msec=T0 + 100))  # R1 is back, and so is the session
    append(log, entry("moved", R1, msec=T0), entry("moved", R3, msec=T0 + 100))  # nothing failed
    assert follower.poll().spread_sessions == spread(moved=1, failed_over=1)
    # The failover is out of the window, R2 still in it: the move back is part of that failover.
    clock.now = T0 + 615
    assert follower.poll().spread_sessions == spread(failed_over=1)
    clock.now = T0 + 650  # only R1 is left in the window
    assert follower.poll().spread_sessions == spread()


def test_a_move_long_after_a_failover_is_not_explained_by_it(log, follow):
    clock = Clock(T0 + 900)
    follower = follow(clock=clock, spread_window_seconds=600)
    # R1 is gone for good: the session lives on R2, then, 15 minutes later, lands on R3.
    append(log, entry("s", R1, msec=T0), entry("s", f"{R1}, {R2}", msec=T0 + 10))
    append(log, entry("s", R2, msec=T0 + 600), entry("s", R3, msec=T0 + 900))
    assert follower.poll().spread_sessions == spread(moved=1)


def test_sessions_stop_being_active_after_the_ttl(log, follow):
    clock = Clock()
    follower = follow(clock=clock)  # the default TTL: 30 min
    append(log, entry("old", msec=T0), entry("new", msec=T0 + 600))
    clock.now = T0 + 1799
    assert follower.poll().active_sessions == {"affinity": 2}
    clock.now = T0 + 1801
    assert follower.poll().active_sessions == {"affinity": 1}
    clock.now = T0 + 2401
    snapshot = follower.poll()
    assert snapshot.active_sessions == {"affinity": 0}
    assert snapshot.tracked_sessions == 0 and snapshot.evicted_sessions == 0


def test_a_time_far_ahead_of_the_clock_is_counted_and_cannot_keep_a_session_active(log, follow):
    clock = Clock()
    follower = follow(clock=clock)  # the default TTL: 30 min
    append(log, entry("skewed", msec=T0 + 30), entry("future", msec=T0 + 10 * 365 * 86400))
    snapshot = follower.poll()
    assert snapshot.future_times == 1 and snapshot.lines == 2 and snapshot.requests == {("affinity", R1): 2}
    assert snapshot.active_sessions == {"affinity": 2}
    clock.now = T0 + 1831  # the TTL after the poll that read it, and after the skewed line's time
    assert follower.poll().active_sessions == {"affinity": 0}


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


def test_tracked_sessions_stay_within_max_sessions(log, follow):
    append(log, *(entry(f"session-{i}", msec=T0 + i / 1000) for i in range(50_000)))
    snapshot = follow(clock=Clock(T0 + 60), max_sessions=1000).poll()
    assert snapshot.lines == 50_000
    assert snapshot.tracked_sessions == 1000 and snapshot.evicted_sessions == 49_000
    # Within the TTL every session is active, but only the tracked ones can be counted.
    assert snapshot.active_sessions == {"affinity": 1000}


def test_the_collector_exposes_counts_and_never_session_ids(tmp_path):
    affinity_log, rr_log = tmp_path / "affinity.jsonl", tmp_path / "rr.jsonl"
    append(
        affinity_log,
        entry("secret-session-1", R1),
        entry("secret-session-1", R1),
        entry("secret-assigned-2", f"{R1}, {R2}", source="assigned"),
        "garbage\n",
    )
    append(
        rr_log,
        entry("secret-session-3", R1, listener="round_robin"),
        entry("secret-session-3", R2, listener="round_robin"),
    )
    clock = Clock(T0 + 1)
    with (
        GatewayLogFollower(affinity_log, "affinity", clock=clock) as affinity,
        GatewayLogFollower(rr_log, "round_robin", expect_sticky=False, clock=clock) as round_robin,
        GatewayLogFollower(tmp_path / "absent.jsonl", "absent", clock=clock) as absent,
    ):
        for follower in (affinity, round_robin, absent):
            follower.poll()
        registry = CollectorRegistry()
        registry.register(GatewayLogCollector([affinity, round_robin, absent]))

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(f"kvwatch_gateway_{name}", labels)

        aff = {"log": "affinity", "listener": "affinity"}
        rr = {"log": "round_robin", "listener": "round_robin"}
        assert value("requests_total", **aff, upstream=R1) == 2
        assert value("requests_total", **aff, upstream=R2) == 1
        assert value("responses_total", **aff, status_class="2xx") == 3
        assert value("requests_without_session_key_total", **aff) == 1
        assert value("assigned_session_ids_total", **aff) == 1
        assert value("failovers_total", **aff) == 1
        assert value("session_spread_sessions", **aff, failover="false") == 0
        assert value("session_spread_sessions", **aff, failover="true") == 0
        assert value("session_spread_sessions", **rr, failover="false") == 1
        assert value("returning_sessions", **aff) == 1
        assert value("returning_sessions", **rr) == 1
        assert value("active_sessions", **aff) == 2
        assert value("returning_requests_total", **aff) == 1
        assert value("moved_requests_total", **aff, failover="false") == 0
        # R2 served its first request after the session's previous one: a replica that joined
        assert value("moved_requests_total", **rr, failover="true") == 1
        assert value("malformed_lines_total", log="affinity", reason="invalid_json") == 1
        assert value("malformed_lines_total", log="round_robin", reason="too_long") == 0
        assert value("lines_total", log="affinity") == 4
        assert value("lines_total", log="absent") == 0
        assert value("evicted_sessions_total", log="affinity") == 0
        assert value("log_readable", log="affinity") == 1
        assert value("log_readable", log="absent") == 0
        assert value("log_unreadable_polls_total", log="absent", reason="not_found") == 1
        assert value("log_unreadable_polls_total", log="affinity", reason="not_found") == 0
        assert value("log_unread_bytes", log="affinity") == 0
        assert value("log_last_poll_timestamp_seconds", log="absent") == T0 + 1
        assert value("log_info", log="round_robin", expect_sticky="false", source="file") == 1
        assert value("log_info", log="affinity", expect_sticky="true", source="file") == 1

        exposition = generate_latest(registry).decode()
        assert "secret" not in exposition
        families = {family.name: family for family in text_string_to_metric_families(exposition)}
        assert families["kvwatch_gateway_requests"].type == "counter"
        assert families["kvwatch_gateway_active_sessions"].type == "gauge"
        assert all(name.startswith("kvwatch_gateway_") for name in families)


def test_listener_and_upstream_labels_stay_bounded_per_log_and_say_what_they_folded(log, follow):
    """10,000 upstreams or a 60 KB name must not become 10,000 series or a 60 KB label value."""
    many = MAX_VALUES_PER_LABEL + 100
    append(
        log,
        *(entry(f"s{i}", f"10.1.{i // 256}.{i % 256}:8000", listener=f"listener-{i}") for i in range(many)),
        entry("long-upstream", "10.9.9.9:" + "9" * 60_000),
        entry("long-listener", listener="l" * 60_000),
        entry("no-upstream", ""),  # "none" is always itself, whatever came first
        # Both upstreams are shown as "other", yet the session moved: it is spread.
        entry("mover", "10.2.0.1:8000", msec=T0),
        entry("mover", "10.2.0.2:8000", msec=T0 + 1),
    )
    follower = follow(clock=Clock(T0 + 2))
    snapshot = follower.poll()
    assert snapshot.lines == many + 5 and sum(snapshot.malformed.values()) == 0
    assert snapshot.folded_labels == {
        ("listener", "too_many_values"): many - MAX_VALUES_PER_LABEL + 4,
        ("listener", "too_long"): 1,
        ("upstream", "too_many_values"): many - MAX_VALUES_PER_LABEL + 3,
        ("upstream", "too_long"): 1,
    }
    assert snapshot.spread_sessions[OTHER, "false"] == 1
    registry = CollectorRegistry()
    registry.register(GatewayLogCollector([follower]))
    requests = next(
        family
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        if family.name == "kvwatch_gateway_requests"
    )
    listeners = {sample.labels["listener"] for sample in requests.samples}
    upstreams = {sample.labels["upstream"] for sample in requests.samples}
    assert len(listeners) == MAX_VALUES_PER_LABEL + 1 and len(upstreams) == MAX_VALUES_PER_LABEL + 2
    assert OTHER in listeners and {OTHER, "none"} <= upstreams
    assert max(map(len, listeners | upstreams)) <= MAX_LABEL_VALUE_LENGTH
    folded = {"log": "lab", "label": "upstream", "reason": "too_long"}
    assert registry.get_sample_value("kvwatch_gateway_label_values_folded_total", folded) == 1


def test_the_collector_shows_the_latest_poll_only(log, follow):
    follower = follow()
    registry = CollectorRegistry()
    registry.register(GatewayLogCollector([follower]))
    append(log, entry())
    assert registry.get_sample_value("kvwatch_gateway_lines_total", {"log": "lab"}) == 0
    follower.poll()
    assert registry.get_sample_value("kvwatch_gateway_lines_total", {"log": "lab"}) == 1


def test_log_names_are_short_unique_names(log, follow):
    with pytest.raises(ValueError, match="must be 1-64 letters"):
        GatewayLogFollower(log, "/var/log/nginx/access.log")
    with pytest.raises(ValueError, match="must be unique"):
        GatewayLogCollector([follow("lab"), follow("lab")])


def test_a_snapshot_cannot_be_changed(log, follow):
    append(log, entry())
    snapshot = follow().poll()
    with pytest.raises(AttributeError):
        snapshot.lines = 0
    with pytest.raises(TypeError):
        snapshot.requests["affinity", R1] = 0


# --- a real `kvwatch serve` -----------------------------------------------------------------------


@pytest.mark.integration
def test_serve_counts_a_normal_log_beside_a_fifo_and_stops_on_sigterm(tmp_path):
    fifo, normal = tmp_path / "fifo.jsonl", tmp_path / "normal.jsonl"
    os.mkfifo(fifo)
    append(normal, entry("a"), entry("b"))
    port = free_port()
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        yaml.safe_dump({
            "gateway_logs": [{"name": "fifo", "path": str(fifo)}, {"name": "normal", "path": str(normal)}],
            "exporter": {"listen": f"127.0.0.1:{port}"},
            "store": {"path": str(tmp_path / "kvwatch.db")},
        })
    )  # fmt: skip
    output = tmp_path / "serve.log"
    with output.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvwatch.cli.main", "serve", "--config", str(config)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/-/healthy", process, output)
        found = {}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            exposition = http_get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            found = {
                (s.name, s.labels.get("log")): s.value
                for family in text_string_to_metric_families(exposition)
                for s in family.samples
            }
            if found.get(("kvwatch_gateway_lines_total", "normal")):
                break
            time.sleep(0.1)
        assert found.get(("kvwatch_gateway_lines_total", "normal")) == 2, output.read_text()
        assert found[("kvwatch_gateway_log_readable", "fifo")] == 0
        os.kill(process.pid, signal.SIGTERM)  # before: the poll waited for a FIFO writer, and shutdown for it
        assert process.wait(timeout=5) == 0, output.read_text()
    finally:
        stop(process)
    assert output.read_text().count("gateway log fifo: cannot read") == 1
