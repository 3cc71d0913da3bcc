"""`kvwatch serve`: probes on a schedule, gateway logs followed, the exporter and the alert webhook.

One asyncio process: APScheduler 3.x's AsyncIOScheduler runs a job per target (with jitter, one instance
at a time, missed runs coalesced), a job that polls the gateway logs and one that prunes the store;
aiohttp serves /metrics and the webhook. Probes never raise; a job that fails anyway is logged and
the next run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import random
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from aiohttp import web
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from prometheus_client import CollectorRegistry

from collectors import blocksize, workload
from collectors.config import Config, ConfigError, Target, load_config, resolve_api_key
from collectors.exporter import ProbeCollector, ProbeResults, make_app
from collectors.gatewaylog import GatewayLogCollector, GatewayLogFollower
from collectors.probe import ProbeSettings, run_session, with_block_size
from collectors.store import Store, StoreError

log = logging.getLogger("kvwatch.serve")

GATEWAY_POLL_SECONDS = 5.0
PRUNE_SECONDS = 3600.0
MAX_CONCURRENT_SESSIONS = 16  # over all targets: probes must not load the cluster they measure


def probe_settings(target: Target, api_key: str | None) -> ProbeSettings:
    return ProbeSettings(
        base_url=target.base_url,
        model=target.model,
        api_key=api_key,
        target=target.name,
        route_mode=target.route_mode,
        session_mode=target.session.mode,
        session_header=target.session.header,
        backend_headers=target.backend.headers,
        backend_json_paths=target.backend.json_paths,
        router=target.router,
        max_tokens=target.workload.max_tokens,
        timeout_seconds=target.timeout_seconds,
    )


def block_size_sources(target: Target, prometheus_url: str | None) -> blocksize.BlockSizeSources:
    """The target's block size when the config sets it, else where to learn it: Prometheus, the route's
    /metrics, then the sessions' cached tokens."""
    override = None
    if target.block_size is not None:
        override = blocksize.BlockSize(target.block_size, f"block_size of target {target.name} in the config")
    return blocksize.sources_for([target.base_url], prometheus_url, override)


class Conversations:
    """Fresh conversations for every run of one target, each with a system prompt of its own: round 1
    is then a true cold prefill and rounds 2+ can only reuse their own session's history, so the
    warm/cold TTFT ratio and the cached tokens measure affinity and nothing else."""

    def __init__(self, target: Target) -> None:
        self.target = target
        spec = target.workload
        self._runs = itertools.count()
        self._pool = None
        if spec.sharegpt is not None:
            self._pool = itertools.cycle(workload.load_sharegpt(spec.sharegpt, seed=spec.seed))

    def next_run(self) -> list[workload.Conversation]:
        target, spec = self.target, self.target.workload
        if self._pool is not None:
            picked = itertools.islice(self._pool, target.sessions_per_run)
            return [workload.Conversation(c.system_prompt, c.user_turns[: target.rounds]) for c in picked]
        rng = random.Random(f"{target.name}-{spec.seed}-{next(self._runs)}")
        return [
            workload.Conversation(
                workload.system_prompt(spec.system_tokens, rng.randrange(2**31)),
                workload.user_turns(target.rounds, spec.turn_tokens, rng),
            )
            for _ in range(target.sessions_per_run)
        ]


