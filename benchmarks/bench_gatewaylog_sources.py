"""Gateway-log lines per second per core for each source, against json.loads of the same lines.

Each source's receiver runs as `kvwatch serve` runs it (sources.open_log of a config section, its own
threads) in this process, fed over loopback by a sender in a process of its own
(gatewaylog_senders.py): the lab's line mix of bench_gatewaylog.py as nginx writes it to a file, to
syslog over UDP (RFC 3164, nginx's own) and RFC 5424 over UDP and TCP (octet-counted, a relay's), and
Envoy's records in OTLP Export requests of 16 KiB (Envoy's batch) over gRPC and HTTP. A row's figure is
lines taken divided by this process's CPU time (user and system, every thread) from the first line sent
until the tally has them all: wall time would measure the machine's other work. The baseline is
json.loads of the same lines (nginx's, or Envoy's JSON file log's for OTLP), in the same run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bench_gatewaylog import lines
from benchmarks.gatewaylog_senders import envoy_entries
from kvwatch.collectors.gatewaylogs.follower import GatewayLogFollower
from kvwatch.collectors.gatewaylogs.sources import open_log
from kvwatch.collectors.gatewaylogs.sources.otlp import OtlpSource, OtlpSourceConfig
from kvwatch.collectors.gatewaylogs.tally import SessionTally, SourceState
from kvwatch.config.settings import GatewayLog

LINES = 200_000
# Above any rate the sender reaches: the benchmark measures the receiver, not its per-sender bound.
UNBOUNDED_RATE = 10_000_000
DEADLINE_S = 600.0
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    source: str
    baseline: str  # which lines json.loads parses for the ratio: "nginx" or "envoy"
    lines_per_cpu_second: float
    wall_seconds: float


def free_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1, as syslog listens on both."""
    for _ in range(100):
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            tcp.bind(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            try:
                udp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free for both UDP and TCP on 127.0.0.1")


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {DEADLINE_S:.0f} s")
        time.sleep(0.02)  # seldom, so that waiting costs the measured process next to no CPU time


def baseline(texts: list[bytes]) -> float:
    """Lines per CPU second of json.loads alone."""
    started = time.process_time()
    for text in texts:
        json.loads(text)
    return len(texts) / (time.process_time() - started)


def measure_file(count: int) -> tuple[float, float]:
    """The follower reading a file the gateway wrote; (lines per CPU second, wall seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "access.jsonl"
        path.write_bytes(b"".join(line + b"\n" for line in lines(count)))
        follower = GatewayLogFollower(path, "bench")
        started, wall = time.process_time(), time.monotonic()
        for _ in range(100):  # bounded: a poll reads 16 MiB
            follower.poll()
            if follower.tally.received >= count:
                break
        cpu, wall = time.process_time() - started, time.monotonic() - wall
        follower.close()
    check_counted("file", follower.tally, count)
    return count / cpu, wall


def _pushed(kind: str, port: int) -> tuple[Callable[[], None], Callable[[], None], SessionTally]:
    """The receiver of a kind on a port, not yet started: how to start it, how to stop it, its tally."""
    if kind == "otlp-http":  # serve runs gRPC only: the same receiver with its HTTP transport
        tally = SessionTally("bench", source="otlp", log_format="envoy")
        config = OtlpSourceConfig(
            listen="127.0.0.1:0", http_listen=f"127.0.0.1:{port}", max_records_per_second=UNBOUNDED_RATE
        )
        receiver = OtlpSource(config, tally)
        return receiver.start, receiver.stop, tally
    source, log_format = ("otlp", "envoy") if kind.startswith("otlp") else ("syslog", "nginx")
    section = GatewayLog(
        name="bench",
        source=source,
        format=log_format,
        listen=f"127.0.0.1:{port}",
        max_records_per_second=UNBOUNDED_RATE,
    )
    log = open_log(section)
    return log.start, log.close, log.tally


def measure_pushed(kind: str, count: int) -> tuple[float, float]:
    """One push source fed by its sender; (lines per CPU second, wall seconds)."""
    port = free_port()
    start, stop, tally = _pushed(kind, port)
    start()
    command = [sys.executable, "-m", "benchmarks.gatewaylog_senders", kind, str(port), str(count)]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    with subprocess.Popen(command, cwd=REPO, **pipes) as sender:
        try:
            if sender.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{kind}: the sender failed to build its traffic")
            started, wall = time.process_time(), time.monotonic()
            _feed(sender, tally, kind)
            wait_until(lambda: tally.received >= count, f"{kind}: {count} lines received")
            cpu, wall = time.process_time() - started, time.monotonic() - wall
        finally:
            sender.kill()
            stop()
    check_counted(kind, tally, count)
    return count / cpu, wall


def check_counted(kind: str, tally: SessionTally, count: int) -> None:
    """Every line taken as a request: none malformed, none refused."""
    snapshot = tally.snapshot(SourceState())
    lost = {**snapshot.malformed, **snapshot.refused}
    if snapshot.lines != count or any(lost.values()):
        raise RuntimeError(f"{kind}: {snapshot.lines} of {count} lines taken, {lost}")


def _feed(sender: subprocess.Popen, tally: SessionTally, kind: str) -> None:
    """Let the sender go, answering each window it reports once the receiver has taken it."""
    sender.stdin.write("go\n")
    sender.stdin.flush()
    for report in sender.stdout:
        if report.startswith("sent "):
            sent = int(report.split()[1])
            wait_until(lambda sent=sent: tally.received >= sent, f"{kind}: {sent} lines received")
            sender.stdin.write("\n")
            sender.stdin.flush()
        elif report.strip() == "done":
            return
    raise RuntimeError(f"{kind}: the sender ended before sending everything (exit {sender.wait()})")


SOURCES = {
    "file": "nginx",
    "syslog-udp-3164": "nginx",
    "syslog-udp-5424": "nginx",
    "syslog-tcp-5424": "nginx",
    "otlp-grpc": "envoy",
    "otlp-http": "envoy",
}


def measure(count: int = LINES) -> tuple[dict[str, float], list[Row]]:
    """json.loads' lines per CPU second by format, and each source's row."""
    texts = {
        "nginx": lines(count),
        "envoy": [json.dumps(entry).encode() for entry in envoy_entries(count)],
    }
    baselines = {name: baseline(parsed) for name, parsed in texts.items()}
    rows = []
    for kind, parsed in SOURCES.items():
        rate, wall = measure_file(count) if kind == "file" else measure_pushed(kind, count)
        rows.append(Row(kind, parsed, rate, wall))
    return baselines, rows


def table(baselines: dict[str, float], rows: list[Row], count: int) -> str:
    """The rows as Markdown, after the baselines and the machine's load average as the run ends (1, 5
    and 15 minutes): other work on the machine inflates the receivers' CPU time too."""
    load = ", ".join(f"{average:.1f}" for average in os.getloadavg())
    lines_out = [
        f"{count:,} lines a source; json.loads alone: {baselines['nginx']:,.0f} nginx lines/s, "
        f"{baselines['envoy']:,.0f} Envoy lines/s per core; load average {load} at the end.",
        "",
        "| source | lines/s per core | CPU per line vs json.loads | wall seconds |",
        "|---|---|---|---|",
    ]
    for row in rows:
        ratio = baselines[row.baseline] / row.lines_per_cpu_second
        lines_out.append(
            f"| {row.source} | {row.lines_per_cpu_second:,.0f} | {ratio:.1f} × | {row.wall_seconds:.2f} |"
        )
    return "\n".join(lines_out)


def run(count: int = LINES) -> str:
    baselines, rows = measure(count)
    return table(baselines, rows, count)
