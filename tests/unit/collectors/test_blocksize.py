"""The KV block size: its resolution order, GCD inference, the recomputed ideal, and each source against
real lab replicas (a vLLM one exports its block size, an SGLang one does not) and small fake servers."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvwatch.cli.main import main
from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.blocksize import (
    BlockSize,
    BlockSizeSources,
    from_granularity,
    ideal_cached,
    learn,
    sources_for,
    with_block_size,
)
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.store.history import Store
from paths import REPO
from processes import free_port, stop, wait_http

MODEL = "lab-model"
DEFAULT = BlockSize(16, "default; no engine evidence")
CLOSED = f"http://127.0.0.1:{free_port()}"  # nothing listens: every lookup there fails at once


def round_(number: int, prompt: int | None, cached: int | None, completion: int | None = 8, ok: bool = True):
    return RoundResult(
        number, 0.0, 200 if ok else None, None if ok else "timeout", None if ok else "no answer",
        0.05, 0.1, prompt, cached, None, completion, "r1", None, None,
    )  # fmt: skip


def session(*rounds: RoundResult) -> SessionResult:
    return SessionResult("probe", "affinity", "s", 0.0, 1.0, rounds)


def resolve(sources: BlockSizeSources, *sessions: SessionResult) -> BlockSize:
    return asyncio.run(learn(sources, sessions))


# Validation and the resolution order.


def test_a_block_size_is_a_positive_int_up_to_1_shl_20():
    assert blocksize.problem(1) is None and blocksize.problem(1 << 20) is None
    assert blocksize.problem(0) == "must be >= 1, got 0"
    assert blocksize.problem((1 << 20) + 1) == "must be <= 1048576 (1 << 20), got 1048577"
    with pytest.raises(ValueError, match=r"^block size must be >= 1, got -16$"):
        BlockSize(-16, "a typo")
    assert BlockSize(128, "x").as_json() == {"tokens": 128, "source": "x"}
    assert BlockSize(128, "x").describe() == "KV block: 128 tokens (x)"


def test_the_metrics_url_defaults_to_each_base_urls_origin():
    sources = sources_for(["https://gw.example/api/v1", "https://gw.example/other", "http://b:8000"])
    assert sources.metrics_urls == ("https://gw.example/metrics", "http://b:8000/metrics")
    given = sources_for(["https://gw.example/api"], "http://prom:9090", metrics_url="http://engine/metrics")
    assert given == BlockSizeSources(None, "http://prom:9090", ("http://engine/metrics",))


def test_an_override_wins_without_looking_anywhere():
    override = BlockSize(64, "--block-size")
    sessions = [session(round_(1, 300, 256), round_(2, 500, 384))]  # granularity would say 128
    assert resolve(BlockSizeSources(override, CLOSED, (f"{CLOSED}/metrics",)), *sessions) == override


def test_without_any_evidence_the_default_is_used_and_says_so():
    assert resolve(sources_for([CLOSED], CLOSED)) == DEFAULT
    one_value = session(round_(1, 300, 256), round_(2, 500, 256))  # one value twice bounds nothing
    assert resolve(sources_for([CLOSED]), one_value) == DEFAULT


def test_granularity_is_the_gcd_of_the_distinct_non_zero_cached_counts():
    sessions = [
        session(round_(1, 300, 0), round_(2, 700, 384), round_(3, 900, 640)),
        session(round_(1, 300, None), round_(2, 500, 384), round_(3, 2000, 96, ok=False)),  # failed: ignored
        session(round_(1, 300, 1152)),
    ]
    assert from_granularity(sessions) == BlockSize(128, "granularity of 3 distinct reported cached_tokens")
    assert from_granularity([session(round_(1, 300, 5), round_(2, 400, 7))]).tokens == 1  # token-granular
    assert from_granularity([session(round_(1, 300, 0), round_(2, 400, None))]) is None
    assert from_granularity([session(round_(1, 300, -128), round_(2, 400, 64))]) is None  # one usable value
    huge = 1 << 21  # a GCD no engine's block can be is no evidence, and never an exception
    assert from_granularity([session(round_(1, 3 * huge, huge), round_(2, 5 * huge, 2 * huge))]) is None


# The recomputed ideal.


def test_the_ideal_is_recomputed_with_the_learned_block_by_the_one_definition():
    rounds = (round_(1, 1000, 0, 8), round_(2, 1300, 896, 8), round_(3, 1600, 1280), round_(4, None, None))
    original = session(*(replace(r, ideal_cached_tokens=ideal_cached(p, r.prompt_tokens, 16))
                         for p, r in zip((None, *rounds[:-1]), rounds, strict=True)))  # fmt: skip
    (aligned,) = with_block_size([original], 128)
    assert [r.ideal_cached_tokens for r in aligned.rounds] == [0, 896, 1280, None]
    assert [r.ideal_cached_tokens for r in original.rounds] == [0, 1008, 1296, None]  # untouched
    assert with_block_size([original], 16) == [original]  # what the probe computed as it ran
    assert [replace(r, ideal_cached_tokens=None) for r in aligned.rounds] == [
        replace(r, ideal_cached_tokens=None) for r in original.rounds
    ]


# Prometheus and /metrics, from small fake servers.


@asynccontextmanager
async def fake(path: str, handler):
    """A server on 127.0.0.1 answering GET `path` with `handler`; its URL."""
    app = web.Application()
    app.router.add_get(path, handler)
    async with TestServer(app, host="127.0.0.1") as server:
        yield f"http://127.0.0.1:{server.port}"


def prometheus_answering(*sizes: str, status: int = 200):
    async def query(request: web.Request) -> web.Response:
        assert request.query["query"] == "count by (block_size) (vllm:cache_config_info)"
        result = [{"metric": {"block_size": size}, "value": [0, "2"]} for size in sizes]
        return web.json_response({"status": "success", "data": {"result": result}}, status=status)

    return query


def learn_with_prometheus(handler, metrics_urls: tuple[str, ...] = ()) -> tuple[str, BlockSize]:
    async def scenario():
        async with fake("/api/v1/query", handler) as url:
            return url, await learn(BlockSizeSources(None, url, metrics_urls), [])

    return asyncio.run(scenario())


def test_prometheus_gives_the_smallest_of_several_block_sizes_and_names_them():
    url, found = learn_with_prometheus(prometheus_answering("128", "16", "x"))
    assert found == BlockSize(16, f"smallest of 16, 128 in vllm:cache_config_info in Prometheus at {url}")
    url, found = learn_with_prometheus(prometheus_answering("128"))
    assert found == BlockSize(128, f"vllm:cache_config_info in Prometheus at {url}")


@pytest.mark.parametrize(
    "handler",
    [
        prometheus_answering(),  # no vLLM engine scraped
        prometheus_answering("16", status=503),
        lambda request: web.Response(text="<html>login</html>"),
    ],
    ids=["no-series", "error-status", "not-json"],
)
def test_a_prometheus_without_an_answer_is_not_available(handler):
    assert learn_with_prometheus(handler)[1] == DEFAULT


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(30)
    return web.Response()


@pytest.mark.parametrize(
    "handler",
    [
        lambda request: web.Response(text="<html><body>Not the metrics you are looking for</body></html>"),
        lambda request: web.Response(status=404),
        slow,
    ],
    ids=["html", "404", "slow"],
)
def test_a_metrics_page_without_the_series_is_not_available(handler):
    async def scenario():
        async with fake("/metrics", handler) as url:
            return await learn(sources_for([url]), [])

    started = time.monotonic()
    assert asyncio.run(scenario()) == DEFAULT
    assert time.monotonic() - started < blocksize.TIMEOUT_S + 2


# Against real lab replicas.


def probe_json(url: str, *flags: str, capsys) -> dict:
    workload = ["--rounds", "5", "--sessions", "2", "--system-tokens", "700", "--turn-tokens", "90"]
    code = main(
        ["probe", "--base-url", url, "--model", MODEL, *workload, "--max-tokens", "8", "--json", *flags]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def warm_rounds(report: dict) -> list[dict]:
    return [r for s in report["sessions"] for r in s["rounds"][1:]]


def test_a_vllm_replica_with_128_token_blocks_is_learned_from_its_metrics(start_replica, capsys):
    replica = start_replica("cpu", "vllm", "--time-scale", "0.05", "--block-size", "128")
    report = probe_json(replica.url, "--seed", "21", capsys=capsys)

    assert report["block_size"] == {
        "tokens": 128,
        "source": f"vllm:cache_config_info at {replica.url}/metrics",
    }
    # One replica holds every session: a pinned replica reuses exactly the ideal, block for block.
    warm = warm_rounds(report)
    assert all(s["sticky"] for s in report["sessions"]) and len(warm) == 8
    assert [r["cached_tokens"] for r in warm] == [r["ideal_cached_tokens"] for r in warm]
    assert all(r["ideal_cached_tokens"] % 128 == 0 for r in warm)


def test_an_explicit_block_size_overrides_what_the_engine_says(start_replica, capsys):
    replica = start_replica("cpu", "vllm", "--time-scale", "0.05", "--block-size", "128")
    report = probe_json(replica.url, "--seed", "22", "--block-size", "16", capsys=capsys)

    assert report["block_size"] == {"tokens": 16, "source": "--block-size"}
    warm = warm_rounds(report)
    # Aligned to 16, the ideal asks for tokens of a partial 128-token block, which the engine never reuses.
    assert all(r["ideal_cached_tokens"] >= r["cached_tokens"] for r in warm)
    assert any(r["ideal_cached_tokens"] > r["cached_tokens"] for r in warm)

    assert main(["probe", "--base-url", replica.url, "--model", MODEL, "--rounds", "2", "--sessions", "1",
                 "--system-tokens", "50", "--turn-tokens", "10", "--block-size", "128"]) == 0  # fmt: skip
    assert capsys.readouterr().out.splitlines()[1] == "KV block: 128 tokens (--block-size)"


def test_an_sglang_replica_exports_no_block_size_so_the_cached_tokens_tell(start_replica, capsys):
    # No X-Worker-Id either, as with a real engine: stickiness comes from cached against ideal tokens.
    replica = start_replica(
        "sg", "sglang", "--time-scale", "0.05", "--block-size", "64", "--no-identity-header"
    )
    report = probe_json(replica.url, "--seed", "23", capsys=capsys)

    block = report["block_size"]
    assert block["tokens"] == 64, block
    assert re.fullmatch(r"granularity of \d+ distinct reported cached_tokens", block["source"])
    warm = warm_rounds(report)
    assert [r["cached_tokens"] for r in warm] == [r["ideal_cached_tokens"] for r in warm]
    assert all(s["sticky"] and s["backends"] == [] for s in report["sessions"])


def test_prometheus_comes_before_metrics_and_an_explicit_metrics_url_before_the_origin(start_replica):
    vllm = start_replica("cpu", "vllm", "--time-scale", "0.05", "--block-size", "128")
    sglang = start_replica("sg", "sglang", "--time-scale", "0.05", "--block-size", "64")

    _, found = learn_with_prometheus(prometheus_answering("32"), (f"{vllm.url}/metrics",))
    assert found.tokens == 32 and "in Prometheus at" in found.source
    found = resolve(sources_for([sglang.url], metrics_url=f"{vllm.url}/metrics"))
    assert found == BlockSize(128, f"vllm:cache_config_info at {vllm.url}/metrics")
    assert resolve(sources_for([sglang.url])) == DEFAULT  # its /metrics has no cache_config_info


# `kvwatch serve`: learned each run, or taken from the config.


def test_serve_learns_the_block_size_per_target_unless_the_config_sets_it(tmp_path, start_replica):
    replica = start_replica("cpu", "vllm", "--time-scale", "0.05", "--block-size", "128")
    port = free_port()
    target = {"base_url": replica.url, "model": MODEL, "interval_seconds": 1, "rounds": 4,
              "workload": {"system_tokens": 600, "turn_tokens": 70, "max_tokens": 8}}  # fmt: skip
    config = tmp_path / "kvwatch.yaml"
    config.write_text(yaml.safe_dump({
        "targets": [{"name": "learned", **target}, {"name": "pinned", "block_size": 16, **target}],
        "exporter": {"listen": f"127.0.0.1:{port}"},
        "store": {"path": str(tmp_path / "kvwatch.db")},
    }))  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        serve = [sys.executable, "-m", "kvwatch.cli.main", "serve", "--config", str(config)]
        process = subprocess.Popen(serve, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/-/healthy", process, log)
        deadline = time.monotonic() + 30
        while "pinned: 2 sessions" not in log.read_text() or "learned: 2 sessions" not in log.read_text():
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()
            time.sleep(0.2)
    finally:
        stop(process)
    text = log.read_text()
    learned_from = f"vllm:cache_config_info at {replica.url}/metrics"
    run = r"2 sessions in [0-9.]+ s, [0-9]+% on one replica, 0 failed"
    assert re.search(rf"learned: {run}; KV block: 128 tokens \({re.escape(learned_from)}\)", text), text
    pinned_from = "block_size of target pinned in the config"
    assert re.search(rf"pinned: {run}; KV block: 16 tokens \({pinned_from}\)", text), text
    with Store(tmp_path / "kvwatch.db", readonly=True) as store:
        learned = [r for r in store.rounds(target="learned") if r["round"] > 1]
        pinned = [r for r in store.rounds(target="pinned") if r["round"] > 1]
    assert learned and all(r["cached_tokens"] == r["ideal_cached_tokens"] for r in learned)
    assert pinned and any(r["ideal_cached_tokens"] > r["cached_tokens"] for r in pinned)
