"""A real `kvwatch lab replica` process, seen from outside as a client, a router or Prometheus sees it."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from test_flavours import EXPECTED

from gateway_checks import LAB_CLIENT
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.targets import probe_once
from kvwatch.collectors.probe.workload import synthetic
from kvwatch.lab.server import ARRIVAL_KEY, ArrivalDating, dated_arrival
from processes import free_port, http_get, http_post, kvwatch, wait_for

pytestmark = pytest.mark.integration

FAST = ("--time-scale", "0.05", "--answer-tokens", "8")
USER = [{"role": "user", "content": "How does the prefix cache work?"}]
# The suite's one kept-alive client (LAB_CLIENT): creating an httpx client costs tens of milliseconds (TLS
# set-up), which would otherwise be counted in the client-side TTFT and stagger concurrent requests.


def long_prompt(words: int, tag: str = "rule") -> list[dict]:
    system = " ".join(f"{tag}{i}" for i in range(words))
    return [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the rules."}]


def chat(url: str, messages=USER, **body) -> httpx.Response:
    return LAB_CLIENT.post(f"{url}/v1/chat/completions", json={"messages": messages, **body})


def stream(url: str, messages=USER, headers=None, **extra) -> tuple[list[dict], float]:
    """Stream a chat; return its parsed chunks and the client-side time to the first content token."""
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}, **extra}
    chunks: list[dict] = []
    started, ttft = time.monotonic(), None
    with LAB_CLIENT.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = []
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.monotonic() - started
            chunks.append(chunk)
        assert lines[-1] == "data: [DONE]"
    return chunks, ttft


def metric_families(url: str) -> dict:
    text = http_get(f"{url}/metrics", timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def test_streaming_sends_role_content_finish_usage_and_done(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    chunks, ttft = stream(replica.url)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 8
    # As vLLM does: the last word's chunk finishes, and the usage chunk closes with a fingerprint.
    finishing = chunks[-2]["choices"][0]
    assert finishing["finish_reason"] == "stop" and finishing["delta"]["content"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 8
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 0}
    assert chunks[-1]["system_fingerprint"].startswith("vllm-0.32.0-")
    assert ttft is not None


def test_other_flavours_keep_the_plain_openai_shape(start_replica):
    replica = start_replica("r1", "sglang", *FAST)
    chunks, _ = stream(replica.url)
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "system_fingerprint" not in chunks[-1] and "system_fingerprint" not in chat(replica.url).json()


def deltas(chunks: list[dict], name: str) -> list:
    return [
        c["choices"][0]["delta"][name] for c in chunks if c["choices"] and name in c["choices"][0]["delta"]
    ]


@pytest.mark.parametrize("flavour, field", [("vllm", "reasoning"), ("sglang", "reasoning_content")])
def test_a_reasoning_replica_thinks_before_it_answers_and_the_probe_times_both(start_replica, flavour, field):
    replica = start_replica("r1", flavour, *FAST, "--answer-style", "reasoning")
    chunks, _ = stream(replica.url)
    kinds = [
        next(k for k in (field, "content") if k in c["choices"][0]["delta"])
        for c in chunks[1:-1]
        if c["choices"] and c["choices"][0]["delta"]
    ]
    assert kinds == [field] * 4 + ["content"] * 4  # half the answer's tokens think, then it answers
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    message = chat(replica.url).json()["choices"][0]["message"]
    assert len(message[field].split()) == 4 and len(message["content"].split()) == 4

    # Answers of three blocks: thinking that a pinned replica cannot reuse would show.
    long = start_replica(
        "r2", flavour, "--time-scale", "0.05", "--answer-tokens", "48", "--answer-style", "reasoning"
    )
    settings = ProbeSettings(base_url=long.url, model="lab-model", max_tokens=48)
    (session,) = probe_once(settings, synthetic(3, 50, 10, seed=1, sessions=1))
    assert session.ok and all(0 < r.ttft_seconds < r.first_content_seconds for r in session.rounds)
    # The thinking is cached but never resent, so a pinned replica reuses the previous prompt only.
    assert all(r.cached_tokens >= r.ideal_cached_tokens > 0 for r in session.rounds[1:]), session.rounds


def test_a_tool_calling_replica_streams_tool_call_deltas_and_no_text(start_replica):
    replica = start_replica("r1", "vllm", *FAST, "--answer-style", "tool-call")
    chunks, ttft = stream(replica.url)
    calls = [call for piece in deltas(chunks, "tool_calls") for call in piece]
    assert calls[0]["function"]["name"] == "lookup" and calls[0]["id"] and calls[0]["type"] == "function"
    assert len(json.loads("".join(c["function"]["arguments"] for c in calls))["query"].split()) == 8
    assert ttft is None and deltas(chunks, "content") == [""]  # only the opening delta
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    message = chat(replica.url).json()["choices"][0]["message"]
    assert message["content"] is None and json.loads(message["tool_calls"][0]["function"]["arguments"])

    long = start_replica(
        "r2", "vllm", "--time-scale", "0.05", "--answer-tokens", "48", "--answer-style", "tool-call"
    )
    settings = ProbeSettings(base_url=long.url, model="lab-model", max_tokens=48)
    (session,) = probe_once(settings, synthetic(3, 50, 10, seed=2, sessions=1))
    assert session.ok and all(r.ttft_seconds and r.first_content_seconds is None for r in session.rounds)


def test_a_request_asking_with_nvext_gets_dynamos_worker_id_and_timing(start_replica):
    replica = start_replica("r7", "vllm", *FAST, "--no-identity-header")
    plain, _ = stream(replica.url)
    assert not any("nvext" in c for c in plain)

    asked, _ = stream(replica.url, nvext={"extra_fields": ["worker_id", "timing"]})
    worker = {"prefill_worker_id": "r7", "prefill_dp_rank": 0, "decode_worker_id": "r7", "decode_dp_rank": 0}
    assert all(c["nvext"]["worker_id"] == worker for c in asked)
    assert [c for c in asked if "timing" in c["nvext"]] == [asked[-1]]
    assert asked[-1]["nvext"]["timing"]["ttft_ms"] > 0

    settings = ProbeSettings(base_url=replica.url, model="lab-model", max_tokens=8, router="dynamo")
    (session,) = probe_once(settings, synthetic(3, 50, 10, seed=3, sessions=1))
    assert session.ok and session.backends == ("r7",) * 3 and session.sticky


def test_non_streaming_reports_cached_tokens_of_a_repeated_prefix(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    first = chat(replica.url, long_prompt(200), max_tokens=4)
    assert first.status_code == 200 and first.headers["X-Worker-Id"] == "r1"
    body = first.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    prompt = body["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0,
        "created_cache_tokens": prompt // 16 * 16,
    }
    again = chat(replica.url, long_prompt(200), max_tokens=4).json()["usage"]["prompt_tokens_details"]
    assert again["cached_tokens"] == (prompt - 1) // 16 * 16
    assert again["created_cache_tokens"] == prompt // 16 * 16 - again["cached_tokens"]


def test_conversation_rounds_reuse_the_history(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    messages = long_prompt(100)
    cached = []
    for turn in range(3):
        reply = chat(replica.url, messages).json()
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages += [reply["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]
    assert cached[0] == 0 and 0 < cached[1] < cached[2]


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "lab-model"}', 400, "'messages' must be a non-empty list"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "unknown message role"),
        (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "gpt-9"),
    ],
)
def test_bad_requests_get_openai_error_objects(start_replica, body, status, fragment):
    replica = start_replica("r1", "vllm", *FAST)
    response = http_post(f"{replica.url}/v1/chat/completions", content=body, timeout=10)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"]
    assert replica.ground_truth()[-1]["status"] == status


@pytest.mark.parametrize("flavour", sorted(EXPECTED))
def test_metrics_parse_and_use_the_engine_names(start_replica, flavour):
    replica = start_replica("r1", flavour, *FAST)
    chat(replica.url, long_prompt(50))
    chat(replica.url, long_prompt(50))
    families = metric_families(replica.url)
    assert {name: f.type for name, f in families.items()} == EXPECTED[flavour]


def test_models_health_and_render_for_routers(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    assert http_get(f"{replica.url}/health").status_code == 200
    models = http_get(f"{replica.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["lab-model"]
    assert not {"root", "model_path", "tokenizer_path"} & set(models[0])
    render = http_post(f"{replica.url}/v1/chat/completions/render", json={"messages": USER}).json()
    reply = chat(replica.url).json()
    assert len(render["token_ids"]) == reply["usage"]["prompt_tokens"]
    assert http_post(f"{replica.url}/tokenize", json={"prompt": "a b c"}).json()["count"] == 3


def test_identity_header_can_be_switched_off(start_replica):
    replica = start_replica("r1", "vllm", *FAST, "--no-identity-header")
    assert "X-Worker-Id" not in chat(replica.url).headers


def test_repeated_4000_token_prompt_is_at_least_5x_faster_and_ground_truth_agrees(start_replica, tmp_path):
    """Default (unscaled) timings: the cold prefill costs several hundred ms, the cached one a fraction."""
    truth_file = tmp_path / "truth.jsonl"
    replica = start_replica("r1", "vllm", "--answer-tokens", "4", "--ground-truth", str(truth_file))
    messages = long_prompt(3991)  # + 9 template and user tokens = 4,000
    cold_chunks, cold = stream(replica.url, messages, headers={"X-Session-Id": "s-1"})
    warm_chunks, warm = stream(replica.url, messages, headers={"X-Session-Id": "s-1"})
    assert cold_chunks[-1]["usage"]["prompt_tokens"] == 4000
    assert warm_chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 3984
    assert 0.3 < cold < 2.0, cold
    assert cold >= 5 * warm, (cold, warm)
    truth = replica.ground_truth()
    assert [t["session_id"] for t in truth] == ["s-1", "s-1"]
    assert [t["cached_tokens"] for t in truth] == [0, 3984]
    for record, measured in zip(truth, (cold, warm), strict=True):
        # The client sees the engine's TTFT plus loopback HTTP overhead, never less.
        assert record["ttft_seconds"] <= measured <= record["ttft_seconds"] + 0.05
    assert [json.loads(line) for line in truth_file.read_text().splitlines()] == truth


def test_the_ground_truth_file_is_rotated_at_its_size_limit(start_replica, tmp_path):
    truth_file, limit = tmp_path / "truth.jsonl", 2000
    replica = start_replica("r1", "vllm", *FAST, "--ground-truth", str(truth_file),
                            "--ground-truth-max-bytes", str(limit))  # fmt: skip
    for _ in range(30):  # about 400 bytes of ground truth each
        chat(replica.url)
    rotated = truth_file.with_name("truth.jsonl.1")
    assert sorted(p.name for p in tmp_path.glob("truth*")) == ["truth.jsonl", "truth.jsonl.1"]
    longest = max(len(line) + 1 for line in rotated.read_text().splitlines())
    assert limit <= rotated.stat().st_size < limit + longest  # renamed once the limit was reached
    assert truth_file.stat().st_size < limit
    kept = [json.loads(line) for path in (rotated, truth_file) for line in path.read_text().splitlines()]
    assert kept == replica.ground_truth()[-len(kept) :]  # the newest records, none lost in between


def test_prefill_is_serialised_so_load_queues(start_replica):
    replica = start_replica("r1", "vllm", "--answer-tokens", "2", "--time-scale", "0.5")
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: chat(replica.url, long_prompt(2000, tag=f"user{i}-")), range(6)))
    # Each request's prefill, from the replica's own clock: (start, end, arrival).
    spans = sorted(
        (t["time"] + t["queue_seconds"], t["time"] + t["ttft_seconds"], t["time"])
        for t in replica.ground_truth()
    )
    pairs = list(zip(spans, spans[1:], strict=False))
    # One prefill at a time: each starts once the one before has ended (the records' rounding aside)...
    assert all(start >= ended - 0.002 for (_, ended, _), (start, _, _) in pairs), spans
    # ...so a request that arrives during another's prefill waits for it: load queues.
    assert any(arrived < ended <= start + 0.002 for (_, ended, _), (start, _, arrived) in pairs), spans


def test_faults_prefix_caching_off_then_reset(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    chat(replica.url, long_prompt(100))
    assert replica.set_faults(prefix_caching=False).status_code == 200
    usage = chat(replica.url, long_prompt(100)).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 0}
    info = metric_families(replica.url)["vllm:cache_config_info"].samples
    assert [s.labels["enable_prefix_caching"] for s in info] == ["False"]
    replica.set_faults(prefix_caching=True)
    assert chat(replica.url, long_prompt(100)).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert http_post(f"{replica.url}/lab/reset-cache").status_code == 200
    assert chat(replica.url, long_prompt(100)).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_faults_error_rate_and_extra_latency(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    replica.set_faults(error_rate=1.0)
    failed = chat(replica.url)
    assert failed.status_code == 500 and failed.json()["error"]["message"]
    replica.set_faults(error_rate=0.0, extra_latency_s=4.0)  # 4 s x 0.05 time scale = 0.2 s
    chat(replica.url)
    assert replica.ground_truth()[-1]["ttft_seconds"] >= 0.2


def test_lab_state_names_the_oldest_request_in_flight_until_its_record_is_kept(start_replica):
    """What a test waits on before it reads the ground truth of everything that arrived by some moment."""
    replica = start_replica("r1", "vllm", *FAST)

    def oldest() -> float | None:
        return http_get(f"{replica.url}/lab/state").json()["oldest_in_flight"]

    assert oldest() is None
    replica.set_faults(extra_latency_s=20.0)  # 20 s x 0.05 time scale = 1 s in flight
    with ThreadPoolExecutor(1) as pool:
        answered = pool.submit(chat, replica.url)
        in_flight = wait_for(oldest, "a request in flight", 30, 0.05)
        assert answered.result(timeout=30).status_code == 200
    assert oldest() is None
    assert replica.ground_truth()[-1]["time"] == in_flight


def test_faults_api_keys_give_401_and_403(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    replica.set_faults(
        api_keys={"sk-good": ["lab-model"], "sk-other": ["other-model"]}, expired_keys=["sk-old"]
    )

    def status(authorization: str | None) -> tuple[int, str | None]:
        headers = {"Authorization": authorization} if authorization else {}
        r = LAB_CLIENT.post(f"{replica.url}/v1/chat/completions", json={"messages": USER}, headers=headers)
        return r.status_code, r.json().get("error", {}).get("code")

    assert status(None) == (401, "invalid_api_key")
    assert status("sk-good") == (401, "invalid_api_key")  # missing "Bearer"
    assert status("Bearer sk-wrong") == (401, "invalid_api_key")
    assert status("Bearer sk-other") == (403, "model_not_allowed")
    assert status("Bearer sk-old") == (403, "token_expired")
    assert status("Bearer sk-good") == (200, None)
    state = http_get(f"{replica.url}/lab/state").json()
    assert "sk-good" not in json.dumps(state) and "sk-good" not in replica.log.read_text()


@pytest.mark.parametrize(
    "update, fragment",
    [
        ({"prefix_cache": False}, "unknown fault 'prefix_cache'"),
        ({"error_rate": 2}, "error_rate must be between 0 and 1"),
        ({"extra_latency_s": "slow"}, "wrong type"),
        ({"api_keys": {"k": "lab-model"}}, "api_keys must map"),
    ],
)
def test_bad_fault_updates_are_rejected(start_replica, update, fragment):
    replica = start_replica("r1", "vllm", *FAST)
    response = replica.set_faults(**update)
    assert response.status_code == 400 and fragment in response.json()["error"]


def test_taken_port_gives_a_clear_message(start_replica):
    replica = start_replica("r1", "vllm", *FAST)
    result = kvwatch("lab", "replica", "--port", str(replica.port), "--id", "r2", timeout=30)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{replica.port}" in result.stderr


def test_bad_replica_options_are_named():
    options = ("--id", "r1", "--cache-blocks", "0", "--prefill-rate", "-1")
    result = kvwatch("lab", "replica", "--port", str(free_port()), *options, timeout=30)
    assert result.returncode == 2
    assert "--cache-blocks must be positive" in result.stderr
    assert "--prefill-rate must be positive" in result.stderr


def test_a_request_is_dated_when_its_bytes_are_read_not_when_its_handler_starts():
    """The replica's ground-truth clock starts at the loop's read of a request, so a busy loop between
    the read and aiohttp's handler (here a 50 ms stall) is not counted against the client; a second
    request on the same kept-alive connection gets its own arrival, not the first one's."""

    async def main() -> list[tuple[float, float, float]]:
        seen = []

        async def handler(request: web.Request) -> web.Response:
            seen.append((request[ARRIVAL_KEY], time.monotonic()))
            return web.Response(text="ok")

        class StalledAfterRead(ArrivalDating):
            def data_received(self, data: bytes) -> None:
                loop.call_soon(time.sleep, 0.05)  # queued ahead of aiohttp's handler task
                super().data_received(data)

        app = web.Application(middlewares=[dated_arrival])
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: StalledAfterRead(runner.server()), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        timings = []
        try:
            for _ in range(2):
                async with asyncio.timeout(10):
                    sent_at = time.monotonic()
                    writer.write(b"GET / HTTP/1.1\r\nHost: lab\r\n\r\n")
                    await reader.readuntil(b"\r\n\r\n")
                    await reader.readexactly(2)  # "ok"
                timings.append(sent_at)
        finally:
            writer.close()
            server.close()
            await runner.cleanup()
        return [(sent, arrival, started) for sent, (arrival, started) in zip(timings, seen, strict=True)]

    (sent_1, arrival_1, started_1), (sent_2, arrival_2, started_2) = asyncio.run(main())
    assert sent_1 <= arrival_1 and started_1 - arrival_1 >= 0.045
    assert sent_2 <= arrival_2 and started_2 - arrival_2 >= 0.045
