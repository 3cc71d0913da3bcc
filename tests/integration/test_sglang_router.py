"""The real sglang-router (SGLang Model Gateway) in front of three lab replicas.

kvwatch has to tell a router that keeps each conversation on the replica holding its KV cache from
one that spreads it. These tests check that the lab replicas behave behind the real router as they
should, so the lab is a faithful stand-in: what a client sees (X-Worker-Id, usage.cached_tokens)
must agree with the replicas' own ground truth under both a spreading policy (round_robin) and a
sticky one (manual + X-SMG-Routing-Key).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Replica, Router
from processes import http_get

pytestmark = pytest.mark.integration

# With one block of answer per round, a replica that served the previous round holds that round's
# whole prompt in cache, and a replica that did not holds strictly less of it (see `_history_cached`).
BLOCK_SIZE = 16
REPLICA_ARGS = ("--time-scale", "0.05", "--answer-tokens", str(BLOCK_SIZE), "--block-size", str(BLOCK_SIZE))
ROUTING_KEY = "X-SMG-Routing-Key"
SYSTEM_PROMPT = (
    "You are the kvwatch lab assistant. Answer briefly and precisely, keep the conversation's "
    "context in mind, and never invent facts you were not told earlier in this conversation."
)
TIMEOUT = httpx.Timeout(10.0)
ROUNDS = 4


@dataclass(frozen=True)
class Turn:
    """One round of one session, as the client saw it through the router."""

    session: str
    worker: str
    request_id: str
    prompt_tokens: int
    cached_tokens: int


@pytest.fixture
def replicas(start_replica: Callable[..., Replica]) -> list[Replica]:
    return [start_replica(f"r{n}", "vllm", *REPLICA_ARGS) for n in (1, 2, 3)]


def _chat(client: httpx.Client, messages: list[dict], session: str, stream: bool) -> tuple[Turn, str]:
    """Send one chat round through the router; return what the client saw and the assistant's answer."""
    body = {"model": "lab-model", "messages": messages}
    headers = {ROUTING_KEY: session}
    if not stream:
        response = client.post("/v1/chat/completions", json=body, headers=headers)
        response.raise_for_status()
        worker, completion = response.headers["X-Worker-Id"], response.json()
        completion_id, usage = completion["id"], completion["usage"]
        answer = completion["choices"][0]["message"]["content"]
    else:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            response.raise_for_status()
            assert response.headers["Content-Type"].startswith("text/event-stream")
            worker = response.headers["X-Worker-Id"]
            events = [
                line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")
            ]
        assert events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
        chunks = [json.loads(event) for event in events[:-1]]
        deltas = [chunk["choices"][0]["delta"].get("content") for chunk in chunks if chunk["choices"]]
        completion_id, usage = chunks[0]["id"], chunks[-1]["usage"]
        assert {chunk["id"] for chunk in chunks} == {completion_id}
        assert sum(1 for delta in deltas if delta) == usage["completion_tokens"], "one chunk per token"
        answer = "".join(delta or "" for delta in deltas)
    turn = Turn(
        session=session,
        worker=worker,
        request_id=completion_id.removeprefix("chatcmpl-"),
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )
    return turn, answer


def _run_sessions(router: Router, sessions: list[str], streaming: frozenset[str] = frozenset()) -> dict:
    """Interleave multi-turn sessions round by round, each round resending the whole conversation.

    Returns {session: [Turn per round]}. Sessions in `streaming` are sent with stream=true.
    """
    conversations = {session: [{"role": "system", "content": SYSTEM_PROMPT}] for session in sessions}
    turns: dict[str, list[Turn]] = {session: [] for session in sessions}
    with httpx.Client(base_url=router.url, timeout=TIMEOUT) as client:
        for round_number in range(1, ROUNDS + 1):
            for session in sessions:
                messages = conversations[session]
                question = f"In session {session}, question {round_number}: what did we cover so far?"
                messages.append({"role": "user", "content": question})
                turn, answer = _chat(client, messages, session, stream=session in streaming)
                messages.append({"role": "assistant", "content": answer})
                turns[session].append(turn)
    return turns


