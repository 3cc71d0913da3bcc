"""`kvwatch serve`: probes on a schedule, gateway logs followed, the exporter and the alert webhook.

One asyncio process: a job per target (at a phase of its interval given by its name's hash, or on its cron
schedule; one run at a time, missed runs skipped), a job that polls the gateway logs and one that prunes
the store, on APScheduler and kept on time across steps of the wall clock (serve.jobs);
aiohttp serves /metrics and the webhook; one thread writes the store (StoreWriter). Probes never raise;
a job that fails anyway is logged and the next run goes on. On SIGTERM the runs in flight store what
they have: the sessions' finished rounds, marked interrupted. Each session is stored as each of its
rounds finishes, so that even a SIGKILL loses no finished round.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import random
import time
import uuid
from collections import Counter

from kvwatch.collectors.gatewaylogs.metrics import GatewayLogCollector
from kvwatch.collectors.gatewaylogs.sources import PushedLog, open_log
from kvwatch.collectors.probe import blocksize, targets, workload
from kvwatch.collectors.probe.records import SessionResult
from kvwatch.collectors.probe.session import ProbeSettings, failed_run, unforeseen
from kvwatch.collectors.probe.targets import ProbeClients, run_target_session
from kvwatch.config.settings import Config, Target
from kvwatch.core.naming import plural
from kvwatch.core.redaction import redact
from kvwatch.core.schedule import cron_trigger
from kvwatch.serve import shard, startup
from kvwatch.serve.exporter import LabelledRegistry, ProbeCollector, ProbeResults
from kvwatch.serve.jobs import Jobs
from kvwatch.store.history import AlertsAdded, StoreWriter, WriteDropped

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
        session_key=target.session.key,
        backend_headers=target.backend.headers,
        backend_json_paths=target.backend.json_paths,
        router=target.router,
        max_tokens=target.workload.max_tokens,
        timeout_seconds=target.timeout_seconds,
        kind=target.kind,
        sagemaker=target.sagemaker,
        idle_after_round=target.lifecycle.idle_after_round,
        idle_seconds=target.lifecycle.idle_seconds,
        check_close=target.lifecycle.check_close,
    )


def phase(name: str, interval: float) -> float:
    """Seconds into each interval at which the runs of target `name` start: spread over the interval by
    the name's hash, as Prometheus spreads its scrapes, so that many targets do not probe in a burst, and
    the same after a restart."""
    return shard.hashmod(name, 2**32) / 2**32 * interval


def block_size_sources(target: Target, prometheus_url: str | None) -> blocksize.BlockSizeSources:
    """The target's block size when the config sets it, else where to learn it: Prometheus, the route's
    /metrics, then the sessions' cached tokens."""
    override = None
    if target.block_size is not None:
        override = blocksize.BlockSize(target.block_size, f"block_size of target {target.name} in the config")
    return blocksize.sources_for(
        targets.metrics_base_urls(probe_settings(target, None)), prometheus_url, override
    )


def run_summary(sessions: list[SessionResult], seconds: float) -> str:
    """One run in a line: its sessions and time, the share that stayed on one replica, and the failed
    ones by error kind, `8 sessions in 12.4 s, 100% on one replica, 2 failed (timeout 1, http_5xx 1)`."""
    judged = [s.sticky for s in sessions if s.sticky is not None]
    sticky = f"{sum(judged) / len(judged):.0%} on one replica" if judged else "stickiness not judged"
    kinds = Counter(s.error_kind or "unknown" for s in sessions if not s.ok)
    errors = ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))
    interrupted = sum(s.interrupted for s in sessions)
    return (
        f"{plural(len(sessions), 'session')} in {seconds:.1f} s, {sticky}, {sum(kinds.values())} failed"
        + (f" ({errors})" if errors else "")
        + (f", {interrupted} cut short by the stop" if interrupted else "")
    )


