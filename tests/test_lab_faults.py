"""Every lab fault has the observable effect it stands for, and `kvwatch lab heal` restores the baseline.

One lab (real nginx, Prometheus, Alertmanager, four replicas, two background users) serves the whole
module; each test injects one fault, checks what a user would see (gateway headers and access log,
replica counters, ground truth), heals, and checks the baseline is back.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

CLIENT = httpx.Client(timeout=30)
SESSIONS = [f"sess-{i}" for i in range(12)]
SYSTEM_PROMPT_TOKENS = 800  # lab traffic default


@pytest.fixture(scope="module")
def lab(start_lab):
    return start_lab("--replicas", "4", "--users", "2", "--think", "0.05", "--time-scale", "0.2")


def chat(url: str, session: str | None = None, content: str = "hello") -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return CLIENT.post(f"{url}/v1/chat/completions", json=body, headers=headers)


def upstreams(url: str, rounds: int = 3) -> dict[str, list[str]]:
    """The upstream that served each round of each test session (from the X-Upstream header)."""
    seen: dict[str, list[str]] = {s: [] for s in SESSIONS}
    for _ in range(rounds):
        for session in SESSIONS:
            response = chat(url, session)
            assert response.status_code == 200, response.text
            seen[session].append(response.headers["X-Upstream"])
    return seen


def assert_baseline(lab) -> None:
    """Affinity pins every session to one replica and echoes its id; every replica is up."""
    seen = upstreams(lab.affinity)
    assert all(len(set(rounds)) == 1 for rounds in seen.values()), seen
    assert chat(lab.affinity, "echo-me").headers["X-Session-Id"] == "echo-me"
    status = lab.cli("status", "--json").json
    assert status["faults"] == [] and all(r["url"] for r in status["replicas"])
    assert len(status["replicas"]) == 4


def fault(lab, *args: str) -> None:
    result = lab.cli("fault", *args)
    assert result.returncode == 0, result.stderr


def heal(lab) -> None:
    result = lab.cli("heal")
    assert result.returncode == 0, result.stderr
    assert_baseline(lab)


def faults_log(lab) -> list[dict]:
    return [json.loads(line) for line in (lab.state_dir / "faults.log").read_text().splitlines()]


def replica_counter(url: str, name: str) -> float:
    text = CLIENT.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_baseline_is_sticky(lab):
    assert_baseline(lab)


def test_break_affinity_spreads_sessions_over_replicas(lab):
    fault(lab, "break-affinity")
    seen = upstreams(lab.affinity)
    assert sum(len(set(rounds)) > 1 for rounds in seen.values()) >= len(SESSIONS) // 2, seen
    logged = [e for e in lab.access_log("affinity") if e["session_id"] == SESSIONS[0]]
    assert len({e["upstream_addr"] for e in logged[-3:]}) > 1
    assert faults_log(lab)[-1]["fault"] == "break-affinity"
    heal(lab)
    assert faults_log(lab)[-1]["action"] == "heal"


def test_drop_session_header_assigns_fresh_ids_and_spreads(lab):
    fault(lab, "drop-session-header")
    response = chat(lab.affinity, "mine")
    assert response.headers["X-Session-Id"] not in ("", "mine")
    seen = upstreams(lab.affinity)
    assert any(len(set(rounds)) > 1 for rounds in seen.values()), seen
    # Every request after the fault, background users' included, carries a gateway-assigned id.
    recent = lab.access_log("affinity")[-len(SESSIONS) :]
    assert {e["session_source"] for e in recent} == {"assigned"}
    heal(lab)
    assert lab.access_log("affinity")[-1]["session_source"] == "client"


def test_hash_request_id_echoes_the_id_but_spreads(lab):
    fault(lab, "hash-request-id")
    assert chat(lab.affinity, "kept").headers["X-Session-Id"] == "kept"
    seen = upstreams(lab.affinity)
    assert any(len(set(rounds)) > 1 for rounds in seen.values()), seen
    mine = [e for e in lab.access_log("affinity") if e["session_id"] in SESSIONS]
    assert mine and {e["session_source"] for e in mine} == {"client"}
    heal(lab)


def test_disable_prefix_cache_keeps_lookups_flat_on_one_replica(lab):
    url = lab.replica_url("r2")
    long_prompt = " ".join(f"w{i}" for i in range(200))
    chat(url, content=long_prompt)
    fault(lab, "disable-prefix-cache", "--replica", "r2")
    queries = replica_counter(url, "vllm:prefix_cache_queries_total")
    prompts = replica_counter(url, "vllm:prompt_tokens_total")
    reply = chat(url, content=long_prompt).json()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert replica_counter(url, "vllm:prompt_tokens_total") > prompts
    assert replica_counter(url, "vllm:prefix_cache_queries_total") == queries
    info = [
        s.labels["enable_prefix_caching"]
        for f in text_string_to_metric_families(CLIENT.get(f"{url}/metrics").text)
        for s in f.samples
        if s.name == "vllm:cache_config_info"
    ]
    assert info == ["False"]
    heal(lab)
    chat(url, content=long_prompt)
    assert chat(url, content=long_prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def first_rounds_since(lab, since: float, count: int, timeout: float = 30) -> list[dict]:
    """Ground truth of background users' round-1 requests that arrived after `since`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = []
        for replica in lab.cli("status", "--json").json["replicas"]:
            records = CLIENT.get(f"{replica['url']}/lab/ground-truth").json()["records"]
            # Round 1: the system prompt, one user turn and the template, nothing more.
            found += [
                r
                for r in records
                if r.get("time", 0) > since and r["status"] == 200
                and SYSTEM_PROMPT_TOKENS < r["prompt_tokens"] < SYSTEM_PROMPT_TOKENS + 100
            ]  # fmt: skip
        if len(found) >= count:
            return found
        time.sleep(0.5)
    raise AssertionError(f"fewer than {count} new conversations in {timeout} s")


