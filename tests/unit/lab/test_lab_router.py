"""The lab router's choices and its and the replicas' admin answers to bad input, in process."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvwatch.lab import router as lab_router
from kvwatch.lab import server
from kvwatch.lab.engine import Engine, Faults, ReplicaSettings

REPLICAS = {"r1": "http://127.0.0.1:1", "r2": "http://127.0.0.1:2"}


def answers(app, *requests: tuple[str, str, object]) -> list[tuple[int, dict]]:
    """(status, JSON body) of each (method, path, JSON or raw bytes) sent to `app`."""

    async def scenario():
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            found = []
            for method, path, body in requests:
                sent = {"data": body} if isinstance(body, bytes) else {"json": body}
                response = await client.request(method, path, **sent)
                found.append((response.status, await response.json()))
            return found

    return asyncio.run(scenario())


def test_cache_aware_follows_its_index_and_spread_takes_turns():
    router = lab_router.Router(REPLICAS, "cache-aware", block_size=4, cache_blocks=100)
    assert router.choose({"r1": 0, "r2": 8}) == "r2"
    router.routed_count["r1"] = 3
    assert router.choose({"r1": 0, "r2": 0}) == "r2"  # a tie goes to the least used
    router.policy = "spread"
    assert [router.choose({"r1": 8, "r2": 0}) for _ in range(3)] == ["r1", "r2", "r1"]


def test_an_unknown_policy_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown policy 'sticky'; known: cache-aware, spread"):
        lab_router.Router(REPLICAS, "sticky", block_size=4, cache_blocks=100)
    app = lab_router.make_app(lab_router.Router(REPLICAS, "cache-aware", block_size=4, cache_blocks=100))
    (refused, switched, unroutable) = answers(
        app,
        ("POST", "/lab/faults", {"policy": "sticky"}),
        ("POST", "/lab/faults", {"policy": "spread"}),
        ("POST", "/v1/chat/completions", b"not json"),
    )
    assert refused == (400, {"error": "unknown policy 'sticky'; known: cache-aware, spread"})
    assert switched == (200, {"policy": "spread"})
    assert unroutable[0] == 400 and "cannot route this request" in unroutable[1]["error"]["message"]


def test_a_replica_says_what_it_holds_of_a_prompt_and_nothing_with_caching_off():
    engine = Engine(ReplicaSettings("r1", block_size=4))
    prompt = list(range(1000, 1013))
    engine.cache.insert(prompt)
    app = server.make_app(engine)
    held, bad = answers(
        app, ("POST", "/lab/held", {"tokens": prompt}), ("POST", "/lab/held", {"tokens": "x"})
    )
    assert held == (200, {"held_tokens": 12})
    assert bad[0] == 400 and "'tokens' must be a list of token ids" in bad[1]["error"]
    engine.set_faults(Faults(prefix_caching=False))
    assert answers(server.make_app(engine), ("POST", "/lab/held", {"tokens": prompt})) == [
        (200, {"held_tokens": 0})
    ]
