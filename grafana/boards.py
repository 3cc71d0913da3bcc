"""kvwatch's Grafana boards, built of grafana/panels.py's panels from prometheus/panel_queries.py's queries.

`kvwatch generate` writes each board twice: grafana/dashboards/ for file provisioning (a
`datasource` variable and no `__inputs`, which provisioning never resolves) and grafana/import/ for the
UI's Import, whose `__inputs` make Grafana ask for a Prometheus data source and start on it. Output is
deterministic: uids hash the file name, panel ids count up in layout order.

"""

from __future__ import annotations

import copy
import json

from kvwatch.alerts.verdicts import (
    CLUSTER_HIT_RATIO_DROP,
    ENGINE_LOSS,
    INSTANCE_HIT_RATIO_DROP,
    LISTENER_SPREAD,
    LOAD_IMBALANCE,
    PROBES_DOMINATE,
    ROUTE_REUSE,
    ROUTE_STICKY,
    ROUTE_WARM_ROUNDS,
    ROUTER_PREDICTION_MISS,
    ROUTING_LOSS,
)
from kvwatch.collectors.probe.records import REUSED_SHARE
from kvwatch.grafana.panels import (
    DRILLDOWN,
    GRID_WIDTH,
    IMPORT_INPUT,
    JSON,
    MIN_GRAFANA,
    NO_ENGINE_DATA,
    NO_GATEWAY_DATA,
    NO_PROBE_DATA,
    OVERVIEW,
    PROBE_MIN_INTERVAL,
    ROUTE_LEGEND,
    Layout,
    cached_share_by_source,
    dashboard,
    heatmap,
    hit_ratio_by_instance,
    local_hit_ratio_by_instance,
    probe_route_timeseries,
    probe_timeseries,
    request_share_by_instance,
    rounds_barchart,
    share_timeseries,
    stat,
    state_timeline,
    target,
    timeseries,
    verdict_stat,
)
from kvwatch.grafana.routers import judged_by, reuse_decomposition_row, router_row, router_state_row
from kvwatch.prometheus import panel_queries, queries
from kvwatch.prometheus.thresholds import THRESHOLDS, Thresholds

VERDICT_PANELS = (
    ("Session affinity (probes)", "Whether probe sessions through each sticky route stay on one replica",
     ROUTE_STICKY, "{{target}}"),
    ("Session reuse (probes)", "Whether probe sessions through each sticky route whose rounds name no "
     "replica (SageMaker) still reuse their history, by the share of them whose warm rounds all did: reuse "
     "is that route's stickiness", ROUTE_REUSE, "{{target}}"),
    ("Real sessions (gateway logs)", "Whether real sessions through each sticky gateway listener stay on "
     "one replica", LISTENER_SPREAD, "{{log}} / {{listener}}"),
    ("Warm rounds (probes)", "Whether warm rounds through each sticky route are faster than round 1",
     ROUTE_WARM_ROUNDS, "{{target}}"),
    ("Cluster hit ratio drop", "Whether the cluster's hit ratio dropped", CLUSTER_HIT_RATIO_DROP,
     "cluster"),
    ("Instance hit ratio drop", "Whether an instance's hit ratio dropped", INSTANCE_HIT_RATIO_DROP,
     "{{instance}}"),
    ("Load balance", "Whether requests are spread evenly over the replicas", LOAD_IMBALANCE,
     "cluster"),
    ("Router predictions", "Whether the engines deliver the prefix reuse each router predicts",
     ROUTER_PREDICTION_MISS, "{{job}} / {{instance}}"),
    ("Routing loss", "Whether each router sends requests where their prefix is held", ROUTING_LOSS,
     "{{job}} / {{instance}}"),
    ("Engine loss", "Whether the engines reuse what each router predicted cached", ENGINE_LOSS,
     "{{job}} / {{instance}}"),
    ("Probes' share", "Whether kvwatch's own probes are most of the cluster's prompt tokens",
     PROBES_DOMINATE, "cluster"),
)  # fmt: skip


