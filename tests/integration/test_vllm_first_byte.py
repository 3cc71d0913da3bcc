"""Real vLLM sends a stream's response headers before its first token, so a gateway's first byte of the
headers (nginx's `$upstream_header_time`) is not TTFT there (docs/gateway-logs.md).

Streamed answers from the real-vLLM lab's engines through its nginx: the time nginx logs to the
headers against the time the client waits for the first chunk and against vLLM's own TTFT (its
`vllm:time_to_first_token_seconds` over these requests).
"""

from __future__ import annotations

import re
import statistics
import time

import pytest

from gateway_checks import LAB_CLIENT
from kvwatch.collectors.gatewaylogs import LOG_FORMATS
from labs import Lab
from processes import http_get

pytestmark = pytest.mark.integration

REQUESTS = 3
PROMPT = "Tell me about the weather in the lab today. " * 40  # a prefill of a few hundred tokens


def vllm_ttft_totals(lab: Lab) -> tuple[float, float]:
    """vLLM's TTFT histogram sum and count, over every engine of the lab."""
    total = count = 0.0
    for replica in lab.status["replicas"]:
        text = http_get(f"{replica['url']}/metrics", timeout=10).text
        total += sum(
            map(float, re.findall(r"^vllm:time_to_first_token_seconds_sum\{.*\} (\S+)$", text, re.M))
        )
        count += sum(
            map(float, re.findall(r"^vllm:time_to_first_token_seconds_count\{.*\} (\S+)$", text, re.M))
        )
    return total, count


def stream(url: str, session: str) -> float:
    """Seconds from sending a streamed chat to its first event (the first token's chunk)."""
    body = {"model": "lab-model", "messages": [{"role": "user", "content": f"{session}: {PROMPT}"}],
            "max_tokens": 4, "stream": True}  # fmt: skip
    started = time.monotonic()
    with LAB_CLIENT.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=300
    ) as answer:
        assert answer.status_code == 200, answer.read()
        lines = answer.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        waited = time.monotonic() - started
        for _ in lines:  # the rest of the answer
            pass
    return waited


def test_vllm_sends_stream_headers_before_the_first_token(vllm_lab: Lab):
    sessions = [f"first-byte-{n}" for n in range(REQUESTS)]
    before = vllm_ttft_totals(vllm_lab)
    first_chunks = [stream(vllm_lab.round_robin, session) for session in sessions]
    after = vllm_ttft_totals(vllm_lab)
    assert after[1] - before[1] == REQUESTS
    engine_ttft = (after[0] - before[0]) / REQUESTS

    def logged(entries: list[dict]) -> bool:
        return {e["session_id"] for e in entries} >= set(sessions)

    entries = [e for e in vllm_lab.access_log("round_robin", until=logged) if e["session_id"] in sessions]
    headers = [LOG_FORMATS["nginx"].parse(entry).first_byte_seconds for entry in entries]
    # nginx saw the headers long before the first token: vLLM sends them as the stream starts.
    assert max(headers) < engine_ttft / 2, (headers, engine_ttft, first_chunks)
    assert max(headers) < min(first_chunks) / 2, (headers, first_chunks)
    # The client's first chunk is the engine's first token, plus the way through nginx.
    assert statistics.fmean(first_chunks) >= engine_ttft, (first_chunks, engine_ttft)
