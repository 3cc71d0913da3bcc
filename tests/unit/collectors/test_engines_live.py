"""Live lab replicas and the real routers in front of them: the figures against the replicas' ground truth."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from engine_expositions import read

from conftest import Replica
from kvwatch.collectors.engines import Snapshot, normalise
from paths import REPO
from processes import free_port, http_get, stop

BLOCK = 16  # the lab's default prefix-cache block size
LAB_ARGS = ("--time-scale", "0.05", "--answer-tokens", "8")
SYSTEM_PROMPT = (
    "You are the kvwatch lab assistant. Answer briefly and precisely, keep the conversation's "
    "context in mind, and never invent facts you were not told earlier in this conversation."
)


def scrape_live(metrics_url: str) -> Snapshot:
    return read(http_get(metrics_url, timeout=5).text, time.monotonic())


def eventually(probe: Callable[[], object], timeout: float = 10.0) -> object:
    """Poll `probe` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while not (result := probe()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{probe} did not come true within {timeout} s")
        time.sleep(0.05)
    return result


def converse(url: str, sessions: int, rounds: int, first_session: int = 0) -> int:
    """Multi-turn sessions: each round resends the session's questions so far plus a new one, so rounds
    share a growing prefix. Every other session streams. Returns the number of requests sent."""
    with httpx.Client(base_url=url, timeout=10) as client:
        for session in range(first_session, first_session + sessions):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}]
            for round_number in range(1, rounds + 1):
                question = f"In session {session}, question {round_number}: what did we cover so far?"
                messages.append({"role": "user", "content": question})
                body = {"model": "lab-model", "messages": messages, "stream": session % 2 == 1}
                client.post("/v1/chat/completions", json=body).raise_for_status()
    return sessions * rounds


def records_since(replica: Replica, already: int, expected: int) -> list[dict]:
    """The ground-truth records after the first `already`, once `expected` of them exist.

    A streamed request's record lands just after its last chunk, so wait for it.
    """

    def arrived() -> list[dict] | None:
        records = replica.ground_truth()[already:]
        return records if len(records) >= expected else None

    return eventually(arrived)


def assert_quantiles_in_true_buckets(record, snapshot: Snapshot, ttfts: list[float]) -> None:
    """Each TTFT quantile lies in the bucket that holds the true quantile of the requests.

    Inside a bucket the histogram only knows counts, so interpolation can place it anywhere there.
    """
    bounds = [bound for bound, _ in snapshot.ttft_buckets]
    ordered = sorted(ttfts)
    quantiles = {0.5: record.ttft_p50_seconds, 0.9: record.ttft_p90_seconds, 0.99: record.ttft_p99_seconds}
    for q, estimate in quantiles.items():
        truth = ordered[math.ceil(q * len(ordered)) - 1]
        assert bisect_left(bounds, estimate) == bisect_left(bounds, truth), (q, estimate, truth)


# Live lab replicas: the figures against the replica's ground truth.


@pytest.mark.integration
@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_windowed_hit_ratio_equals_the_replicas_ground_truth(start_replica, flavour):
    """Token counters give the exact ratio of cached to prompt tokens of the requests in the window."""
    replica = start_replica("r1", flavour, *LAB_ARGS)
    already = converse(replica.url, sessions=1, rounds=2)  # history from before the window
    records_since(replica, 0, already)
    before = scrape_live(f"{replica.url}/metrics")
    assert before.flavour == flavour
    records = records_since(replica, already, converse(replica.url, sessions=3, rounds=3, first_session=1))
    now = scrape_live(f"{replica.url}/metrics")
    record = normalise(now, before)

    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    assert 0 < cached < prompt
    assert (record.hit_ratio, record.hit_ratio_source) == (cached / prompt, "tokens")
    assert (record.prompt_tokens, record.cached_tokens) == (prompt, cached)
    assert_quantiles_in_true_buckets(record, now, [r["ttft_seconds"] for r in records])
    assert (record.requests_running, record.requests_waiting, record.missing) == (0, 0, ())
    assert record.prefix_caching_enabled is {"vllm": True, "sglang": None}[flavour]