def _verdict_row(layout: Layout, t: Thresholds) -> None:
    """The alerts' verdicts, one stat each, across the whole width."""
    layout.row("What the alerts say")
    count = len(VERDICT_PANELS)
    for i, (title, what, verdict, legend) in enumerate(VERDICT_PANELS):
        width = GRID_WIDTH * (i + 1) // count - GRID_WIDTH * i // count  # one line, the whole width
        layout.add(verdict_stat(title, what, judged_by(verdict, t), legend), width, 4)


def _reuse_row(layout: Layout) -> None:
    """The engines' prefix-cache hit ratios and where the cached tokens came from."""
    layout.row("Is the KV cache reused?")
    layout.add(
        stat(
            "Cluster hit ratio",
            "Delivered: prompt tokens served from cached KV (the prefix caches, host memory, disk or another "
            "instance) over all prompt tokens, token-weighted across the whole fleet, a replica with caching "
            "off counted as 0 % (the job and instance filters do not apply). Beside it, labelled, the local "
            "lookup ratio: tokens found over tokens looked up in the engines' own prefix caches.\n\n"
            "Good: steady, and high for multi-turn chat (the lab holds about 80 % with affinity). Bad: a "
            "drop when the gateway changed: sessions no longer land where their history is cached. Whether "
            "the alert says so is in Cluster hit ratio drop, under What the alerts say.",
            [
                target(queries.CLUSTER_HIT_RATIO, "delivered (cached / prompt tokens)"),
                target(queries.CLUSTER_LOCAL_HIT_RATIO, "local lookups (hits / lookups)"),
            ],
            steps=[("blue", None)],
            unit="percentunit",
            no_value=NO_ENGINE_DATA,
            alert="KVWatchPrefixCacheHitRateDrop",
        ),
        5,
    )
    layout.add(hit_ratio_by_instance(), 9)
    layout.add(
        rounds_barchart(
            "Probe TTFT per round: affinity vs round robin",
            "Median client-side time to first token of the probe's sessions, per round (x axis) and route "
            "mode, over the whole time range: the source article's A/B chart.\n\n"
            "Good: the affinity bars stay flat from round 2 on while round robin's grow with the history. "
            "Bad: the affinity bars climb like round robin's: rounds 2+ pay a full prefill again. Medians "
            "are interpolated within the probe's TTFT histogram buckets.",
            panel_queries.PROBE_TTFT_BY_ROUND,
            unit="s",
            no_value=NO_PROBE_DATA,
            alert="KVWatchWarmRoundNoGain",
        ),
        10,
    )

    layout.add(local_hit_ratio_by_instance(), 12)
    layout.add(cached_share_by_source(), 12)
    layout.add(
        rounds_barchart(
            "Real users' TTFT per round (gateway logs)",
            "Median time to first byte of real users' requests by their round in the session (the n-th "
            "request of its session id the gateway logged; 8+: the 8th and later), per gateway listener, "
            "from the access log: each listener's latest 256 requests of the round.\n\n"
            "It is the time to first token where the gateway times the answer's first body byte (Envoy "
            "1.37+ with first_body_byte_us). nginx times the headers, which vLLM, SGLang and the lab's "
            "replicas send before the first token: there it is not TTFT (docs/gateway-logs.md).\n\n"
            "Good: a sticky listener's bars stay flat from round 2 on. Bad: they climb with the round "
            "like round robin's: later rounds pay for the whole history again.",
            panel_queries.GATEWAY_FIRST_BYTE_BY_ROUND,
            column="listener",
            capped=True,
            unit="s",
            no_value=NO_GATEWAY_DATA,
        ),
        24,
    )


