"""How many concurrent probe sessions one core sustains before the client-side TTFT is skewed.

One `kvwatch` process (one core) runs N sessions at once against a lab replica with room for all of
them (prefill is fast and never queues here: time scale 0.05); each round's client-side TTFT is compared
with the TTFT the replica itself recorded for that request. The skew is the client's own overhead: its
event loop parsing streams for N sessions at once.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from collectors.connections import http_client
from collectors.probe import ProbeSettings, run_session
from collectors.workload import synthetic

REPO = Path(__file__).resolve().parent.parent
PORT = 28390
LEVELS = (1, 4, 16, 32, 64)


async def _run(url: str, sessions: int, seed: int) -> list:
    settings = ProbeSettings(base_url=url, model="lab-model", max_tokens=16, timeout_seconds=60)
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with http_client(limits=limits) as client:
        conversations = synthetic(rounds=4, system_tokens=300, turn_tokens=100, seed=seed, sessions=sessions)
        return await asyncio.gather(*(run_session(client, settings, c) for c in conversations))


def run() -> str:
    replica = subprocess.Popen(
        [sys.executable, "-m", "collectors.cli", "lab", "replica", "--port", str(PORT), "--id", "r1",
         "--time-scale", "0.05", "--max-num-seqs", "256"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{PORT}"
    try:
        for _ in range(100):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        rows = ["| concurrent sessions | rounds | median skew | p90 skew |", "|---|---|---|---|"]
        for level in LEVELS:
            seen = len(httpx.get(f"{url}/lab/ground-truth", timeout=10).json()["records"])
            sessions = asyncio.run(_run(url, level, seed=level))
            truth = httpx.get(f"{url}/lab/ground-truth", timeout=10).json()["records"][seen:]
            engine = {}
            for record in truth:
                engine.setdefault(record["session_id"], []).append(record["ttft_seconds"])
            skews = [
                r.ttft_seconds - engine[s.session_id][r.round - 1]
                for s in sessions
                for r in s.rounds
                if r.ok and len(engine.get(s.session_id, [])) >= r.round
            ]
            p90 = statistics.quantiles(skews, n=10)[-1]
            rows.append(
                f"| {level} | {len(skews)} | {statistics.median(skews) * 1000:.1f} ms | {p90 * 1000:.1f} ms |"
            )
        return "\n".join(rows)
    finally:
        replica.terminate()
        replica.wait(timeout=10)