def _ground_truth(replicas: list[Replica], expected: int, timeout: float = 5.0) -> dict[str, list[dict]]:
    """Every replica's ground truth, once `expected` records exist (a stream's record lands last)."""
    deadline = time.monotonic() + timeout
    while True:
        records = {replica.id: replica.ground_truth() for replica in replicas}
        if sum(map(len, records.values())) >= expected or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _check_ground_truth(replicas: list[Replica], turns: dict[str, list[Turn]]) -> None:
    """Each request is recorded, once, on the replica its X-Worker-Id named, with the usage it reported."""
    all_turns = [turn for session_turns in turns.values() for turn in session_turns]
    records = _ground_truth(replicas, expected=len(all_turns))
    assert sum(map(len, records.values())) == len(all_turns), "the replicas saw extra or missing requests"
    for turn in all_turns:
        by_id = {record.get("request_id"): record for record in records[turn.worker]}
        record = by_id.get(turn.request_id)
        assert record is not None, f"{turn} is not in the ground truth of {turn.worker}"
        assert record["status"] == 200
        assert record["session_id"] == turn.session, "the router must forward the routing key"
        assert (record["prompt_tokens"], record["cached_tokens"]) == (turn.prompt_tokens, turn.cached_tokens)


def _history_cached(previous: Turn, turn: Turn) -> bool:
    """Whether a round found the previous round's whole prompt in its replica's cache.

    The previous replica cached that prompt plus a block of answer, so a round sent back to it hits at
    least the previous prompt; any other replica holds at most an earlier, shorter round of the session.
    """
    return turn.cached_tokens >= previous.prompt_tokens


def _workers_of_new_sessions(router: Router, count: int) -> set[str]:
    """The workers the router assigns to `count` fresh routing keys (one short request each)."""
    with httpx.Client(base_url=router.url, timeout=TIMEOUT) as client:
        messages = [{"role": "user", "content": "hello"}]
        return {_chat(client, messages, f"probe-{n}", stream=False)[0].worker for n in range(count)}


def test_round_robin_spreads_sessions_off_their_cache(start_router, replicas):
    """round_robin ignores the routing key: rounds of a session move between replicas and lose history."""
    router = start_router("round_robin", replicas)
    turns = _run_sessions(router, [f"session-{n}" for n in range(1, 5)])

    _check_ground_truth(replicas, turns)
    for session, session_turns in turns.items():
        assert len({turn.worker for turn in session_turns}) > 1, f"{session} stayed on one replica"
        for previous, turn in pairwise(session_turns):
            assert _history_cached(previous, turn) == (turn.worker == previous.worker), (session, turn)


def test_manual_policy_pins_sessions_to_their_cache(start_router, replicas):
    """manual + X-SMG-Routing-Key keeps every round of a session on one replica, which reuses its cache."""
    router = start_router("manual", replicas)
    sessions = [f"session-{n}" for n in range(1, 9)]
    turns = _run_sessions(router, sessions, streaming=frozenset(sessions[::2]))

    _check_ground_truth(replicas, turns)
    homes = set()
    for session, session_turns in turns.items():
        workers = {turn.worker for turn in session_turns}
        assert len(workers) == 1, f"{session} moved between {sorted(workers)}"
        homes |= workers
        for previous, turn in pairwise(session_turns):
            assert turn.cached_tokens > 0 and _history_cached(previous, turn), (session, turn)

    # New keys go to a random worker: 8 sessions on one of 3 happens 1 time in ~2,200, so look further.
    if len(homes) < 2:
        homes |= _workers_of_new_sessions(router, count=24)
    assert len(homes) >= 2, "the router sent every routing key to the same replica"


def test_router_metrics_show_every_worker_healthy(start_router, replicas):
    """The router's own Prometheus endpoint is what kvwatch scrapes for the routing side."""
    router = start_router("round_robin", replicas)
    response = http_get(router.metrics_url, timeout=TIMEOUT)
    assert response.status_code == 200
    health = {
        sample.labels["worker"]: sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "smg_worker_health"
    }
    assert health == {replica.url: 1.0 for replica in replicas}