def own_share_row(layout: Layout, t: Thresholds = THRESHOLDS) -> None:
    """kvwatch's own probes' share of the engines' prompt tokens, and the hit ratio without them."""
    layout.row("kvwatch's own share")
    layout.add(
        share_timeseries(
            "Real traffic's hit ratio and the probes' share",
            "kvwatch's probes are traffic the engines count too: every probe request's prompt and cached "
            "tokens as the engine counted them (its usage, failed rounds included). Their share of the "
            "cluster's prompt tokens, per route and in all, and the cluster's delivered hit ratio with "
            "them left out (real traffic's), beside the cluster's own.\n\n"
            f"Good: the probes' share low, and the two hit ratios close. Bad: a share above "
            f"{t.probe_share_above:.0%} ({PROBES_DOMINATE.alert.name}): the cluster's ratio describes the "
            "probes, and real traffic's may be far from it.",
            [
                target(queries.CLUSTER_HIT_RATIO, "hit ratio, everything"),
                target(queries.CLUSTER_REAL_HIT_RATIO, "hit ratio, real traffic (probes left out)"),
                target(queries.CLUSTER_PROBE_SHARE, "probes' share of prompt tokens"),
                target(panel_queries.PROBE_SHARE_BY_ROUTE, "probes' share through {{target}}"),
            ],
            no_value=NO_PROBE_DATA,
            alert=PROBES_DOMINATE.alert.name,
        ),
        GRID_WIDTH,
    )


def _pinning_row(layout: Layout, t: Thresholds) -> None:
    """Whether probe sessions stay on one replica, and what that saves them."""
    layout.row("Are sessions pinned?")
    layout.add(
        probe_route_timeseries(
            "Sticky probe sessions",
            "Share of probe sessions whose rounds all landed on one replica (sessions without evidence "
            "either way are left out), over the rate window: a trend over more runs than the alert's, "
            "which judges the last run (see Session affinity under What the alerts say).\n\n"
            "Good: 100 % on a sticky route. Bad: below 100 % there: the gateway lost the session "
            "pinning (round robin back, session header dropped, hash key not the session id). A "
            "round-robin route sits near 0 %.",
            panel_queries.PROBE_STICKY_SHARE,
            unit="percentunit",
            max_value=1,
            alert="KVWatchSessionAffinityBroken",
        ),
        6,
    )
    layout.add(
        timeseries(
            "Real sessions on several replicas (gateway logs)",
            "Of the real sessions that came back to a gateway listener within its log's spread window "
            "(spread_window_seconds, 10 minutes by default), the share served by more than one replica: "
            "failover=false with nothing to explain the move (what KVWatchGatewaySessionsSpread judges), "
            "failover=true moved by a failed replica, kept apart.\n\n"
            "Good: near 0 % without a failover on a sticky listener. Bad: rising there: the gateway no "
            "longer pins real users' sessions, whatever the probes see. A round-robin listener sits high.",
            [target(panel_queries.REAL_SESSIONS_SPREAD, "{{log}} / {{listener}}, failover={{failover}}")],
            unit="percentunit",
            max_value=1,
            no_value=NO_GATEWAY_DATA,
            alert="KVWatchGatewaySessionsSpread",
        ),
        6,
    )
    layout.add(
        probe_route_timeseries(
            "Backend switches per probe session",
            "How often consecutive rounds of a probe session changed replica.\n\n"
            "Good: 0 on a sticky route. Bad: above 0 there, up to rounds - 1 when every round lands "
            "elsewhere, as on a round-robin route.",
            panel_queries.PROBE_BACKEND_SWITCHES_PER_SESSION,
            unit="short",
            alert="KVWatchSessionAffinityBroken",
        ),
        6,
    )
    layout.add(
        probe_route_timeseries(
            "Warm / cold TTFT ratio",
            "Median TTFT of rounds 2+ over round 1's, per probe route, in each run: the gauge the alert "
            "judges.\n\n"
            "Good: well below 100 % on a sticky route: warm rounds reuse their history (the alert fires "
            f"above {t.warm_cold_ratio_above:.0%} for {judged_by(ROUTE_WARM_ROUNDS, t).alert.for_}). Bad: "
            "near or above 100 %: every round prefills the whole conversation, as on the round-robin route.",
            panel_queries.WARM_COLD_TTFT_RATIO,
            unit="percentunit",
            alert="KVWatchWarmRoundNoGain",
        ),
        6,
    )
    _evidence_panels(layout, t)


