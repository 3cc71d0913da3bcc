"""Soak: a healthy lab for 70 minutes, with a replica restart and a scale-out, raises only Watchdog.

One `kvwatch lab up` at the production defaults (shipped rules and Alertmanager timers, probes every
30 s through `kvwatch serve`, 5 s scrapes and evaluations). A third of the way in replica r2 restarts
(its counters start from zero), at half way a replica is added, at two thirds the lab heals (the added
replica goes). Every alert that reached kvwatch's webhook, that Alertmanager held at a 30 s sample, or
that Prometheus had pending over the run is reported; only Watchdog may fire.

Every 30 s the resident memory of `kvwatch serve` is read from /proc. It is flat when its least-squares
slope over the second half of the run stays under RSS_BOUND_MIB_PER_HOUR, a bound set before any run.
The first half is left out because RSS only ever steps up there for reasons that stop: the imports and
first runs, the allocator's arenas (Python keeps freed memory for reuse rather than giving it back), the
SQLite writer's page cache (128 KiB, full within minutes) and the gateway-log follower's memory of
sessions, which forgets none before its TTL (30 min by default, about 0.5 KiB a session). So the run is
long enough for its second half to begin past that TTL: 70 minutes by default. A shorter run (30 minutes
read +1.23 MiB/h) counts the follower filling against the bound; the table gives how many sessions it
held at the end, and the slope past a 5-minute warm-up beside the second half's.

Run alone with `python -m benchmarks.bench_soak [--minutes N]` (default 70).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.bench_detection import _kvwatch, _lab_up
from kvwatch.config.settings import GatewayLog
from kvwatch.core.promapi import PrometheusApi
from kvwatch.store.history import Store

# The second half, over which memory is judged, starts 5 minutes past the follower's session TTL.
MINUTES = 2 * (GatewayLog.session_ttl_seconds / 60 + 5)
SAMPLE_SECONDS = 30
WARM_UP_SECONDS = 300
# Two targets every 30 s are 240 probe runs an hour: 1 MiB/h is a leak of about 4 KiB a run, less
# than one stored session's rounds, while the allocator's own noise over 30 minutes is well under it.
RSS_BOUND_MIB_PER_HOUR = 1.0
# fraction of the run -> the lab command that runs then
EVENTS = {1 / 3: ("fault", "restart-replica", "r2"), 1 / 2: ("fault", "scale-out"), 2 / 3: ("heal",)}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"process {pid} has no resident set")


def _slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares MiB per hour of (seconds, MiB) samples."""
    times, values = zip(*samples, strict=True)
    return statistics.linear_regression(times, values).slope * 3600


def _gateway_sessions(exporter_url: str) -> int:
    """The sessions kvwatch serve's gateway-log followers remember now (those seen within the TTL)."""
    text = httpx.get(f"{exporter_url}/metrics", timeout=10).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    return int(sum(sample.value for sample in families["kvwatch_gateway_active_sessions"].samples))


def _held_by_alertmanager(url: str) -> set[str]:
    answer = httpx.get(f"{url}/api/v2/alerts", params={"active": "true"}, timeout=10).json()
    return {a["labels"]["alertname"] for a in answer}


def _pending_in_prometheus(url: str, start: float, end: float) -> set[str]:
    """Alerts Prometheus had pending or firing at any evaluation of the run (near misses included)."""
    series = PrometheusApi(url, 30).query_range("ALERTS", start, end, step=5)
    return {one["metric"]["alertname"] for one in series}


def _lab(state_dir: Path, *args: str) -> None:
    result = _kvwatch("lab", *args, "--state-dir", str(state_dir))
    if result.returncode != 0:
        raise RuntimeError(f"kvwatch lab {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")


def run(minutes: float = MINUTES) -> str:
    duration = minutes * 60
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = Path(tmp) / "lab"
        _lab_up(state_dir, ())
        try:
            status = json.loads(_kvwatch("lab", "status", "--json", "--state-dir", str(state_dir)).stdout)
            serve_pid = status["processes"]["serve"]
            started = time.time()
            rss: list[tuple[float, float]] = []
            held: set[str] = set()
            pending = dict(sorted(EVENTS.items()))
            while (elapsed := time.time() - started) < duration:
                while pending and elapsed >= next(iter(pending)) * duration:
                    _lab(state_dir, *pending.pop(next(iter(pending))))
                rss.append((elapsed, _rss_mib(serve_pid)))
                held |= _held_by_alertmanager(status["alertmanager"])
                time.sleep(min(SAMPLE_SECONDS, max(0.0, duration - elapsed)))
            ended = time.time()
            with Store(state_dir / "kvwatch.db", readonly=True) as store:
                webhook = {a["alertname"] for a in store.alerts(status="firing")}  # since the lab began
            near = _pending_in_prometheus(status["prometheus"], started, ended)
            sessions = _gateway_sessions(status["exporter"])
        finally:
            _kvwatch("lab", "down", "--state-dir", str(state_dir))
    return _table(minutes, webhook, held, near, rss, sessions)


def _table(
    minutes: float,
    webhook: set[str],
    held: set[str],
    near: set[str],
    rss: list[tuple[float, float]],
    gateway_sessions: int,
) -> str:
    def others(names: set[str]) -> str:
        return ", ".join(sorted(names - {"Watchdog"})) or "none"

    def slope_since(seconds: float) -> float:
        since = [s for s in rss if s[0] >= seconds]
        return _slope_per_hour(since) if len(since) > 1 else 0.0

    slope = slope_since(rss[-1][0] / 2)
    values = [mib for _, mib in rss]
    flat = "yes" if slope <= RSS_BOUND_MIB_PER_HOUR else "no"
    marks = range(0, int(rss[-1][0]) + 1, 300)
    every_five = ", ".join(f"{min(rss, key=lambda s: abs(s[0] - m))[1]:.1f}" for m in marks)
    return "\n".join(
        [
            "| minutes | Watchdog at the webhook | other alerts at the webhook | held by Alertmanager "
            "| pending in Prometheus | serve RSS first / last / max | slope, second half "
            "| slope past 5 min | flat |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {minutes:g} | {'yes' if 'Watchdog' in webhook else 'no'} | {others(webhook)} "
            f"| {others(held)} | {others(near)} | {values[0]:.1f} / {values[-1]:.1f} / {max(values):.1f} MiB "
            f"| {slope:+.2f} MiB/h (bound {RSS_BOUND_MIB_PER_HOUR:g}) "
            f"| {slope_since(WARM_UP_SECONDS):+.2f} MiB/h | {flat} |",
            "",
            f"serve RSS every 5 minutes (MiB): {every_five}; gateway sessions remembered at the end: "
            f"{gateway_sessions}",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--minutes", type=float, default=MINUTES, help="length of the run (default %(default)s)"
    )
    print(run(parser.parse_args().minutes))