class Service:
    """Everything `kvwatch serve` runs, built from one config."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.store = Store(config.store.path, config.store.retention_days)
        self.results = ProbeResults()
        self.followers = [
            GatewayLogFollower(
                g.path,
                g.name,
                spread_window_seconds=g.spread_window_seconds,
                session_ttl_seconds=g.session_ttl_seconds,
                max_sessions=g.max_sessions,
                expect_sticky=g.expect_sticky,
            )
            for g in config.gateway_logs
        ]
        self.registry = CollectorRegistry()
        self.registry.register(
            ProbeCollector(
                self.results,
                {t.name: t.interval_seconds for t in config.targets},
                {t.name: t.expect_sticky for t in config.targets},
            )
        )
        self.registry.register(GatewayLogCollector(self.followers))
        for target in config.targets:
            self.results.declare((target.name, target.route_mode))
        # Keys are read once at start; a missing one is a ConfigError before anything runs.
        self.probes = {t.name: probe_settings(t, resolve_api_key(t)) for t in config.targets}
        self.conversations = {t.name: Conversations(t) for t in config.targets}
        self.block_sources = {t.name: block_size_sources(t, config.prometheus.url) for t in config.targets}
        self._gate: asyncio.Semaphore | None = None
        self._client: httpx.AsyncClient | None = None

    async def probe(self, target: Target) -> None:
        """One scheduled run: `sessions_per_run` sessions through one target, recorded and exported.

        The engine's block size is learned anew each run, so an engine redeployed with another is followed.
        """
        started = time.time()
        settings = self.probes[target.name]

        async def one(conversation: workload.Conversation):
            async with self._gate:
                return await run_session(self._client, settings, conversation)

        try:
            sessions = await asyncio.gather(*map(one, self.conversations[target.name].next_run()))
            block = await blocksize.learn(self.block_sources[target.name], sessions)
            sessions = with_block_size(sessions, block.tokens)
        except Exception:  # a probe never raises; this guards the scheduler against a bug
            log.exception("probe run of %s failed", target.name)
            return
        self.results.add_run((target.name, target.route_mode), sessions, started, time.time())
        for session in sessions:
            self.store.add_session(session)
        failed = [s.error_kind for s in sessions if not s.ok]
        log.info(
            "%s: %d sessions, %d failed%s; %s",
            target.name,
            len(sessions),
            len(failed),
            f" ({', '.join(sorted(set(failed)))})" if failed else "",
            block.describe(),
        )

    def poll_gateway_logs(self) -> None:
        for follower in self.followers:
            follower.poll()

    def prune(self) -> None:
        removed = self.store.prune()
        if removed:
            log.info("pruned %d old sessions and alerts", removed)

    def _schedule(self, scheduler: AsyncIOScheduler) -> None:
        now = datetime.now(UTC)
        for target in self.config.targets:
            interval = target.interval_seconds
            scheduler.add_job(
                self.probe, "interval", args=[target], id=f"probe-{target.name}", seconds=interval,
                jitter=min(5.0, interval / 10), next_run_time=now, misfire_grace_time=max(1, int(interval)),
            )  # fmt: skip
        if self.followers:
            scheduler.add_job(
                self.poll_gateway_logs, "interval", id="gateway-logs", seconds=GATEWAY_POLL_SECONDS,
                next_run_time=now,
            )  # fmt: skip
        scheduler.add_job(self.prune, "interval", id="prune", seconds=PRUNE_SECONDS, next_run_time=now)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set; then stop the jobs, close the HTTP side and the store."""
        self._gate = asyncio.Semaphore(MAX_CONCURRENT_SESSIONS)
        # No per-read timeout of the client's own (httpx's default is 5 s): each round has its target's
        # deadline over the whole exchange (ProbeSettings.timeout_seconds).
        self._client = httpx.AsyncClient(
            timeout=None, limits=httpx.Limits(max_connections=MAX_CONCURRENT_SESSIONS)
        )
        runner = web.AppRunner(make_app(self.registry, self.store.add_alerts), access_log=None)
        await runner.setup()
        listen = self.config.exporter
        scheduler = AsyncIOScheduler(
            timezone=UTC, job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 30}
        )
        try:
            await web.TCPSite(runner, listen.host, listen.port).start()
            log.info(
                "exporter and webhook on http://%s:%d (/metrics, POST /alerts)", listen.host, listen.port
            )
            self._schedule(scheduler)
            scheduler.start()
            await stop.wait()
        finally:
            if scheduler.running:
                scheduler.shutdown(wait=False)
            await runner.cleanup()
            await self._client.aclose()
            for follower in self.followers:
                follower.close()
            self.store.close()


def add_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="run probes on a schedule and serve /metrics and the Alertmanager webhook",
        description="Run the configured probes on their schedules, follow the gateway logs, keep the "
        "history in SQLite, and serve /metrics and the Alertmanager webhook (POST /alerts).",
    )
    serve.add_argument("--config", type=Path, required=True, help="kvwatch YAML config")
    serve.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    try:
        service = Service(load_config(args.config))
    except (ConfigError, StoreError, ValueError, OSError) as error:
        print(f"kvwatch serve: {error}", file=sys.stderr)
        return 1

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await service.run(stop)

    try:
        asyncio.run(main())
    except OSError as error:  # the exporter's port is taken, most often
        print(
            f"kvwatch serve: cannot listen on {service.config.exporter.listen}: {error.strerror}",
            file=sys.stderr,
        )
        return 1
    return 0
