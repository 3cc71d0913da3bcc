"""The A/B experiment under load: round robin against affinity at a concurrency that saturates the replicas.

Two labs of four simulated replicas, one per route, so that one route's queue never slows the other's:
A is the first lab's round-robin listener, B the second's affinity listener. Each replica computes one
prefill at a time, taking time in proportion to the uncached prompt tokens, so requests queue once the
replicas are busy; the replicas run at three times the default timings (time scale 3), so that what
they simulate, not the client's or the gateway's CPU, is what saturates. `kvwatch experiment` runs the
same 32 six-round conversations through both, 16 sessions in flight per route from the start (a closed
loop): about four per replica. A short shared system prompt and long user turns keep most of each
prompt the session's own history. With affinity every warm round reuses that history and only its new
tokens are computed, so the queue drains faster: throughput is higher and the tail TTFT lower, not
only the median.

Run alone with `python -m benchmarks.bench_experiment_load`.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.experiment.design import Load, Workload
from kvwatch.experiment.runner import run_experiment
from kvwatch.experiment.tables import load_rows, round_rows

REPO = Path(__file__).resolve().parent.parent
BASE_PORTS = (28400, 28500)  # one block per lab
REPLICAS, TIME_SCALE, CONCURRENCY = 4, 3.0, 16
WORKLOAD = Workload(sessions=32, rounds=6, system_tokens=200, turn_tokens=600, seed=5)


def _kvwatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvwatch.cli.main", "lab", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@contextlib.contextmanager
def _lab(state_dir: Path, base_port: int) -> Iterator[dict]:
    """A lab without background users, probes or dashboard: its status; stopped on leaving."""
    up = _kvwatch("up", "--detach", "--replicas", str(REPLICAS), "--time-scale", str(TIME_SCALE),
                  "--users", "0", "--no-probes", "--no-dashboard", "--base-port", str(base_port),
                  "--state-dir", str(state_dir))  # fmt: skip
    try:
        if up.returncode != 0:
            raise RuntimeError(f"kvwatch lab up failed:\n{up.stdout[-2000:]}\n{up.stderr[-2000:]}")
        yield json.loads(_kvwatch("status", "--json", "--state-dir", str(state_dir)).stdout)
    finally:
        _kvwatch("down", "--state-dir", str(state_dir))


def _ms(row: dict, name: str) -> str:
    low, value, high = (row[f"ttft_{name}{part}_seconds"] * 1000 for part in ("_low", "", "_high"))
    return f"{value:.0f} ms [{low:.0f}–{high:.0f}]"


def run() -> str:
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as labs:
        first, second = (
            labs.enter_context(_lab(Path(scratch) / f"lab{n}", port)) for n, port in enumerate(BASE_PORTS)
        )
        routes = [
            ProbeSettings(lab["gateways"][mode], "lab-model", target=mode, route_mode=mode, max_tokens=8)
            for lab, mode in ((first, "round_robin"), (second, "affinity"))
        ]
        experiment = run_experiment(*routes, WORKLOAD.conversations(), Load(concurrency=CONCURRENCY))
    failed = [s.error_kind for s in experiment.all_sessions if not s.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} sessions failed: {sorted(set(failed))}")
    rounds = round_rows(experiment)
    lines = [
        f"{WORKLOAD.sessions} sessions of {WORKLOAD.rounds} rounds per route ({WORKLOAD.describe()}), "
        f"{CONCURRENCY} in flight per route over {REPLICAS} replicas (time scale {TIME_SCALE:g}); TTFT "
        "over all rounds with bootstrap 95 % intervals.",
        "",
        "| route | requests/s | prompt tokens/s | generated tokens/s | TTFT p50 | TTFT p99 | cached ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in load_rows(experiment):
        mine = [r for r in rounds if r["route"] == row["route"]]
        cached = sum(r["cached_tokens"] for r in mine) / sum(r["prompt_tokens"] for r in mine)
        lines.append(
            f"| {row['route']} | {row['requests_per_second']:.2f} | {row['prompt_tokens_per_second']:.0f} "
            f"| {row['generated_tokens_per_second']:.0f} | {_ms(row, 'median')} | {_ms(row, 'p99')} "
            f"| {cached:.0%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
