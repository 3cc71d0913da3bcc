"""A router-like lab component in front of lab replicas: it picks a replica for each chat completion and
exports what it knew when it chose, under the names llm-d's EPP gives them, so that kvwatch's rules and
alerts about routers are proven end to end, not only on recorded expositions.

Like a cache-aware router with an approximate index, it keeps its own view of what each replica holds
(the prompts and answers it sent there, hashed in blocks as the replicas hash them) and exports the reuse
decomposition's legs, token-weighted (llm-d-router PR #2897): per request, the prompt tokens, the most
any replica held by its index (available), the most among the replicas it chose from (best predicted),
what the chosen one held (predicted), and the engine's usage (input and cached tokens: delivered).

Policies (`--policy`, switched at run time through `/lab/faults`): `cache-aware` sends a request to the
replica its index says holds most of the prompt (ties: the least used); `spread` sends each request to
the next replica in turn, whatever they hold (a router that spreads sessions).

Ground truth (`/lab/ground-truth`): per request, what each replica's own cache held of the prompt at
decision time (asked through the replicas' `/lab/held`), beside the router's own view and the engine's
answer, so that tests compare kvwatch's figures with the replicas rather than with the router's claims.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from kvwatch.core.tokenizer import TemplateError, render_chat, tokenize
from kvwatch.lab.prefix_cache import PrefixCache
from kvwatch.lab.server import until_signalled

log = logging.getLogger("kvwatch.lab.router")

POLICIES = ("cache-aware", "spread")
GROUND_TRUTH_KEPT = 100_000
UPSTREAM_TIMEOUT_S = 60.0
# llm-d's token-count histograms; the buckets are the lab's, the sums are what the rules read.
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
PREFIX_LABELS = {
    "plugin_name": "prefix-cache-scorer",
    "plugin_type": "prefix-cache-scorer",
    "endpoint_role": "",
}
# The prefix plugin's histograms (llm_d_epp_prefix_*), by the leg each one measures.
PREFIX_LEGS = {
    "prompt": ("prompt_tokens", "Prompt tokens of the request, per request."),
    "available": (
        "best_available_cached_tokens",
        "Highest prefix-cache prediction among the request's candidate endpoints before filtering.",
    ),
    "best_predicted": (
        "best_predicted_cached_tokens",
        "Highest prefix-cache prediction among the endpoints the scheduler selected from.",
    ),
    "routed": ("predicted_cached_tokens", "Prefix-cache prediction of the chosen endpoint, per request."),
}


@dataclass(frozen=True)
class Decision:
    """What the router knew when it chose a replica for one request."""

    replica: str
    prompt: list[int]
    indexed: Mapping[str, int]  # tokens of the prompt each replica holds, by the router's index
    held: Mapping[str, int]  # ... and by the replicas' own caches (ground truth)


class ReuseLegMetrics:
    """The reuse decomposition's legs as llm-d's EPP exports them, in the router's own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prefix = {
            leg: Histogram(
                f"llm_d_epp_prefix_{name}",
                text,
                list(PREFIX_LABELS),
                buckets=TOKEN_BUCKETS,
                registry=registry,
            ).labels(**PREFIX_LABELS)
            for leg, (name, text) in PREFIX_LEGS.items()
        }
        usage = {"model_name": "lab-model", "target_model_name": "lab-model"}
        self.input_tokens, self.cached_tokens = (
            Histogram(name, text, list(usage), buckets=TOKEN_BUCKETS, registry=registry).labels(**usage)
            for name, text in (
                ("llm_d_epp_request_input_tokens", "Input tokens of the requests, from the engines' usage."),
                (
                    "llm_d_epp_request_cached_tokens",
                    "Cached tokens of the requests, from the engines' usage.",
                ),
            )
        )
        self.attempts = Counter(
            "llm_d_epp_scheduler_attempts",
            "Scheduling attempts by the endpoint chosen.",
            ["endpoint_name", "status"],
            registry=registry,
        )

    def observe(self, decision: Decision, usage: Mapping | None) -> None:
        """One routed request: every leg at once, so that a scrape sees all of them or none."""
        prompt, best = len(decision.prompt), max(decision.indexed.values())
        # No filter narrows the candidates here: the best of those it chose from is the best of all.
        values = {"prompt": prompt, "available": best, "best_predicted": best}
        values["routed"] = decision.indexed[decision.replica]
        for leg, value in values.items():
            self.prefix[leg].observe(value)
        self.attempts.labels(endpoint_name=decision.replica, status="success").inc()
        if usage is not None:
            self.input_tokens.observe(usage["prompt_tokens"])
            self.cached_tokens.observe((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class Router:
    """The replicas, the router's index of each, its policy, metrics and ground truth."""

    def __init__(self, replicas: Mapping[str, str], policy: str, block_size: int, cache_blocks: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        self.replicas = dict(replicas)
        self.policy = policy
        self.index = {name: PrefixCache(cache_blocks, block_size) for name in self.replicas}
        self.routed_count = dict.fromkeys(self.replicas, 0)
        self._turn = itertools.cycle(self.replicas)
        self.registry = CollectorRegistry()
        self.legs = ReuseLegMetrics(self.registry)
        self.ground_truth: deque[dict] = deque(maxlen=GROUND_TRUTH_KEPT)

    def choose(self, indexed: Mapping[str, int]) -> str:
        if self.policy == "spread":
            return next(self._turn)
        return max(self.replicas, key=lambda name: (indexed[name], -self.routed_count[name]))

    async def decide(self, client: aiohttp.ClientSession, prompt: list[int]) -> Decision:
        indexed = {name: cache.held(prompt) for name, cache in self.index.items()}
        replica = self.choose(indexed)
        self.routed_count[replica] += 1
        held = await asyncio.gather(*(self._held(client, url, prompt) for url in self.replicas.values()))
        return Decision(replica, prompt, indexed, dict(zip(self.replicas, held, strict=True)))

    @staticmethod
    async def _held(client: aiohttp.ClientSession, url: str, prompt: list[int]) -> int:
        async with client.post(f"{url}/lab/held", json={"tokens": prompt}) as answer:
            answer.raise_for_status()
            return (await answer.json())["held_tokens"]

    def finished(self, decision: Decision, answer_text: str, usage: Mapping | None, request_id: str) -> None:
        """The answer came back: index what the replica now holds (as it caches it: prompt and answer)."""
        self.index[decision.replica].insert(decision.prompt + tokenize(answer_text))
        self.legs.observe(decision, usage)
        cached = None if usage is None else (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        self.ground_truth.append(
            {
                "time": time.time(),
                "request_id": request_id,
                "replica": decision.replica,
                "policy": self.policy,
                "prompt_tokens": len(decision.prompt),
                "indexed": dict(decision.indexed),
                "held": dict(decision.held),
                "cached_tokens": cached,
            }
        )


ROUTER_KEY = web.AppKey("router", Router)
CLIENT_KEY = web.AppKey("client", aiohttp.ClientSession)
routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    raw = await request.read()
    try:
        body = json.loads(raw)
        prompt = render_chat(body["messages"])
    except (ValueError, KeyError, TypeError, TemplateError) as error:
        return web.json_response({"error": {"message": f"cannot route this request: {error}"}}, status=400)
    client = request.app[CLIENT_KEY]
    decision = await router.decide(client, prompt)
    headers = {key: value for key, value in request.headers.items() if key.lower().startswith("x-")}
    url = f"{router.replicas[decision.replica]}/v1/chat/completions"
    async with client.post(
        url, data=raw, headers={**headers, "Content-Type": "application/json"}
    ) as upstream:
        if body.get("stream"):
            return await _relay_stream(request, router, decision, upstream)
        answer = await upstream.read()
        if upstream.status == 200:
            completion = json.loads(answer)
            text = completion["choices"][0]["message"].get("content") or ""
            router.finished(decision, text, completion.get("usage"), completion.get("id", ""))
        return web.Response(body=answer, status=upstream.status, content_type="application/json")


async def _relay_stream(
    request: web.Request, router: Router, decision: Decision, upstream: aiohttp.ClientResponse
) -> web.StreamResponse:
    """Pass the event stream through as it comes, reading the answer's text and usage on the way."""
    response = web.StreamResponse(status=upstream.status, headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    pieces, usage, request_id = [], None, ""
    async for line in upstream.content:
        await response.write(line)
        data = line.decode().strip().removeprefix("data:").strip()
        if not data.startswith("{"):
            continue
        chunk = json.loads(data)
        request_id, usage = chunk.get("id", request_id), chunk.get("usage") or usage
        pieces += [choice.get("delta", {}).get("content") or "" for choice in chunk.get("choices", ())]
    await response.write_eof()
    if upstream.status == 200:
        router.finished(decision, "".join(pieces), usage, request_id)
    return response


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ROUTER_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.post("/lab/faults")
async def lab_faults(request: web.Request) -> web.Response:
    """The router's fault: its policy (`{"policy": "spread"}`)."""
    router = request.app[ROUTER_KEY]
    try:
        policy = json.loads(await request.read())["policy"]
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    except (ValueError, KeyError, TypeError) as error:
        return web.json_response({"error": str(error)}, status=400)
    router.policy = policy
    log.info("policy now %s", policy)
    return web.json_response({"policy": policy})


@routes.get("/lab/ground-truth")
async def lab_ground_truth(request: web.Request) -> web.Response:
    return web.json_response({"records": list(request.app[ROUTER_KEY].ground_truth)})


async def _client(app: web.Application):
    app[CLIENT_KEY] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=UPSTREAM_TIMEOUT_S))
    yield
    await app[CLIENT_KEY].close()


def make_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ROUTER_KEY] = router
    app.cleanup_ctx.append(_client)
    app.add_routes(routes)
    return app


async def serve(router: Router, port: int) -> None:
    """Serve the router on 127.0.0.1:port until SIGINT or SIGTERM."""
    runner = web.AppRunner(make_app(router), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    log.info("router (%s) listening on http://127.0.0.1:%d", router.policy, port)
    try:
        await until_signalled()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvwatch.lab.router", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    parser.add_argument(
        "--replica", action="append", required=True, metavar="ID=URL", help="a replica, e.g. r1=http://..."
    )
    parser.add_argument("--policy", choices=POLICIES, default="cache-aware")
    parser.add_argument("--block-size", type=int, default=16, help="the replicas' block size")
    parser.add_argument("--cache-blocks", type=int, default=5000, help="blocks the index keeps per replica")
    args = parser.parse_args(argv)
    replicas = dict(item.partition("=")[::2] for item in args.replica)
    if not all(replicas) or not all(replicas.values()):
        parser.error("--replica takes ID=URL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(Router(replicas, args.policy, args.block_size, args.cache_blocks), args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
