"""Returning requests: a session's request after its previous one, and whether it moved to another upstream
with nothing to explain it (a failover, a replica joining or leaving), counted by the tally."""

from __future__ import annotations

import itertools
import json

from kvwatch.collectors.gatewaylogs.tally import MAX_UPSTREAMS_PER_LISTENER, SessionTally, SourceState

T0 = 1_800_000_000.0
R1, R2, R3, R4 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"
_OTHERS = itertools.count()


def line(session_id: str, upstream: str, at: float = T0, listener: str = "affinity") -> bytes:
    """One line of the lab's nginx log; `upstream` as nginx's $upstream_addr ("a, b": a failed)."""
    record = {"msec": at, "listener": listener, "request": "POST /v1/chat/completions", "status": 200,
              "upstream_addr": upstream, "session_id": session_id, "session_source": "client"}  # fmt: skip
    return json.dumps(record).encode()


def tally_of(*lines: bytes, **options) -> SessionTally:
    tally = SessionTally("gw", clock=lambda: T0 + 3600, **options)
    for one in lines:
        tally.take_line(one, T0 + 3600)  # received now: every time is in the past
    return tally


def counts(tally: SessionTally, listener: str = "affinity") -> tuple[int, int, int]:
    """(returning requests, moved unexplained, moved explained) of one listener."""
    snapshot = tally.snapshot(SourceState())
    moved = snapshot.moved_requests
    return snapshot.returning_requests[listener], moved[listener, "false"], moved[listener, "true"]


def busy(*upstreams: str, times: int = 1, at: float = T0) -> list[bytes]:
    """Other sessions' single requests on these upstreams, `times` rounds of them: the replicas serve."""
    return [line(f"other-{next(_OTHERS)}", u, at) for _ in range(times) for u in upstreams]


def test_a_sessions_later_requests_return_and_a_move_with_nothing_to_explain_it_counts():
    tally = tally_of(
        *busy(R1, R2, R3),
        line("pinned", R1), line("pinned", R1), line("pinned", R1),
        line("moved", R2), *busy(R1, R2, R3), line("moved", R3),
        line("once", R2),
        line("a", R1, listener="round_robin"), line("b", R2, listener="round_robin"),
        line("pinned", R1, listener="round_robin"), line("pinned", R2, listener="round_robin"),
    )  # fmt: skip
    assert counts(tally) == (3, 1, 0)
    assert counts(tally, "round_robin") == (1, 1, 0)  # sessions are per listener


def test_a_request_after_the_session_ttl_is_a_new_start_not_a_return():
    tally = tally_of(line("s", R1, T0), *busy(R1, R2, R3, times=3), line("s", R2, T0 + 1801),
                     session_ttl_seconds=1800)  # fmt: skip
    assert counts(tally) == (0, 0, 0)


def test_requests_no_upstream_served_neither_return_nor_move():
    tally = tally_of(line("s", R1), line("s", "kvwatch_affinity"), line("s", R1))
    assert counts(tally) == (1, 0, 0)


def test_a_failover_explains_the_move_and_the_move_back_once_the_replica_recovered():
    tally = tally_of(
        line("s", R1, T0), line("s", f"{R1}, {R2}", T0 + 10),  # R1 failed: tried, then R2 answered
        line("s", R2, T0 + 20), *busy(R1, R2, R3, times=3, at=T0 + 20),
        line("s", R1, T0 + 30),  # R1 recovered: back where the session was before its failover
        *busy(R1, R2, R3, times=3, at=T0 + 30),
        line("s", R3, T0 + 40),  # then a move of its own
    )  # fmt: skip
    assert counts(tally) == (4, 1, 2)


def test_a_request_after_one_that_failed_over_may_move():
    # Envoy logs the upstream that failed (UF) on the failing request: the next one lands elsewhere.
    tally = tally_of(*busy(R1, R2, R3), line("s", R1), line("s", f"{R1}, {R2}"), line("s", R3))
    assert counts(tally) == (2, 0, 2)


def test_a_replica_that_left_explains_its_sessions_moves():
    # R1 serves s, then nothing more among well over twice the listener's upstreams' requests: it is gone.
    tally = tally_of(*busy(R1, R2, R3), line("s", R1), *busy(R2, R3, times=4), line("s", R2))
    assert counts(tally) == (1, 0, 1)


def test_a_replica_still_serving_explains_nothing():
    # R1 served a request after the session's: under any balancing a live replica serves some.
    tally = tally_of(*busy(R1, R2, R3), line("s", R1), *busy(R2, R3, R1, R2, R3), line("s", R2))
    assert counts(tally) == (1, 1, 0)


def test_a_quiet_moment_is_no_replica_leaving():
    # Fewer requests since the session's than twice the upstreams: R1 may be alive, the move counts.
    tally = tally_of(*busy(R1, R2, R3), line("s", R1), *busy(R2, R3), line("s", R2))
    assert counts(tally) == (1, 1, 0)


def test_a_replica_that_joined_explains_the_sessions_it_takes():
    # A scale-out: R4 serves its first request after the session's previous one; a consistent hash
    # remaps some sessions to it once. A later move to R4 is not explained by that.
    tally = tally_of(
        *busy(R1, R2, R3), line("s", R1), line("t", R2), line("s", R4),
        line("t", R1), line("t", R4),
    )  # fmt: skip
    assert counts(tally) == (3, 2, 1)


def test_upstreams_remembered_per_listener_stay_bounded():
    many = [f"10.1.{i // 256}.{i % 256}:8000" for i in range(MAX_UPSTREAMS_PER_LISTENER + 10)]
    tally = tally_of(*busy(*many))
    assert len(tally._upstreams["affinity"].seen) == MAX_UPSTREAMS_PER_LISTENER


def test_a_snapshot_has_every_listener_and_both_kinds_of_move():
    snapshot = tally_of(line("s", R1), line("t", R2, listener="other")).snapshot(SourceState())
    assert snapshot.returning_requests == {"affinity": 0, "other": 0}
    assert snapshot.moved_requests == {
        ("affinity", "false"): 0, ("affinity", "true"): 0, ("other", "false"): 0, ("other", "true"): 0
    }  # fmt: skip
