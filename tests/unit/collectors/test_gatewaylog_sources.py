"""Gateway-log sources: the tally every source feeds, and the syslog receiver on real loopback sockets."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvwatch.collectors.gatewaylogs.sources import SOURCES, PushedLog, open_log
from kvwatch.collectors.gatewaylogs.sources.syslog import MAX_MESSAGE_BYTES, Refused, message_of
from kvwatch.collectors.gatewaylogs.tally import REFUSED_REASONS, SessionTally, SourceState
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import Config, ExporterSettings, GatewayLog, StoreSettings, load_config
from kvwatch.serve.scheduler import Service
from processes import free_port

R1, R2 = "10.0.0.1:8000", "10.0.0.2:8000"
DEADLINE_S = 20.0


def nginx_record(
    session: str = "s1", upstream: str = R1, path: str = "/v1/chat/completions", **changes
) -> dict:
    """A record of the lab's `kvwatch_json` log_format, of now (within the spread window)."""
    return {
        "msec": time.time(),
        "listener": "affinity",
        "request": f"POST {path}",
        "status": 200,
        "upstream_addr": upstream,
        "session_id": session,
        "session_source": "client",
        **changes,
    }


def line(**changes) -> bytes:
    return json.dumps(nginx_record(**changes)).encode()


def rfc3164(message: bytes, *, hostname: bool = True) -> bytes:
    """As nginx's `access_log syslog:server=...` sends it (`nohostname` leaves the host out)."""
    return b"<190>Dec  5 05:30:00 " + (b"gw-1 " if hostname else b"") + b"nginx: " + message


def rfc5424(message: bytes, structured: bytes = b"-") -> bytes:
    """As rsyslog's RSYSLOG_SyslogProtocol23Format forwards it."""
    return b"<190>1 2026-12-05T05:30:00.123456+00:00 gw-1 nginx - - " + structured + b" " + message


def octet_counted(frame: bytes) -> bytes:
    return b"%d %s" % (len(frame), frame)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.01)


# --- the tally's interface ----------------------------------------------------------------------


def test_a_record_counts_as_its_line_does():
    by_line, by_record = SessionTally("a"), SessionTally("b")
    for upstream in (R1, R2):
        by_line.take_line(line(upstream=upstream), time.time())
        by_record.take_record(nginx_record(upstream=upstream), time.time())
    a, b = by_line.snapshot(SourceState()), by_record.snapshot(SourceState())
    assert a.requests == b.requests == {("affinity", R1): 1, ("affinity", R2): 1}
    assert a.spread_sessions == b.spread_sessions == {("affinity", "false"): 1, ("affinity", "true"): 0}


def test_a_record_without_a_field_is_malformed_and_an_unknown_refusal_reason_is_a_bug():
    tally = SessionTally("a")
    tally.take_record({"msec": 1.0}, time.time())
    tally.refuse("truncated")
    tally.refuse("kernel_drops", 7)
    snapshot = tally.snapshot(SourceState())
    assert snapshot.malformed["missing_field"] == 1 and snapshot.lines == 1
    assert snapshot.refused == {**dict.fromkeys(REFUSED_REASONS, 0), "truncated": 1, "kernel_drops": 7}
    with pytest.raises(ValueError, match="none of truncated"):
        tally.refuse("bad_luck")


def test_only_inference_paths_count_and_others_are_never_keyless():
    tally = SessionTally("a")
    now = time.time()
    tally.take_line(line(path="/v1/models", session_source="assigned", session="r1"), now)
    tally.take_line(line(path="/health", session_source="assigned", session="r2"), now)
    tally.take_line(line(session="s1"), now)
    snapshot = tally.snapshot(SourceState())
    assert snapshot.other_requests == {"affinity": 2}
    assert snapshot.without_session_key == {"affinity": 0}
    assert snapshot.requests == {("affinity", R1): 1}
    narrow = SessionTally("b", inference_paths=("/v1/completions",))
    narrow.take_line(line(), now)
    assert narrow.snapshot(SourceState()).other_requests == {"affinity": 1}


# --- syslog messages ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        rfc3164(b'{"a":1}'),
        rfc3164(b'{"a":1}', hostname=False),
        rfc3164(b'{"a":1}\n'),
        b"<190>nginx[123]: " + b'{"a":1}',
        rfc5424(b'{"a":1}'),
        rfc5424(b'\xef\xbb\xbf{"a":1}'),
        rfc5424(b'{"a":1}', b'[meta x="a \\] b"][origin ip="10.0.0.1"]'),
    ],
)
def test_the_message_of_rfc_3164_and_5424(frame):
    assert message_of(frame) == b'{"a":1}'


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b'{"a":1}', "malformed"),
        (b"<999>1 x", "malformed"),
        (b"<190>1 2026-12-05T05:30:00Z gw-1 nginx", "truncated"),
        (b'<190>1 2026-12-05T05:30:00Z gw-1 nginx - - [meta x="open', "truncated"),
        (b"<190>1 2026-12-05T05:30:00Z gw-1 nginx - - ", "truncated"),
        (b"<190>1 2026-12-05T05:30:00Z gw-1 nginx - - x msg", "malformed"),
        (b"<190>Dec  5 05:30:00 gw-1 nginx: ", "truncated"),
    ],
)
def test_what_is_no_syslog_message_is_refused_by_reason(frame, reason):
    with pytest.raises(Refused) as refused:
        message_of(frame)
    assert refused.value.reason == reason


