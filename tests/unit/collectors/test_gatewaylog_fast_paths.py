"""The gateway-log hot path's quick ways read every line, record and frame as the plain ways do: orjson
as json, the exact-type field check as check_fields, the one-server upstream as the split, a batch of
lines as the same lines one by one, OTLP attributes as plain_value, a burst from one sender as the token
buckets say, a syslog header read in one match as read step by step."""

from __future__ import annotations

import enum
import json
import random
import time

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue, KeyValueList
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from kvwatch.collectors.gatewaylogs import envoy, follower, nginx
from kvwatch.collectors.gatewaylogs.base import Malformed, check_fields, field_check, json_object
from kvwatch.collectors.gatewaylogs.sources.otlp.records import AccessLogRecords, MissingFields
from kvwatch.collectors.gatewaylogs.sources.syslog import Refused, _message_of, _Rates, message_of
from kvwatch.collectors.gatewaylogs.tally import SessionTally, SourceState


def json_reading(line: bytes) -> object:
    """What json makes of a line: the object, or the reason it is none."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return "invalid_json"
    return record if isinstance(record, dict) else "invalid_json"


def fast_reading(line: bytes) -> object:
    try:
        return json_object(line)
    except Malformed as malformed:
        return malformed.reason


@pytest.mark.parametrize(
    "line",
    [
        b'{"msec":1795975200.123,"status":200,"listener":"chat"}\n',
        b'{"status":18446744073709551615}',  # 2**64 - 1: orjson's largest int
        b'{"status":18446744073709551616}',  # 2**64: orjson reads a float, json an int
        b'{"status":100000000000000000000000000000}',
        b'{"msec":-9223372036854775809}',  # below -2**63
        b'{"msec":9.3e18}',
        b'{"msec":NaN}',
        b'{"msec":-Infinity}',
        b'{"msec":1e400}',
        b'{"session_id":"\\ud800"}',  # a lone surrogate, which json reads
        b'\xef\xbb\xbf{"status":200}',  # a UTF-8 byte order mark
        '{"status":200}'.encode("utf-16"),
        b'{"a":1,"a":2,"b":-0.0}',
        b"[" * 2000 + b"]" * 2000,
        b'{"a":' * 2000 + b"1" + b"}" * 2000,
        b'{"session_id":"\xff"}',  # no UTF-8
        b"[1]",
        b'"text"',
        b"",
        b'{"status":200} x',
    ],
)
def test_a_line_reads_as_json_reads_it(line):
    assert repr(fast_reading(line)) == repr(json_reading(line))


def test_an_integer_past_64_bits_is_a_bad_status_as_json_reads_it_not_a_wrong_type():
    tally = SessionTally("fast")
    entry = {
        "msec": 1795975200.0, "listener": "chat", "status": 10**30, "upstream_addr": "127.0.0.1:8001",
        "session_id": "s1", "session_source": "client",
    }  # fmt: skip
    tally.take_line(json.dumps(entry).encode(), time.time())
    malformed = tally.snapshot(SourceState()).malformed
    assert (malformed["bad_value"], malformed["wrong_type"]) == (1, 0)


class Status(enum.IntEnum):
    OK = 200


TYPES = {"msec": (int, float), "status": int, "session_id": str, "upstream_host": (str, type(None))}
GOOD = {"msec": 1.5, "status": 200, "session_id": "s", "upstream_host": None}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"msec": 2},
        {"status": True},
        {"msec": False},
        {"status": 200.0},
        {"status": Status.OK},  # a subclass: isinstance says yes
        {"session_id": None},
        {"upstream_host": "127.0.0.1:8001"},
        {"upstream_host": 1},
        {"extra": object()},
    ],
)
def test_the_quick_field_check_says_what_check_fields_says(changes):
    record = {**GOOD, **changes}

    def outcome(check) -> str:
        try:
            check(record)
        except Malformed as malformed:
            return malformed.reason
        return "ok"

    assert outcome(field_check(TYPES)) == outcome(lambda r: check_fields(r, TYPES))


def test_a_missing_field_is_missing_whichever_check():
    record = {key: value for key, value in GOOD.items() if key != "status"}
    with pytest.raises(Malformed, match="missing_field"):
        field_check(TYPES)(record)


def test_a_field_check_with_bool_as_a_type_is_a_bug():
    with pytest.raises(ValueError, match="bool"):
        field_check({"flag": bool})


@pytest.mark.parametrize(
    ("upstream_addr", "expected"),
    [
        ("", ("none", False)),
        ("127.0.0.1:8001", ("127.0.0.1:8001", False)),
        ("engines", ("none", False)),  # a group's name: no live server
        ("127.0.0.1:8001, 127.0.0.1:8002", ("127.0.0.1:8002", True)),
        ("127.0.0.1:8001 : 127.0.0.1:8002", ("127.0.0.1:8002", True)),
        ("127.0.0.1:8001, engines", ("none", True)),
        ("127.0.0.1:8001, ", ("none", True)),
        ("127.0.0.1:8001,127.0.0.1:8002", ("127.0.0.1:8001,127.0.0.1:8002", False)),  # not nginx's separator
    ],
)
def test_the_upstream_nginx_tried_last(upstream_addr, expected):
    assert nginx.upstream_tried(upstream_addr) == expected


def nginx_line(i: int, **changes: object) -> bytes:
    entry = {
        "msec": 1795975200.0 + i, "listener": "chat", "status": 200,
        "upstream_addr": f"127.0.0.1:{8001 + i % 3}", "session_id": f"s{i % 5}",
        "session_source": "client", "request": "POST /v1/chat/completions",
    }  # fmt: skip
    return json.dumps({**entry, **changes}).encode()


@pytest.mark.parametrize(
    ("log_format", "entry"),
    [
        ("nginx", {"msec": 10**400}),
        ("nginx", {"upstream_header_time": str(10**400)}),
        ("envoy", {"duration": 10**400}),
    ],
)
def test_a_number_past_a_floats_range_is_a_bad_value_not_an_error(log_format, entry):
    tally = SessionTally("fast", log_format=log_format)
    if log_format == "nginx":
        tally.take_line(nginx_line(1, **entry), time.time())
    else:
        numbers = {"response_code": 200, "upstream_request_attempt_count": 1, "session_id": None}
        tally.take_record({**ENVOY_STRINGS, **numbers, **entry}, time.time())
    assert tally.snapshot(SourceState()).malformed["bad_value"] == 1


def test_a_batch_of_lines_counts_as_the_same_lines_one_by_one():
    lines = [nginx_line(i) for i in range(20)]
    lines[3] = b"not json"
    lines[7] = nginx_line(7, status="200")
    lines[11] = nginx_line(11, request="GET /v1/models")
    lines[13] = nginx_line(13, session_source="assigned", session_id="a13", upstream_addr="engines")
    one_by_one, batched = (SessionTally("one", clock=lambda: 1795975300.0) for _ in range(2))
    for line in lines:
        one_by_one.take_line(line, 1795975250.0)
    batched.take_lines(lines, 1795975250.0)
    assert batched.snapshot(SourceState()) == one_by_one.snapshot(SourceState())
    assert batched.received == 20  # malformed lines too
    batched.refuse("over_rate", 2)
    assert batched.received == 22  # and what the source refused


def attribute(key: str, **value: object) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(**value))


ENVOY_STRINGS = {
    "start_time": "2026-12-05T05:28:35.055Z", "duration": "38", "listener": "chat", "response_code": "200",
    "response_flags": "-", "upstream_host": "127.0.0.1:8001", "upstream_request_attempt_count": "1",
    "session_id": "-", "request_id": "45a54e73",
}  # fmt: skip


def test_otlp_attributes_of_any_kind_read_as_plain_values_and_typed_as_the_format_wants():
    attributes = [attribute(key, string_value=value) for key, value in ENVOY_STRINGS.items()]
    attributes[1] = attribute("duration", int_value=38)  # not a string: taken as it is
    attributes[4] = attribute("response_flags", string_value="")  # an empty string is a string
    attributes[5] = attribute("upstream_host", bool_value=False)  # read as the value it is
    attributes.append(attribute("listener", string_value="later"))  # the last one counts
    attributes.append(attribute("unknown", string_value="ignored"))
    record = AccessLogRecords(envoy.FIELDS)(LogRecord(attributes=attributes))
    assert record == {
        **ENVOY_STRINGS, "duration": 38, "listener": "later", "response_code": 200, "response_flags": "",
        "upstream_host": False, "upstream_request_attempt_count": 1, "session_id": None,
    }  # fmt: skip


def test_otlp_body_fields_fill_in_for_missing_attributes_and_a_missing_field_is_named():
    pairs = [KeyValue(key=key, value=AnyValue(string_value=value)) for key, value in ENVOY_STRINGS.items()]
    body = AnyValue(kvlist_value=KeyValueList(values=pairs))
    read = AccessLogRecords(envoy.FIELDS)
    assert read(LogRecord(body=body, attributes=[attribute("listener", string_value="attr")]))[
        "listener"
    ] == ("attr")
    assert read(LogRecord(body=body))["duration"] == 38
    with pytest.raises(MissingFields, match="response_code"):
        read(LogRecord(attributes=[attribute("listener", string_value="chat")]))


def test_a_burst_from_one_sender_uses_its_own_bucket_after_another_sender_came_between():
    rates = _Rates(per_second=2)
    now = 100.0

    def allow(sender: str, now: float) -> bool:
        return rates.admit(sender, now, 1) == 1

    assert [allow("a", now), allow("a", now), allow("a", now)] == [True, True, False]
    assert allow("b", now)
    assert not allow("a", now)  # still a's empty bucket, not b's
    assert allow("b", now)
    assert allow("a", now + 0.5)  # refilled at its rate


def test_a_burst_admitted_at_once_takes_what_one_by_one_would():
    one_by_one, at_once = _Rates(per_second=3), _Rates(per_second=3)
    now = 100.0
    assert sum(one_by_one.admit("a", now, 1) for _ in range(5)) == at_once.admit("a", now, 5) == 3
    assert at_once.admit("a", now, 2) == 0
    assert at_once.admit("b", now, 2) == 2  # another sender's bucket
    assert at_once.admit("a", now + 0.5, 5) == 1  # 1.5 tokens refilled: one whole
    assert one_by_one.admit("a", now + 0.5, 1) == 1 and one_by_one.admit("a", now + 0.5, 1) == 0


@pytest.mark.parametrize(
    "frame",
    [
        b'<190>Dec  5 05:30:00 gw-1 nginx: {"a":1}',
        b'<190>Dec  5 05:30:00 nginx[12]: {"a":1}\r\n',
        b'<190>Dec  5 05:30:00 {"a":1}',  # no tag: the rest is the message
        b'<190>nginx: {"a":1}',
        b'<190>{"a":1}',
        b"<190>Dec  5 05:30:00 gw-1 nginx: ",
        b'<0>gw-1 nginx: \xef\xbb\xbf{"a":1}\0',
        b'<191>1 2026-12-05T05:30:00Z gw-1 nginx - - - {"a":1}',
        b'<192>1 2026-12-05T05:30:00Z gw-1 nginx - - - {"a":1}',  # no priority
        b"<190>1 2026-12-05T05:30:00Z gw-1 nginx - - -",
        b"<190>1 2026-12-05T05:30:00Z gw-1 nginx - - - ",
        b"<190>1 2026-12-05T05:30:00Z gw-1 nginx - - ",
        b'<190>1 2026-12-05T05:30:00Z  gw-1 nginx - - - {"a":1}',  # an empty field
        b'<190>1 2026-12-05T05:30:00Z gw-1 nginx - - [x a="]"] {"a":1}',
        b'<190>1 2026-12-05T05:30:00Z gw-1 nginx - - -x {"a":1}',
        b'<190>1 gw-1: {"a":1}',  # "1 " is RFC 5424's, never a 3164 tag
        b'<1900>nginx: {"a":1}',
        b'<>nginx: {"a":1}',
        b'<19a>nginx: {"a":1}',
        b'{"a":1}',
        b"",
    ],
)
def test_a_syslog_header_read_in_one_match_reads_as_step_by_step(frame):
    readings = []  # each way's message, or the reason it refused the frame
    for read in (message_of, _message_of):
        try:
            readings.append(read(frame))
        except Refused as refused:
            readings.append(refused.reason)
    assert readings[0] == readings[1]


def varied_lines(seed: int, count: int) -> list[bytes]:
    """nginx lines of every kind the tally counts apart: returning and moving sessions, failovers, no
    upstream, assigned ids, other paths, times ahead of the clock, more listeners and upstreams than a
    label shows, first-byte times, and lines that are no request."""
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        upstream = f"127.0.0.1:{8001 + rng.randrange(40 if rng.random() < 0.1 else 3)}"
        entry = {
            "msec": 1795975200.0 + i + (10_000 if rng.random() < 0.03 else 0),
            "listener": f"chat{rng.randrange(40) if rng.random() < 0.05 else rng.randrange(2)}",
            "status": rng.choice((200, 200, 200, 502)),
            "upstream_addr": rng.choice((upstream, upstream, f"127.0.0.1:8009, {upstream}", "engines")),
            "session_id": f"s{rng.randrange(30)}",
            "session_source": rng.choice(("client",) * 9 + ("assigned",)),
            "request": rng.choice(("POST /v1/chat/completions",) * 9 + ("GET /v1/models",)),
        }
        if rng.random() < 0.5:
            entry["upstream_header_time"] = f"{rng.random():.3f}"
        if rng.random() < 0.3:
            del entry["request"]  # no path: counted as an inference request
        lines.append(b"not json" if rng.random() < 0.02 else json.dumps(entry).encode())
    return lines


def test_batches_counted_as_they_are_count_as_the_same_requests_prepared_one_by_one(monkeypatch):
    """The tally counts a batch by its fields as they are when nothing in it needs a request's own
    handling (tally._as_they_are); otherwise each request is prepared alone (_prepared). Both ways
    give the same counts, in the same order, whatever the batch holds."""
    lines = varied_lines(seed=7, count=3000)
    batch_sizes = random.Random(8).choices((1, 1, 2, 3, 5, 40, 256), k=len(lines))

    def tallied() -> tuple[SessionTally, int]:
        tally = SessionTally("fast", max_sessions=25, session_ttl_seconds=400, clock=lambda: 1795978300.0)
        taken = start = 0
        for size in batch_sizes:
            if start >= len(lines):
                break
            tally.take_lines(lines[start : start + size], 1795978000.0)
            start += size
            taken += 1
        return tally, taken

    as_they_are = SessionTally._as_they_are
    fast_batches = []

    def counting_fast_batches(self, parsed, received_at):
        columns = as_they_are(self, parsed, received_at)
        fast_batches.append(columns is not None)
        return columns

    monkeypatch.setattr(SessionTally, "_as_they_are", counting_fast_batches)
    fast, batches = tallied()
    monkeypatch.setattr(SessionTally, "_as_they_are", lambda self, parsed, received_at: None)
    plain, _ = tallied()
    assert 20 <= sum(fast_batches) < batches  # both ways were taken
    fast_snapshot, plain_snapshot = fast.snapshot(SourceState()), plain.snapshot(SourceState())
    assert fast_snapshot == plain_snapshot
    for name in ("requests", "responses", "folded_labels", "first_byte_seconds"):
        assert list(getattr(fast_snapshot, name).items()) == list(getattr(plain_snapshot, name).items())
    counted = (fast_snapshot.future_times, fast_snapshot.evicted_sessions, fast_snapshot.other_requests)
    assert counted[0] > 0 and counted[1] > 0 and sum(counted[2].values()) > 0
    assert fast_snapshot.folded_labels["upstream", "too_many_values"] > 0
    assert sum(fast_snapshot.moved_requests.values()) > 0 and fast_snapshot.first_byte_seconds


def test_a_session_whose_first_request_failed_over_has_moved_for_a_failover():
    """A session opened by a failed-over request (its first server failed): its move back counts as
    explained by the failover, as does its spread."""
    tally = SessionTally("fast", clock=lambda: 1795975300.0)
    tally.take_lines(
        [
            nginx_line(0, session_id="s", upstream_addr="127.0.0.1:8001, 127.0.0.1:8002"),
            nginx_line(1, session_id="s", upstream_addr="127.0.0.1:8001"),
        ],
        1795975250.0,
    )
    snapshot = tally.snapshot(SourceState())
    assert snapshot.spread_sessions["chat", "true"] == 1
    assert snapshot.moved_requests == {("chat", "true"): 1, ("chat", "false"): 0}


def test_a_followed_file_counts_its_lines_in_batches_as_one_by_one(tmp_path):
    """The follower hands a file's lines to the tally LINES_PER_BATCH at a time (and a line over the
    length limit as it comes): the counts are those of the same lines taken one by one."""
    lines = varied_lines(seed=9, count=2 * follower.LINES_PER_BATCH + 50)
    lines.insert(300, b"x" * follower.MAX_LINE_BYTES)
    path = tmp_path / "access.log"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    clock = lambda: 1795978300.0  # noqa: E731
    followed = follower.GatewayLogFollower(path, "fast", clock=clock, max_sessions=25)
    one_by_one = SessionTally("fast", clock=clock, max_sessions=25)
    taken = []
    original_take_lines = followed.tally.take_lines
    followed.tally.take_lines = lambda batch, at: taken.append(len(batch)) or original_take_lines(batch, at)
    for line in lines:
        if len(line) < follower.MAX_LINE_BYTES:
            one_by_one.take_line(line, 1795978300.0)
        else:
            one_by_one.line_too_long(1795978300.0)
    snapshot = followed.poll()
    followed.close()
    assert snapshot == one_by_one.snapshot(SourceState(unread_files=snapshot.unread_files))
    assert snapshot.malformed["too_long"] == 1 and snapshot.lines == len(lines)
    assert max(taken) == follower.LINES_PER_BATCH
