"""How many targets and sessions one `kvwatch serve` sustains within its interval, with accurate TTFT.

Each row is one real `kvwatch serve` process for two probe intervals, its targets all routes to one lab
replica with room for every session (time scale 0.05, 256 sequences); the replica's own TTFT of each
request is the ground truth. Two kinds of rows:

- spread: 1 to 32 targets of 8 sessions a run, at the shipped cap on concurrent sessions: the targets'
  phases spread their runs over the interval, so the sessions in flight stay far below the total;
- burst: one target whose run has N sessions, with the cap raised to N so that all N are in flight at
  once: the skew there is what a cap of N would let through.

Per row: the runs that finished within their interval (of those the stop did not cut short), the most
sessions in flight at once, the median and p90 of the client-side minus the replica's TTFT, serve's CPU
(share of one core) and peak RSS, and the machine's 1-minute load average, since other work on the
machine shows in every skew.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from kvwatch.core.stats import median_and_p90
from kvwatch.serve.scheduler import MAX_CONCURRENT_SESSIONS
from kvwatch.store.history import Store

REPO = Path(__file__).resolve().parent.parent
REPLICA_PORT = 28391
SERVE_PORT = 28392
INTERVAL = 10.0
SESSIONS_PER_RUN = 8
SPREAD_TARGETS = (1, 8, 32)  # 8, 64 and 256 sessions per interval
BURSTS = (16, 64, 128, 256)
WORKLOAD = {"system_tokens": 300, "turn_tokens": 100, "max_tokens": 16}
# A real `kvwatch serve` whose cap on concurrent sessions is argv[1]: the constant, set before it runs.
SERVE_WITH_CAP = (
    "import sys; from kvwatch.cli.main import main; from kvwatch.serve import scheduler; "
    "scheduler.MAX_CONCURRENT_SESSIONS = int(sys.argv[1]); sys.exit(main(sys.argv[2:]))"
)


def _wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout: float = 120) -> None:
    """Until `url` answers 200; else the process's log tail. Generous: a loaded 2-core machine takes
    tens of seconds to start a Python process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise RuntimeError(f"{url} did not answer within {timeout:g} s:\n{tail}")


def _config(directory: Path, targets: int, sessions: int) -> Path:
    replica = f"http://127.0.0.1:{REPLICA_PORT}"
    config = {
        "targets": [
            {"name": f"route-{i}", "base_url": replica, "model": "lab-model", "interval_seconds": INTERVAL,
             "sessions_per_run": sessions, "rounds": 4, "block_size": 16, "workload": WORKLOAD}
            for i in range(targets)
        ],
        "exporter": {"listen": f"127.0.0.1:{SERVE_PORT}"},
        "store": {"path": str(directory / "kvwatch.db")},
    }  # fmt: skip
    path = directory / "kvwatch.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in USER_HZ ticks


def _peak_rss_mib(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _serve(directory: Path, config: Path, cap: int) -> tuple[float, float]:
    """Run `kvwatch serve` for two intervals; its CPU share of one core and its peak RSS in MiB."""
    log = directory / "serve.log"
    with log.open("w") as output:
        serve = subprocess.Popen(
            [sys.executable, "-c", SERVE_WITH_CAP, str(cap), "serve", "--config", str(config)],
            cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait_healthy(serve, f"http://127.0.0.1:{SERVE_PORT}/-/healthy", log)
        cpu, started = _cpu_seconds(serve.pid), time.monotonic()
        time.sleep(2 * INTERVAL)
        share = (_cpu_seconds(serve.pid) - cpu) / (time.monotonic() - started)
        peak = _peak_rss_mib(serve.pid)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
        return share, peak
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(timeout=10)


def _runs(sessions: list[dict]) -> list[float]:
    """The length of each run the stop did not cut short: a target's sessions that started within half
    an interval of each other."""
    lengths, by_target = [], {}
    for s in sorted(sessions, key=lambda s: s["started_at"]):
        by_target.setdefault(s["target"], []).append(s)
    for started in by_target.values():
        run = [started[0]]
        for session in [*started[1:], None]:
            if session is not None and session["started_at"] - run[0]["started_at"] < INTERVAL / 2:
                run.append(session)
                continue
            if not any(s["interrupted"] for s in run):
                lengths.append(max(s["finished_at"] for s in run) - run[0]["started_at"])
            run = [session]
    return lengths


def _in_flight(sessions: list[dict]) -> int:
    edges = sorted([(s["started_at"], 1) for s in sessions] + [(s["finished_at"], -1) for s in sessions])
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def _row(kind: str, targets: int, sessions: int, cap: int) -> str:
    replica = f"http://127.0.0.1:{REPLICA_PORT}"
    seen = len(httpx.get(f"{replica}/lab/ground-truth", timeout=10).json()["records"])
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        cpu, rss = _serve(directory, _config(directory, targets, sessions), cap)
        with Store(directory / "kvwatch.db", readonly=True) as store:
            stored = store.sessions()
            rounds = store.rounds(columns=("session", "round", "ttft_seconds", "session_id_sent"))
    truth: dict[str, list[float]] = {}
    for record in httpx.get(f"{replica}/lab/ground-truth", timeout=10).json()["records"][seen:]:
        truth.setdefault(record["session_id"], []).append(record["ttft_seconds"])
    skews = [
        r["ttft_seconds"] - truth[r["session_id_sent"]][r["round"] - 1]
        for r in rounds
        if r["ttft_seconds"] is not None and r["session_id_sent"] in truth
    ]
    runs = _runs(stored)
    within = sum(length <= INTERVAL for length in runs)
    skew = "no round finished | -"
    if len(skews) > 1:
        median, p90 = median_and_p90(skews)
        skew = f"{median * 1000:.1f} ms | {p90 * 1000:.1f} ms"
    return (
        f"| {kind} | {targets} x {sessions} | {cap} | {within}/{len(runs)} | {_in_flight(stored)} "
        f"| {skew} | {cpu:.0%} | {rss:.0f} MiB | {os.getloadavg()[0]:.1f} |"
    )


def run() -> str:
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "replica.log"
        with log.open("w") as output:
            replica = subprocess.Popen(
                [sys.executable, "-m", "kvwatch.cli.main", "lab", "replica",
                 "--port", str(REPLICA_PORT), "--id", "r1", "--time-scale", "0.05", "--max-num-seqs", "256"],
                cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            _wait_healthy(replica, f"http://127.0.0.1:{REPLICA_PORT}/health", log)
            rows = [
                "| schedule | targets x sessions a run | cap | runs within the interval | most in flight "
                "| median skew | p90 skew | serve CPU | serve peak RSS | machine load |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            rows += [_row("spread", n, SESSIONS_PER_RUN, MAX_CONCURRENT_SESSIONS) for n in SPREAD_TARGETS]
            rows += [_row("burst", 1, n, n) for n in BURSTS]
            return "\n".join(rows)
        finally:
            replica.terminate()
            try:
                replica.wait(timeout=30)
            except subprocess.TimeoutExpired:
                replica.kill()
                replica.wait(timeout=10)


if __name__ == "__main__":
    print(run())
