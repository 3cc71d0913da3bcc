"""The gateway access log follower's counts: requests, failovers, sessions spread, returning or expired."""

from __future__ import annotations

from gatewaylog_lines import R1, R2, R3, T0, Clock, append, entry
from gatewaylog_lines import follow as follow  # the fixture
from gatewaylog_lines import log as log  # the fixture

from kvwatch.collectors.gatewaylogs import MALFORMED_REASONS


def spread(listener: str = "affinity", *, moved: int = 0, failed_over: int = 0) -> dict:
    """A snapshot's spread sessions of one listener: moved for no known reason, or by a failover."""
    return {(listener, "false"): moved, (listener, "true"): failed_over}


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


def test_tracked_sessions_stay_within_max_sessions(log, follow):
    append(log, *(entry(f"session-{i}", msec=T0 + i / 1000) for i in range(50_000)))
    snapshot = follow(clock=Clock(T0 + 60), max_sessions=1000).poll()
    assert snapshot.lines == 50_000
    assert snapshot.tracked_sessions == 1000 and snapshot.evicted_sessions == 49_000
    # Within the TTL every session is active, but only the tracked ones can be counted.
    assert snapshot.active_sessions == {"affinity": 1000}