def _evidence_panels(layout: Layout, t: Thresholds) -> None:
    """What each route's stickiness is judged by, and the last run's judgement with its warm reuse."""
    layout.add(
        timeseries(
            "Stickiness evidence per route",
            "What each route's probe sessions were judged sticky or not by: replica (every round named "
            "the replica that served it), reuse (no round named one, as behind SageMaker: the warm "
            "rounds' cached tokens against the ideal at the engine's block), none (neither).\n\n"
            "Good: replica or reuse at 100 % on every route. Bad: none: the route's stickiness is not "
            "judged, and Sticky probe sessions leaves it out.",
            [target(panel_queries.PROBE_EVIDENCE_SHARE, f"{ROUTE_LEGEND}: {{{{evidence}}}}")],
            unit="percentunit",
            max_value=1,
            no_value=NO_PROBE_DATA,
            interval=PROBE_MIN_INTERVAL,
            drilldown="target",
        ),
        12,
    )
    layout.add(
        timeseries(
            "Sticky sessions and warm reuse of the last probe run",
            "Per route, the share of the last run's sessions judged sticky, labelled with the evidence "
            "they were judged by, and the cached over ideal cached tokens of its warm rounds. Judged by "
            "replica, the share is what KVWatchSessionAffinityBroken fires on; judged by reuse (a session "
            f"is sticky when each warm round had at least {REUSED_SHARE:.0%} of the cached tokens a pinned "
            f"session holds), what KVWatchSessionReuseLost fires on, below {t.sticky_ratio_below:.0%}. The "
            "warm reuse is their context: a round sent to another instance still finds what that one kept "
            "of its session, so it falls less than the share.\n\nGood: near 100 % on a sticky route. Bad: "
            f"the share below {t.sticky_ratio_below:.0%} there: the sessions no longer reach the instance "
            "that holds them.",
            [
                target(
                    panel_queries.PROBE_LAST_RUN_STICKY,
                    f"{ROUTE_LEGEND}: sticky sessions by {{{{evidence}}}}",
                ),
                target(panel_queries.PROBE_WARM_REUSE, f"{ROUTE_LEGEND}: warm reuse ({{{{evidence}}}})"),
            ],
            unit="percentunit",
            no_value=NO_PROBE_DATA,
            interval=PROBE_MIN_INTERVAL,
            drilldown="target",
            alert="KVWatchSessionReuseLost",
        ),
        12,
    )


def _session_keys_row(layout: Layout) -> None:
    """Reuse per probe round, the session keys the gateway sees, and the load share."""
    layout.row("Reuse and session keys")
    layout.add(
        probe_route_timeseries(
            "Affinity efficiency (cached / ideal tokens)",
            "Prompt tokens the engine reported cached in rounds 2+, over what a perfectly pinned replica "
            "would have cached (the previous round's prompt and answer, block-aligned).\n\n"
            "Good: near 100 % on an affinity route. Bad: falling towards the shared system prompt's share "
            "of the prompt: the history is recomputed on another replica; falling on every route: the KV "
            "cache evicts too early, or prefix caching is off.",
            panel_queries.AFFINITY_EFFICIENCY,
            unit="percentunit",
            alert="KVWatchSessionAffinityBroken",
        ),
        8,
    )
    layout.add(
        timeseries(
            "Session-key health",
            "Gateway: share of requests that arrived without a session key, so the gateway assigned one. "
            "Probe: share of probe sessions whose session id did not come back.\n\n"
            "Good: at the gateway, about one request per conversation (1 / rounds) when clients follow the "
            "protocol, 0 when they make their own ids; for the probe, 0. Bad: requests without a key "
            "nearing 100 % (clients do not send the id back), or a probe id not echoed (the gateway drops "
            "or replaces it).",
            [
                target(
                    panel_queries.REQUESTS_WITHOUT_SESSION_KEY_SHARE, "gateway {{log}} / {{listener}}: no key"
                ),
                target(panel_queries.SESSION_ID_NOT_ECHOED_SHARE, "probe {{target}}: id not echoed"),
            ],
            unit="percentunit",
            max_value=1,
            no_value=NO_GATEWAY_DATA,
            alert="KVWatchSessionIdNotPropagated",
            interval=PROBE_MIN_INTERVAL,
        ),
        8,
    )
    layout.add(request_share_by_instance(), 8)