class Conversations:
    """Fresh conversations for every run of one target, each with a system prompt of its own: round 1
    is then a true cold prefill and rounds 2+ can only reuse their own session's history, so the
    warm/cold TTFT ratio and the cached tokens measure affinity and nothing else."""

    def __init__(self, target: Target, sharegpt: list[workload.Conversation] | None = None) -> None:
        self.target = target
        self._runs = itertools.count()
        self._pool = None if sharegpt is None else itertools.cycle(sharegpt)

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
    """Everything `kvwatch serve` runs, built from one config: the probes of the targets in its shard."""

    def __init__(
        self, config: Config, part: shard.Shard = shard.WHOLE, prepared: startup.Prepared | None = None
    ) -> None:
        self.config = config
        self.shard = part
        self.targets = part.select(config.targets)
        # The keys, files and store, read and checked once at start (startup.prepare, which `kvwatch config
        # check` runs too): any problem is a StartRefused before anything runs.
        prepared = prepared or startup.prepare(config, part)
        self.store = prepared.store
        self.writer = StoreWriter(
            config.store.queue_capacity, config.store.retry_seconds, self.store.location
        )
        self.results = ProbeResults()
        self.followers = [open_log(g) for g in config.gateway_logs]
        cluster = config.exporter.cluster
        self.registry = LabelledRegistry({config.cluster_label: cluster} if cluster else {})
        self.registry.register(
            ProbeCollector(
                self.results,
                {t.name: t.interval_seconds for t in self.targets},
                {t.name: t.expect_sticky for t in self.targets},
            )
        )
        self.registry.register(GatewayLogCollector(self.followers))
        self.registry.register(self.writer)
        for target in self.targets:
            self.results.declare((target.name, target.route_mode), target.rounds)
        self.probes = {t.name: probe_settings(t, prepared.api_keys[t.name]) for t in self.targets}
        self.webhook_token = prepared.webhook_token
        self.conversations = {t.name: Conversations(t, prepared.sharegpt[t.name]) for t in self.targets}
        self.block_sources = {t.name: block_size_sources(t, config.prometheus.url) for t in self.targets}
        self._gate: asyncio.Semaphore | None = None
        self._clients: ProbeClients | None = None
        self._stop: asyncio.Event | None = None

    async def probe(self, target: Target) -> None:
        """One scheduled run: `sessions_per_run` sessions through one target, recorded and exported.

        The engine's block size is learned anew each run, so an engine redeployed with another is followed.
        A stop cuts the sessions short; those with a finished round are stored, marked interrupted. Each
        session is stored in flight after each round, and once more as it ended.
        """
        started = time.time()
        settings = self.probes[target.name]
        route = (target.name, target.route_mode)

        async def one(conversation: workload.Conversation) -> tuple[str, SessionResult]:
            uid = uuid.uuid4().hex

            def store_in_flight(so_far: SessionResult) -> None:
                self.writer.submit(self.store.add_session, so_far, uid, True)

            async with self._gate:
                return uid, await run_target_session(
                    self._clients,
                    settings,
                    conversation,
                    stop=self._stop,
                    on_round=store_in_flight,
                    on_result=functools.partial(self.results.add_round, route),
                )

        try:
            # Building a large workload's text takes seconds: in a thread, the exporter, the webhook and
            # a stop are served meanwhile.
            conversations = await asyncio.to_thread(self.conversations[target.name].next_run)
            ran = await asyncio.gather(*map(one, conversations))
        except Exception as error:  # a bug outside the rounds (which never raise): recorded as the run
            failed = failed_run(settings, error, started)
            log.error("probe run of %s failed: %s", target.name, failed.rounds[0].error_detail)
            ran = [(uuid.uuid4().hex, failed)]
        ran = [(uid, s) for uid, s in ran if s.rounds]  # stopped before round 1 ended: nothing measured
        uids, sessions = [uid for uid, _ in ran], [s for _, s in ran]
        block = await self._block_size(target, sessions)
        sessions = blocksize.with_block_size(sessions, block.tokens)
        self.results.add_run(route, sessions, started, time.time())
        for uid, session in zip(uids, sessions, strict=True):
            self.writer.submit(self.store.add_session, session, uid)
        log.info("%s: %s; %s", target.name, run_summary(sessions, time.time() - started), block.describe())

    async def _block_size(self, target: Target, sessions: list[SessionResult]) -> blocksize.BlockSize:
        """The engine's block size, or the default when learning it failed unforeseen: the run's sessions
        are recorded either way."""
        try:
            return await blocksize.learn(self.block_sources[target.name], sessions)
        except Exception as error:  # learn never raises: a bug
            reason = redact(unforeseen(error), self.probes[target.name].api_key)
            log.error("learning the block size of %s failed: %s", target.name, reason)
            return blocksize.BlockSize(blocksize.DEFAULT_TOKENS, "default; learning it failed")

    def poll_gateway_logs(self) -> None:
        for follower in self.followers:
            follower.poll()

    async def prune(self) -> None:
        with contextlib.suppress(WriteDropped):  # the writer has said why
            removed = await asyncio.wrap_future(self.writer.submit(self.store.prune))
            if removed:
                log.info("pruned %d old sessions and alerts", removed)

    def store_alerts(self, payload: object) -> AlertsAdded:
        """The webhook's alerts, stamped with the time they arrived, once the writer thread has them."""
        return self.writer.submit(self.store.add_alerts, payload, time.time()).result()

    def jobs(self) -> Jobs:
        """The probe of each target at its phase or on its schedule, the gateway-log poll (in a thread: it
        reads files) and the store's pruning, the last two from now on."""
        jobs = Jobs()
        for t in self.targets:
            run, name = functools.partial(self.probe, t), f"probe run of {t.name}"
            if t.schedule is None:
                jobs.every(name, run, t.interval_seconds, phase=phase(t.name, t.interval_seconds))
            else:
                jobs.add(name, run, cron_trigger(t.schedule, t.timezone), f'on "{t.schedule}" ({t.timezone})')
        if self.followers:
            poll = functools.partial(asyncio.to_thread, self.poll_gateway_logs)
            jobs.every("gateway-log poll", poll, GATEWAY_POLL_SECONDS, phase=None)
        jobs.every("store pruning", self.prune, PRUNE_SECONDS, phase=None)
        return jobs

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set; then let the runs in flight store what they have, close the HTTP
        side and write what is queued for the store (store.flush_seconds at most)."""
        from aiohttp import web  # here, not at the top: only this command pays for importing aiohttp

        from kvwatch.serve.endpoints import make_app, open_webhook_warning

        self._stop = stop
        self._gate = asyncio.Semaphore(MAX_CONCURRENT_SESSIONS)
        # Each round has its target's deadline over the whole exchange (ProbeSettings.timeout_seconds).
        self._clients = ProbeClients()
        app = make_app(self.registry, self.store_alerts, self.webhook_token)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        listen = self.config.exporter
        try:
            for pushed in (f for f in self.followers if isinstance(f, PushedLog)):
                pushed.start()  # listening before the exporter serves, or serve stops with the reason
            await web.TCPSite(runner, listen.host, listen.port).start()
            log.info(
                "exporter and webhook on http://%s:%d (/metrics, POST /alerts)", listen.host, listen.port
            )
            if warning := open_webhook_warning(listen, self.webhook_token):
                log.warning("%s", warning)
            if self.shard != shard.WHOLE:
                log.log(
                    logging.INFO if self.targets else logging.WARNING,
                    "shard %s: probing %d of %d targets%s",
                    self.shard,
                    len(self.targets),
                    len(self.config.targets),
                    f": {', '.join(t.name for t in self.targets)}" if self.targets else "",
                )
            await self.jobs().run(stop)
        finally:
            await runner.cleanup()
            await self._clients.aclose()
            for follower in self.followers:
                follower.close()
            self.writer.close(self.config.store.flush_seconds)
            self.store.close()