def test_dynamic_prefix_destroys_reuse_of_the_shared_system_prompt(lab):
    before = first_rounds_since(lab, time.time() - 3600, 1)
    assert any(r["cached_tokens"] >= SYSTEM_PROMPT_TOKENS - 16 for r in before), before
    fault(lab, "dynamic-prefix")
    after = first_rounds_since(lab, time.time() + 0.5, 3)
    assert all(r["cached_tokens"] == 0 for r in after), after
    heal(lab)
    healed = first_rounds_since(lab, time.time() + 0.5, 3)
    assert all(r["cached_tokens"] >= SYSTEM_PROMPT_TOKENS - 16 for r in healed[1:]), healed


def test_kill_replica_fails_over_and_restart_resets_counters(lab):
    url = lab.replica_url("r3")
    for _ in range(3):
        chat(url)
    served_before = replica_counter(url, "vllm:request_success_total")
    assert served_before >= 3
    fault(lab, "kill-replica", "r3")
    assert lab.cli("status", "--json").json["replicas"][2]["url"] is None
    with pytest.raises(httpx.ConnectError):
        chat(url)
    # nginx fails over: every session still gets an answer, from one of the three live replicas.
    seen = upstreams(lab.affinity, rounds=1)
    assert url.removeprefix("http://") not in {rounds[0] for rounds in seen.values()}
    failovers = [e for e in lab.access_log("affinity") if "," in e["upstream_addr"]]
    assert failovers and all(e["status"] == 200 for e in failovers)
    fault(lab, "restart-replica", "r3")
    assert replica_counter(url, "vllm:request_success_total") < served_before
    heal(lab)


def test_scale_out_remaps_about_one_in_n_sessions_to_the_new_replica(lab):
    sessions = [f"ring-{i}" for i in range(60)]
    before = {s: chat(lab.affinity, s).headers["X-Upstream"] for s in sessions}
    fault(lab, "scale-out")
    status = lab.cli("status", "--json").json
    new = status["replicas"][-1]
    assert new["id"] == "r5" and new["url"]
    after = {s: chat(lab.affinity, s).headers["X-Upstream"] for s in sessions}
    moved = [s for s in sessions if after[s] != before[s]]
    # Consistent hashing: only sessions that now belong to the new replica move, about 1 in 5.
    assert all(after[s] == new["url"].removeprefix("http://") for s in moved)
    assert 0 < len(moved) <= len(sessions) // 2
    query = {"query": 'up{job="replicas",replica="r5"}'}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = CLIENT.get(f"{status['prometheus']}/api/v1/query", params=query).json()["data"]["result"]
        if result and result[0]["value"][1] == "1":
            break
        time.sleep(0.5)
    else:
        raise AssertionError("Prometheus never scraped the added replica")
    heal(lab)
    assert {s: chat(lab.affinity, s).headers["X-Upstream"] for s in sessions} == before
