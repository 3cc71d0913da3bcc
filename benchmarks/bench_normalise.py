"""Normalising 1,000 replica expositions, against prometheus_client's parser alone.

kvwatch's parse + detect + normalise and the bare parser each process the same 1,000 expositions;
seconds and peak memory are reported with their ratio.

The exposition is a lab vLLM replica's /metrics after mixed traffic, with the families a real vLLM V1
server adds (Python process and GC metrics are left out: they are constant work for both sides).
"""

from __future__ import annotations

import time
import tracemalloc

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.collectors.engines import Exposition, detect_flavour, normalise
from kvwatch.lab.flavours import SIMULATED_FLAVOURS, CacheConfig, Finished, Prefill

COUNT = 1000


def exposition() -> str:
    """A vLLM V1 exposition after 500 requests of mixed sizes and latencies."""
    metrics = SIMULATED_FLAVOURS.lookup("vllm")(
        "meta-llama/Llama-3.1-8B-Instruct", CacheConfig(16, 5000, True, 131072)
    )
    for i in range(500):
        prompt = 500 + 37 * i % 4000
        metrics.prefill_done(
            Prefill(prompt, prompt // 2, True, 0.001 * (i % 50), 0.02 + (i % 97) / 40, i % 2 == 0)
        )
        metrics.finished(
            Finished(prompt, prompt // 2, 64, 1.0 + (i % 13), i % 2 == 0, "stop" if i % 7 else "length")
        )
    metrics.set_load(running=12, waiting=3, kv_usage=0.4)
    return generate_latest(metrics.registry).decode()


def parse_only(texts: list[str]) -> None:
    for text in texts:
        for _ in text_string_to_metric_families(text):
            pass


def kvwatch_normalise(texts: list[str]) -> None:
    for text in texts:
        parsed = Exposition(text)
        normalise(detect_flavour(parsed).read(parsed, 0.0))


def measure(function, texts: list[str]) -> tuple[float, float]:
    started = time.perf_counter()
    function(texts)
    seconds = time.perf_counter() - started
    tracemalloc.start()
    function(texts[:50])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return seconds, peak


def run() -> str:
    text = exposition()
    # Distinct strings, as 1,000 scrapes would give.
    texts = [text.replace("Llama-3.1-8B", f"Llama-3.1-8B-{i}") for i in range(COUNT)]
    base_s, base_mem = measure(parse_only, texts)
    ours_s, ours_mem = measure(kvwatch_normalise, texts)
    return "\n".join(
        [
            f"Exposition size: {len(text.encode()) / 1024:.0f} KiB, {text.count(chr(10))} lines.",
            "",
            "| | seconds for 1,000 | ms each | peak memory |",
            "|---|---|---|---|",
            f"| prometheus_client parser only | {base_s:.2f} | {base_s:.1f} | {base_mem / 1e6:.2f} MB |",
            f"| kvwatch parse, detect, normalise | {ours_s:.2f} | {ours_s:.1f} | {ours_mem / 1e6:.2f} MB |",
            f"| ratio kvwatch / parser | {ours_s / base_s:.2f} | | {ours_mem / base_mem:.2f} |",
        ]
    )