@pytest.mark.integration
def test_v0_gauge_is_a_block_ratio_close_below_the_token_ratio(start_replica):
    """V0 counts blocks: hits are whole blocks (as cached tokens are), but every request's partial
    last block is a lookup. So the gauge equals the block ratio of the ground truth and sits below
    the token ratio by at most one block per request. It is the engine's lifetime ratio; the replica
    is fresh, so here lifetime and window are the same requests."""
    replica = start_replica("r1", "vllm-legacy", *LAB_ARGS)
    before = scrape_live(f"{replica.url}/metrics")
    assert normalise(before).hit_ratio is None  # -1 until the first request: unknown, not 0
    records = records_since(replica, 0, converse(replica.url, sessions=3, rounds=3))
    record = normalise(scrape_live(f"{replica.url}/metrics"), before)

    hit_blocks = sum(r["cached_tokens"] // BLOCK for r in records)
    lookup_blocks = sum(math.ceil(r["prompt_tokens"] / BLOCK) for r in records)
    assert record.hit_ratio_source == "v0-gauge"
    assert record.hit_ratio == pytest.approx(hit_blocks / lookup_blocks)
    prompt, cached = sum(r["prompt_tokens"] for r in records), sum(r["cached_tokens"] for r in records)
    assert cached / prompt * prompt / (prompt + BLOCK * len(records)) <= record.hit_ratio <= cached / prompt
    assert record.prompt_tokens == prompt and record.prefix_caching_enabled is True


@pytest.mark.integration
@pytest.mark.parametrize("flavour", ["vllm", "vllm-legacy", "sglang"])
def test_a_window_without_traffic_has_no_hit_ratio(start_replica, flavour):
    replica = start_replica("r1", flavour, *LAB_ARGS)
    records_since(replica, 0, converse(replica.url, sessions=1, rounds=2))
    before = scrape_live(f"{replica.url}/metrics")
    record = normalise(scrape_live(f"{replica.url}/metrics"), before)
    assert (record.hit_ratio, record.prompt_tokens, record.ttft_p50_seconds) == (None, 0, None)
    assert normalise(before).hit_ratio > 0  # the lifetime figure still has the earlier requests


@pytest.mark.integration
@pytest.mark.parametrize(("flavour", "hit_ratio"), [("vllm", 0.0), ("vllm-legacy", None)])
def test_prefix_caching_switched_off_is_reported(start_replica, flavour, hit_ratio):
    """V1 counts the prompt tokens it computed, none cached: 0 %, though it looks nothing up. V0 only
    has its own gauge, which has no data without lookups: unknown, not 0 %."""
    replica = start_replica("r1", flavour, *LAB_ARGS)
    replica.set_faults(prefix_caching=False).raise_for_status()
    before = scrape_live(f"{replica.url}/metrics")
    records_since(replica, 0, converse(replica.url, sessions=1, rounds=2))
    record = normalise(scrape_live(f"{replica.url}/metrics"), before)
    assert record.prefix_caching_enabled is False
    assert record.hit_ratio == hit_ratio and record.prompt_tokens > 0
    assert record.local_hit_ratio is None


@pytest.mark.integration
def test_a_restarted_replica_counts_from_zero(start_replica):
    """A restart puts a new process with fresh counters behind the same URL: here the second scrape
    reads another, fresh replica, and the window holds exactly that replica's requests."""
    old, new = start_replica("r1", "vllm", *LAB_ARGS), start_replica("r2", "vllm", *LAB_ARGS)
    records_since(old, 0, converse(old.url, sessions=3, rounds=3))
    records = records_since(new, 0, converse(new.url, sessions=1, rounds=2))
    record = normalise(scrape_live(f"{new.url}/metrics"), scrape_live(f"{old.url}/metrics"))
    prompt, cached = sum(r["prompt_tokens"] for r in records), sum(r["cached_tokens"] for r in records)
    assert record.counter_reset
    assert (record.hit_ratio, record.prompt_tokens, record.cached_tokens) == (cached / prompt, prompt, cached)


# The real routers in front of lab replicas.

ROUTER_PROGRAMS = {
    "sglang-router": [sys.executable, "-m", "sglang_router.launch_router"],
    "vllm-router": [str(Path(sys.executable).with_name("vllm-router"))],
}


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[Callable[[str, list[Replica]], tuple[str, str]]]:
    """Start a real router (round robin) in front of `replicas`; returns its URL and metrics URL."""
    started: list[subprocess.Popen] = []

    def start(flavour: str, replicas: list[Replica]) -> tuple[str, str]:
        if not Path(ROUTER_PROGRAMS[flavour][0]).exists():
            pytest.fail(f"{flavour} is not installed (`make test` installs it with the dev dependencies)")
        port, metrics_port = free_port(), free_port()
        command = [
            *ROUTER_PROGRAMS[flavour],
            *("--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
            *("--worker-urls", *(replica.url for replica in replicas)),
        ]
        # A router must never reach out for a tokenizer: point Hugging Face at a dead loopback port.
        env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
        log = tmp_path / f"{flavour}.log"
        with log.open("w") as out:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        started.append(process)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"{flavour} exited with {process.returncode}:\n{log.read_text()}")
            try:
                state = http_get(f"{url}/readiness", timeout=1).json()
            except (httpx.HTTPError, ValueError):
                return False
            return state.get("healthy_workers") == len(replicas)

        eventually(ready, timeout=30)
        return url, f"http://127.0.0.1:{metrics_port}/metrics"

    yield start
    for process in started:
        stop(process)


@pytest.mark.integration
@pytest.mark.parametrize("flavour", ["sglang-router", "vllm-router"])
def test_router_requests_per_worker_match_the_replicas_ground_truth(start_replica, start_router, flavour):
    """sglang-router 0.3.2 (`smg_*`: per worker from the circuit breaker's outcomes) and vllm-router
    0.1.17 (`vllm_router_processed_requests_total`) against what each replica really received."""
    replicas = [start_replica(f"r{n}", "vllm", *LAB_ARGS) for n in (1, 2, 3)]
    url, metrics_url = start_router(flavour, replicas)
    before = scrape_live(metrics_url)
    assert before.flavour == flavour
    assert normalise(before).per_worker == {replica.url: 0 for replica in replicas}

    requests = converse(url, sessions=7, rounds=1)
    eventually(lambda: sum(len(replica.ground_truth()) for replica in replicas) == requests)
    received = {replica.url: len(replica.ground_truth()) for replica in replicas}
    record = normalise(scrape_live(metrics_url), before)
    assert record.per_worker == received
    assert sorted(received.values()) == [2, 2, 3]  # round robin: 7 requests over 3 workers
    assert record.policy_decisions == {"round_robin": requests}
