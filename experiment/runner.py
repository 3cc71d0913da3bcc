"""The source article's A/B experiment (`kvwatch experiment`): the same sessions through two routes.

Route A (say, round robin) and route B (say, session affinity) get the same seeded conversations on
the same arrival schedule, so that whatever drifts during the run (other traffic, a noisy neighbour,
caches filling up) hits both alike: conversation n arrives for both routes at once (all at the start, or
at a seeded Poisson rate), and each route runs at most `concurrency` sessions at a time. Per route and
round the report gives the median, p90 and p99 client-side TTFT with bootstrap 95 % intervals, the cached
ratio (cached / prompt tokens, token-weighted) and the cached / ideal efficiency; per route, throughput
over the measured span, stickiness, backend switches, errors and the requests each replica served. It
measures and does not judge: a bad picture is a result, not a failure. Each session's first user turn
carries a tag of the run and the route (see experiment.design).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.blocksize import BlockSizeSources, with_block_size
from kvwatch.collectors.probe.records import SessionResult
from kvwatch.collectors.probe.report import failure_hints
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.targets import ProbeClients, metrics_base_urls, run_target_session
from kvwatch.collectors.probe.workload import Conversation
from kvwatch.core.progress import Progress
from kvwatch.experiment.design import ONE_AT_A_TIME, Experiment, Load, Workload, interleave, tag
from kvwatch.experiment.report import write_outputs


def run_experiment(
    a: ProbeSettings,
    b: ProbeSettings,
    conversations: Sequence[Conversation],
    load: Load = ONE_AT_A_TIME,
    run_id: str | None = None,
    block_sources: BlockSizeSources | None = None,
    on_session: Callable[[SessionResult], None] | None = None,
) -> Experiment:
    """Every conversation through A and through B, arriving for both as `load` says.

    Each route has its own `load.in_flight` workers taking its sessions in arrival order, so a slow
    route never holds the other back and its throughput is its own; one worker serves both when
    `load.one_at_a_time`. Each route's `target` is its label.
    A session never raises (see the probe); failures are in the results. The KV block size is learned
    from `block_sources` (by default both routes' /metrics) and the sessions of both routes.
    `on_session` is told of each session as it ends (a progress line).
    """
    if a.target == b.target:
        raise ValueError(f"the two routes need different labels, both are {a.target!r}")
    if not conversations:
        raise ValueError("no conversations to run")
    run_id = run_id or uuid.uuid4().hex[:8]
    routes, arrivals = (a, b), load.arrivals(len(conversations))
    workers = load.in_flight(len(conversations))
    results: tuple[list, list] = ([None] * len(conversations), [None] * len(conversations))

    async def run() -> None:
        # One pool per route, so that one route's sessions do not close the other's kept-alive connections;
        # each route of its kind (an OpenAI-compatible route, a SageMaker endpoint with or without sessions).
        async with ProbeClients() as client_a, ProbeClients() as client_b:
            clients = (client_a, client_b)
            queues = [asyncio.Queue() for _ in range(1 if load.one_at_a_time else 2)]
            loop = asyncio.get_running_loop()
            start = loop.time()

            async def arrive() -> None:
                for conversation, route in interleave(len(conversations)):
                    await asyncio.sleep(start + arrivals[conversation] - loop.time())
                    queues[route % len(queues)].put_nowait((conversation, route))
                for queue in queues:
                    for _ in range(workers):
                        queue.put_nowait(None)

            async def worker(queue: asyncio.Queue) -> None:
                while (arrived := await queue.get()) is not None:
                    conversation, route = arrived
                    tagged = tag(conversations[conversation], run_id, route)
                    session = await run_target_session(clients[route], routes[route], tagged)
                    results[route][conversation] = session
                    if on_session is not None:
                        on_session(session)

            await asyncio.gather(arrive(), *(worker(queue) for queue in queues for _ in range(workers)))
        sources = block_sources or blocksize.sources_for([*metrics_base_urls(a), *metrics_base_urls(b)])
        return await blocksize.learn(sources, [*results[0], *results[1]])

    block = asyncio.run(run())
    sessions = tuple(tuple(with_block_size(route, block.tokens)) for route in results)
    rounds = max(len(c.user_turns) for c in conversations)
    return Experiment(a, b, rounds, load, arrivals, sessions, block)


def run_into(
    a: ProbeSettings,
    b: ProbeSettings,
    workload: Workload,
    out: Path,
    load: Load = ONE_AT_A_TIME,
    block_sources: BlockSizeSources | None = None,
    progress: Progress | None = None,
) -> tuple[Experiment, str | None]:
    """The experiment and its report, written into `out` as `kvwatch experiment` and the dashboard run it.

    `out` is made first, so that a bad directory fails before anything is measured; the report is None,
    and nothing is written, when every session failed. `progress` counts the sessions as they end.
    """
    conversations = workload.conversations()
    out.mkdir(parents=True, exist_ok=True)
    if progress is not None:
        progress.start(2 * len(conversations))
    on_session = progress.advance if progress else None
    experiment = run_experiment(a, b, conversations, load, block_sources=block_sources, on_session=on_session)
    if not any(session.ok for session in experiment.all_sessions):
        return experiment, None
    return experiment, write_outputs(experiment, out, [workload.describe()])


def failures(experiment: Experiment) -> list[str]:
    """How many sessions failed, then one line per error kind with what to check; empty when none failed."""
    sessions = experiment.all_sessions
    failed = [s for s in sessions if not s.ok]
    return [f"{len(failed)} of {len(sessions)} sessions failed", *failure_hints(failed)] if failed else []