# --- the receiver -------------------------------------------------------------------------------


@pytest.fixture
def receive(request) -> Callable[..., PushedLog]:
    def start(**settings) -> PushedLog:
        pushed = open_log(
            GatewayLog(name="gw", source="syslog", listen=f"127.0.0.1:{free_port()}", **settings)
        )
        pushed.start()
        request.addfinalizer(pushed.close)
        return pushed

    return start


def address(pushed: PushedLog) -> tuple[str, int]:
    return pushed.receiver.host, pushed.receiver.port


def send_udp(pushed: PushedLog, *datagrams: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        for datagram in datagrams:
            udp.sendto(datagram, address(pushed))


def send_tcp(pushed: PushedLog, data: bytes) -> None:
    with socket.create_connection(address(pushed), timeout=DEADLINE_S) as tcp:
        tcp.sendall(data)


def until(pushed: PushedLog, what: str, done: Callable) -> None:
    wait_until(lambda: done(pushed.poll()), what)


def test_nginx_over_udp_is_counted_as_its_file_would_be(receive):
    pushed = receive()
    send_udp(pushed, rfc3164(line(upstream=R1)), rfc3164(line(upstream=R2), hostname=False))
    until(pushed, "2 lines", lambda s: s.lines == 2)
    snapshot = pushed.latest
    assert snapshot.requests == {("affinity", R1): 1, ("affinity", R2): 1}
    assert snapshot.spread_sessions[("affinity", "false")] == 1
    assert snapshot.readable and snapshot.source == "syslog" and snapshot.last_record_at > 0


def test_a_relay_over_tcp_octet_counted_and_newline_framed_on_one_connection(receive):
    pushed = receive()
    frames = octet_counted(rfc5424(line(session="a"))) + rfc3164(line(session="b")) + b"\n"
    send_tcp(pushed, frames + octet_counted(rfc5424(line(session="c"))))
    until(pushed, "3 lines", lambda s: s.lines == 3)
    assert pushed.latest.active_sessions == {"affinity": 3}
    assert sum(pushed.latest.refused.values()) == 0


def test_garbage_is_counted_and_the_lines_around_it_are_not_lost(receive):
    pushed = receive()
    send_udp(pushed, b"\x00\xff garbage", rfc3164(line(session="a")))
    send_tcp(pushed, b"GET / HTTP/1.1\r\n\r\n" + rfc3164(line(session="b")) + b"\n" + b"12x34 y\n")
    send_tcp(pushed, octet_counted(rfc5424(b"not json")) + octet_counted(rfc5424(line(session="c"))))
    until(pushed, "3 lines and the garbage", lambda s: s.active_sessions.get("affinity") == 3)
    until(pushed, "the garbage", lambda s: s.refused["malformed"] == 3 and s.malformed["invalid_json"] == 1)


def test_oversize_messages_are_skipped_and_the_next_one_read(receive):
    pushed = receive()
    huge = rfc5424(b'{"pad":"' + b"x" * MAX_MESSAGE_BYTES + b'"}')
    send_udp(pushed, huge, rfc3164(line(session="a")))
    send_tcp(pushed, octet_counted(huge) + octet_counted(rfc5424(line(session="b"))))
    send_tcp(pushed, huge + b"\n" + rfc3164(line(session="c")) + b"\n")
    until(pushed, "3 lines", lambda s: s.active_sessions.get("affinity") == 3)
    until(pushed, "3 oversize", lambda s: s.refused["oversize"] == 3)


def test_frames_cut_short_are_truncated_and_the_connection_before_them_read(receive):
    pushed = receive()
    whole = octet_counted(rfc5424(line(session="a")))
    send_tcp(pushed, whole + octet_counted(rfc5424(line(session="b")))[:-10])
    send_tcp(pushed, rfc3164(line(session="c")) + b"\n" + rfc3164(line(session="d"))[:40])
    send_udp(pushed, b"<190>1 2026-12-05T05:30:00Z gw-1")
    until(pushed, "2 lines", lambda s: s.active_sessions.get("affinity") == 2)
    until(pushed, "3 truncated", lambda s: s.refused["truncated"] == 3)


def test_a_flooding_sender_is_refused_over_its_rate_and_another_loses_nothing(receive):
    pushed = receive(max_records_per_second=50)
    flood = b"".join(octet_counted(rfc5424(line(session=f"f{i}"))) for i in range(2000))
    send_tcp(pushed, flood)
    until(pushed, "the flood", lambda s: s.lines + s.refused["over_rate"] == 2000)
    assert pushed.latest.refused["over_rate"] >= 2000 - 50 - 50 * DEADLINE_S
    # Another sender (another loopback address) has a rate of its own.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.2", 0))
        for i in range(20):
            udp.sendto(rfc3164(line(session=f"o{i}")), address(pushed))
    before = pushed.latest.lines
    until(pushed, "the other sender's 20 lines", lambda s: s.lines == before + 20)


def test_datagrams_the_kernel_drops_are_counted(receive):
    pushed = receive()
    sent = 30_000
    # The receiver thread waits for the tally meanwhile: its receive queue fills.
    with pushed.tally._lock, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        for i in range(sent):
            udp.sendto(rfc3164(line(session=f"s{i}")), address(pushed))
    # The kernel reports its drops with the next datagram it queues: one more until it had room for one.
    markers, seen = 0, -1

    def all_accounted_for() -> bool:
        nonlocal markers, seen
        snapshot = pushed.poll()
        accounted = snapshot.lines + snapshot.refused["kernel_drops"]
        if accounted == sent + markers:
            return True
        if accounted == seen:  # the receiver is idle: the drops since its last datagram are not told yet
            send_udp(pushed, rfc3164(line(session=f"marker{markers}")))
            markers += 1
        seen = accounted
        return False

    wait_until(all_accounted_for, "every datagram read or dropped")
    assert pushed.latest.refused["kernel_drops"] > 0


def test_stop_closes_the_sockets_and_the_port_can_be_bound_again(receive):
    pushed = receive()
    pushed.close()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(address(pushed))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(address(pushed))


# --- config and serve ---------------------------------------------------------------------------


def test_every_source_is_registered_and_an_unknown_one_is_refused_with_the_list(tmp_path: Path):
    assert list(SOURCES) == ["file", "syslog", "otlp"]
    config = tmp_path / "kvwatch.yaml"
    config.write_text("gateway_logs:\n  - name: gw\n    source: sislog\n")
    with pytest.raises(
        ConfigError, match='unknown source "sislog"; did you mean "syslog"\\? known: file, otlp, syslog'
    ):
        load_config(config)


def test_a_push_source_listens_on_loopback_unless_told_and_a_file_needs_its_path():
    assert GatewayLog(name="gw", source="syslog").listen == "127.0.0.1:5514"
    assert GatewayLog(name="gw", source="syslog", listen="9999").listen == "127.0.0.1:9999"
    assert GatewayLog(name="gw", path=Path("a.jsonl")).source == "file"
    with pytest.raises(ValueError, match="path: required for source file"):
        GatewayLog(name="gw")
    with pytest.raises(ValueError, match="listen: a file is read"):
        GatewayLog(name="gw", path=Path("a.jsonl"), listen="127.0.0.1:9999")


def test_serve_receives_syslog_and_exports_it_as_a_file_log(tmp_path: Path):
    port = free_port()
    config = Config(
        gateway_logs=(GatewayLog(name="gw", source="syslog", listen=f"127.0.0.1:{port}"),),
        exporter=ExporterSettings(f"127.0.0.1:{free_port()}"),
        store=StoreSettings(tmp_path / "kvwatch.db"),
    )
    service = Service(config)
    (pushed,) = service.followers
    try:
        pushed.start()
        send_udp(pushed, rfc3164(line(upstream=R1)), rfc3164(line(upstream=R2)), b"junk")

        def value(name: str, **labels: str) -> float | None:
            return service.registry.get_sample_value(f"kvwatch_gateway_{name}", {"log": "gw", **labels})

        def received() -> bool:
            service.poll_gateway_logs()
            return value("lines_total") == 2 and value("log_refused_total", reason="malformed") == 1

        wait_until(received, "2 lines and 1 refused")
        assert value("session_spread_sessions", listener="affinity", failover="false") == 1
        assert value("log_info", expect_sticky="true", source="syslog") == 1
        assert value("log_last_record_timestamp_seconds") > 0
    finally:
        pushed.close()
        service.store.close()


def test_serve_names_the_gateway_log_whose_port_is_taken_and_starts_nothing(tmp_path: Path, capsys):
    from kvwatch.cli.main import main

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        config = tmp_path / "kvwatch.yaml"
        config.write_text(
            f"gateway_logs:\n  - name: gw\n    source: syslog\n    listen: 127.0.0.1:{port}\n"
            f"exporter:\n  listen: 127.0.0.1:{free_port()}\nstore:\n  path: {tmp_path / 'kvwatch.db'}\n"
        )
        assert main(["serve", "--config", str(config)]) == 1
    assert "kvwatch serve: gateway log gw: cannot listen for its syslog source: Address already in use" in (
        capsys.readouterr().err
    )


def test_an_otlp_log_whose_token_file_cannot_be_read_is_refused_before_anything_starts(tmp_path, capsys):
    from kvwatch.cli.main import main

    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        f"gateway_logs:\n  - name: gw\n    format: envoy\n    source: otlp\n    listen: {free_port()}\n"
        f"    token_file: {tmp_path / 'missing'}\n"
        f"exporter:\n  listen: 127.0.0.1:{free_port()}\nstore:\n  path: {tmp_path / 'kvwatch.db'}\n"
    )
    assert main(["serve", "--config", str(config)]) == 1
    assert (
        f"kvwatch serve: gateway log gw: cannot read OTLP bearer token file {tmp_path / 'missing'}: "
        "No such file or directory" in capsys.readouterr().err
    )