def _load_row(layout: Layout, t: Thresholds) -> None:
    """The load balance, the probe's errors and the alerts firing."""
    layout.row("Load, probe errors and alerts")
    layout.add(
        timeseries(
            "Load imbalance (busiest / mean)",
            "Finished requests per second of the busiest instance over the mean of all instances.\n\n"
            "Good: close to 1 (1 is perfectly even). Bad: above "
            f"{t.load_imbalance_above:g}, the alert's threshold: one replica takes the heat "
            "while others idle.",
            [target(queries.CLUSTER_LOAD_IMBALANCE, "busiest / mean")],
            unit="short",
            no_value=NO_ENGINE_DATA,
            alert="KVWatchReplicaLoadImbalance",
        ),
        8,
    )
    layout.add(
        probe_timeseries(
            "Probe errors by kind",
            "Failed probe rounds per second, by error kind. Every kind is exported from 0, so a flat 0 is "
            "a real zero.\n\n"
            "Good: 0. Bad: unauthorized or forbidden (the API key), not_found (model id or base URL), "
            "connection_refused, dns_error (the host name does not resolve), timeout, bad_response (an error "
            "object instead of choices), stream_error, http_error, tls_mismatch (https:// to a plain-HTTP "
            "port, or http:// to a TLS port), tls_error, protocol_error (an answer that is no HTTP/1.1), "
            "internal_error (a bug).",
            [target(panel_queries.PROBE_ERRORS_BY_KIND, "{{kind}}")],
            unit="reqps",
            alert="KVWatchProbeFailing",
        ),
        8,
    )
    layout.add(
        state_timeline(
            "Firing kvwatch alerts",
            "kvwatch alerts firing in this Prometheus over time (the always-firing Watchdog left out).\n\n"
            "Good: empty. Bad: any bar: open the runbook at that alert.",
            [target(panel_queries.FIRING_ALERTS_BY_NAME, "{{alertname}} ({{severity}})")],
            unit="short",
            no_value="No kvwatch alert firing",
        ),
        8,
    )


def _engine_ttft_row(layout: Layout) -> None:
    """Each engine family's TTFT histogram over time."""
    layout.row("Engine TTFT")
    for engine, expr in panel_queries.ENGINE_TTFT_BUCKET_RATES.items():
        layout.add(
            heatmap(
                f"Engine TTFT distribution ({engine})",
                f"Time to first token as the {engine} engines measure it: requests per second in each "
                "histogram bucket over time.\n\n"
                "Good: one tight band low down, at the cost of a cached prefill. Bad: a second band higher "
                "up (requests prefilling their whole history: cache misses) or the band creeping upwards "
                "(queueing).",
                expr,
                no_value=f"No {engine} engine among the selected instances",
            ),
            12,
        )


def overview(t: Thresholds = THRESHOLDS) -> JSON:
    layout = Layout()
    _verdict_row(layout, t)
    _reuse_row(layout)
    own_share_row(layout, t)
    _pinning_row(layout, t)
    _session_keys_row(layout)
    router_row(layout, t)
    reuse_decomposition_row(layout, t)
    router_state_row(layout, t)
    _load_row(layout, t)
    _engine_ttft_row(layout)
    return dashboard(
        OVERVIEW,
        "kvwatch: KV-cache session affinity",
        "Whether each conversation stays on the replica that holds its KV cache: hit ratios, per-round "
        "TTFT, probe stickiness, session keys and load.",
        layout,
        many_targets=True,
        cluster_label=t.cluster_label,
    )


def drilldown(t: Thresholds = THRESHOLDS) -> JSON:
    layout = Layout()
    layout.row("Probe target $target")
    layout.add(
        probe_timeseries(
            "Probe TTFT per round over time",
            "Median TTFT of each round of the probe's sessions through this target: the per-round chart as "
            "lines over time, to see when a change began.\n\n"
            "Good: rounds 2+ at or below round 1. Bad: later rounds above round 1, the more so the later "
            "the round.",
            [target(panel_queries.PROBE_TTFT_BY_ROUND_OVER_TIME, "round {{round}}")],
            unit="s",
            alert="KVWatchWarmRoundNoGain",
        ),
        10,
    )
    layout.add(
        probe_timeseries(
            "Probe rounds per backend",
            "Which replicas served the probe's rounds through this target.\n\n"
            "Good: the rounds spread over the replicas while each session keeps to one (see Sticky probe "
            "sessions). Bad: a replica missing (down, or out of the hash ring), or `other`: more backends "
            "than kvwatch tracks per route.",
            [target(panel_queries.PROBE_ROUNDS_BY_BACKEND, "{{backend}}")],
            unit="reqps",
        ),
        9,
    )
    layout.add(
        stat(
            "Since the last probe run",
            "Time since the probe's last run through this target finished.\n\n"
            "Good: under the probe interval (interval_seconds). Bad: several intervals: the scheduler is "
            "stuck or kvwatch serve is down, and the probe panels are stale.",
            [target(panel_queries.PROBE_LAST_RUN_AGE)],
            steps=[("blue", None)],
            unit="s",
            no_value="The probe never ran for this target",
            alert="KVWatchProbeStale",
        ),
        5,
    )
    layout.row("Instances $instance")
    layout.add(hit_ratio_by_instance(), 8)
    layout.add(
        timeseries(
            "Engine TTFT quantiles",
            "Each instance's TTFT quantiles as its engine measures them (server side, without the "
            "gateway).\n\n"
            "Good: the median near the cost of a cached prefill. Bad: the median rising towards a full "
            "prefill (its requests miss the cache), or p99 far above the median (queueing).",
            [target(panel_queries.TTFT_QUANTILES_BY_INSTANCE, "{{instance}} {{quantile}} quantile")],
            unit="s",
            no_value=NO_ENGINE_DATA,
        ),
        8,
    )
    layout.add(request_share_by_instance(), 8)
    layout.add(local_hit_ratio_by_instance(), 12)
    layout.add(cached_share_by_source(), 12)
    return dashboard(
        DRILLDOWN,
        "kvwatch: one probe target and chosen instances",
        "One probe route's rounds and backends, and the chosen engine instances' cache, TTFT and load.",
        layout,
        many_targets=False,
        cluster_label=t.cluster_label,
    )


BOARDS = {OVERVIEW: overview, DRILLDOWN: drilldown}


def for_import(board: JSON) -> JSON:
    """The board for the UI's Import: Grafana asks for a Prometheus data source, writes its uid where
    `${DS_PROMETHEUS}` stands, and the `datasource` variable starts on it."""
    board = copy.deepcopy(board)
    (source,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    source["current"] = {"selected": True, "text": f"${{{IMPORT_INPUT}}}", "value": f"${{{IMPORT_INPUT}}}"}
    panel_types = sorted({p["type"] for p in board["panels"] if p["type"] != "row"})
    board["__inputs"] = [
        {
            "description": "The Prometheus that scrapes the engines and kvwatch",
            "label": "Prometheus",
            "name": IMPORT_INPUT,
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
            "type": "datasource",
        }
    ]
    board["__requires"] = [
        {"id": "grafana", "name": "Grafana", "type": "grafana", "version": MIN_GRAFANA},
        {"id": "prometheus", "name": "Prometheus", "type": "datasource", "version": "1.0.0"},
        *({"id": kind, "name": kind, "type": "panel", "version": ""} for kind in panel_types),
    ]
    return board


def _dump(board: JSON) -> str:
    return json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def dashboard_files(t: Thresholds = THRESHOLDS) -> dict[str, str]:
    """Repository path -> text of every generated board, both variants, with `t`'s thresholds in their
    descriptions, telling clusters apart by its cluster label."""
    files = {}
    for name, build in BOARDS.items():
        board = build(t)
        files[f"grafana/dashboards/{name}"] = _dump(board)
        files[f"grafana/import/{name}"] = _dump(for_import(board))
    return files
