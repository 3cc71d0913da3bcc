"""Overview: what fires now, do sessions stay on their replica and what does it cost, and is the KV cache
reused? Each number with its trend over the chosen range, coloured by what a rise of it means; each
verdict is the state of the alert that watches the number, from the alert's own expression, so that a
tile is red exactly when its alert fires, and blue while the signal is healthy again but the alert is
held by its keep_firing_for."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from kvwatch.alerts import verdicts
from kvwatch.collectors.probe.records import REUSED_SHARE
from kvwatch.config.settings import Config, GatewayLog, Target
from kvwatch.core.redaction import redact
from kvwatch.dashboard import data, reuse, ui
from kvwatch.prometheus import panel_queries, pipeline, queries

SEVERITIES = ("critical", "warning", "info")  # the banner's order
LAST_RUN = "in the last probe run, as the alert judges it"
RATE_WINDOW = f"a window of {data.MIN_RATE_WINDOW_SECONDS // 60} minutes or more"
NOT_STICKY = "Not expected to stay on one replica: no alert watches its stickiness."


@dataclass(frozen=True)
class Shown:
    """A number on the Overview: its query over the range and, when an alert watches it, its verdict."""

    label: str
    query: str
    unit: ui.Unit
    rise: str  # what a rise of it means: ui.GOOD, ui.BAD or ui.NEUTRAL
    verdict: verdicts.Verdict | None
    says: str  # with a verdict, in green where it finds nothing wrong; else in grey, why none judges it
    help: str


# The numbers, one row each: label, query, unit, what a rise means, the verdict that judges it, what the
# tile says where the alert finds nothing wrong (or why no alert judges it) and its help.
SHOWN = tuple(Shown(*row) for row in (
    ("Cluster hit ratio", queries.CLUSTER_HIT_RATIO, ui.RATIO, ui.GOOD, verdicts.CLUSTER_HIT_RATIO_DROP,
     "Reuse holds: no drop against its own past, and above the floor.",
     "Prompt tokens served from cached KV (the prefix cache, host memory, disk or another instance) over "
     f"all prompt tokens, over {queries.WINDOW}; a replica with caching off counts as 0 %."),
    ("Local lookup ratio", queries.CLUSTER_LOCAL_HIT_RATIO, ui.RATIO, ui.GOOD, None,
     "No alert judges it: a replica with caching off drops out of it instead of counting as 0 %.",
     "Prompt tokens found over prompt tokens looked up in the engines' own prefix caches, over "
     f"{queries.WINDOW}."),
    ("Sessions on one replica", queries.STICKY_RATIO, ui.RATIO, ui.GOOD, verdicts.ROUTE_STICKY,
     "Sessions stay on their replica.",
     f"Share of the probe sessions whose rounds all landed on one replica, {LAST_RUN}."),
    ("Sessions reusing their history", queries.REUSED_SESSIONS_RATIO, ui.RATIO, ui.GOOD, verdicts.ROUTE_REUSE,
     "Sessions reuse their history: they reach the replica that holds it.",
     "No round names its replica on this route (SageMaker names none), so reuse judges its stickiness: "
     f"share of the probe sessions whose every warm round had at least {REUSED_SHARE:.0%} of the cached "
     f"tokens a replica holding the conversation would have, {LAST_RUN}."),
    ("Warm rounds' reuse", queries.WARM_REUSE_RATIO, ui.RATIO, ui.GOOD, None,
     "No alert judges it: the tokens behind the share of sessions beside it.",
     "Cached over ideal cached tokens of the warm rounds (what a replica holding each conversation would "
     f"have cached), {LAST_RUN}: a round sent to another replica still finds what that one kept of its "
     "session, so this falls less than the share of sessions does."),
    ("Warm / cold TTFT", queries.WARM_COLD_RATIO, ui.FACTOR, ui.BAD, verdicts.ROUTE_WARM_ROUNDS,
     "Warm rounds are faster than round 1: the history is reused.",
     f"Median time to first token of rounds 2+ over round 1's, {LAST_RUN}."),
    ("Affinity efficiency", panel_queries.AFFINITY_EFFICIENCY, ui.RATIO, ui.GOOD, None,
     f"No alert judges it: a trend to read beside the stickiness, over {RATE_WINDOW}.",
     "Cached tokens the engine reported in rounds 2+ over what a perfectly pinned replica would have "
     f"cached, over {RATE_WINDOW}."),
    ("Real sessions on several replicas", queries.GATEWAY_SPREAD, ui.RATIO, ui.BAD, verdicts.LISTENER_SPREAD,
     "Real sessions stay on their replica.",
     "Of the real sessions that came back within the gateway log's spread window, the share served by "
     "more than one replica with no failover to explain it, as the alert judges it."),
    ("Moved by a failover", panel_queries.REAL_SESSIONS_SPREAD, ui.RATIO, ui.NEUTRAL, None,
     "No alert judges it: a failed replica moves its sessions legitimately.",
     "Of the same sessions, the share that a failed replica moved to another one: kept apart from the "
     "above."),
))  # fmt: skip
(
    CLUSTER_HIT_RATIO,
    LOCAL_HIT_RATIO,
    STICKY,
    REUSED_SESSIONS,
    WARM_REUSE,
    WARM_COLD,
    AFFINITY_EFFICIENCY,
    SPREAD,
    MOVED_BY_FAILOVER,
) = SHOWN
# kvwatch's own share of the prompt tokens, and the hit ratio of everything else, beside the cluster's.
OWN_SHARE = tuple(Shown(*row) for row in (
    ("Real traffic's hit ratio", queries.CLUSTER_REAL_HIT_RATIO, ui.RATIO, ui.GOOD, None,
     "No alert judges it: the cluster's hit ratio with kvwatch's probes left out.",
     "Prompt tokens served from cached KV over all prompt tokens, of everything but kvwatch's own probes: "
     "the engines' counts less what the engines counted for the probes (their usage), over "
     f"{queries.WINDOW}."),
    ("Probes' share of prompt tokens", queries.CLUSTER_PROBE_SHARE, ui.RATIO, ui.BAD,
     verdicts.PROBES_DOMINATE,
     "The probes are a minority of the prompt tokens: the cluster's hit ratio describes its users.",
     "Prompt tokens the engines counted for kvwatch's probe requests over all the prompt tokens they "
     f"counted, over {queries.WINDOW}."),
))  # fmt: skip
REAL_HIT_RATIO, PROBE_SHARE = OWN_SHARE
# A probe route's tiles, by what its stickiness is judged by: the replica each round names, or where no
# round names one (SageMaker) each session's warm rounds' reuse, which KVWatchSessionReuseLost watches
# instead, with the warm rounds' tokens beside it. The first is the route's line on the chart.
ROUTE_TILES = {
    "replica": (STICKY, WARM_COLD, AFFINITY_EFFICIENCY),
    "reuse": (REUSED_SESSIONS, WARM_REUSE, WARM_COLD, AFFINITY_EFFICIENCY),
}


def subject(alert: pd.Series) -> str:
    """What a firing alert is about: its route, gateway listener or instance, else the cluster."""
    for labels in (("target",), ("log", "listener"), ("instance",)):
        if all(isinstance(alert.get(label), str) for label in labels):
            return " / ".join(alert[label] for label in labels)
    return "the cluster"


def not_watching(blind: data.Result) -> bool:
    """What kvwatch cannot see and the likely cause, each with its fix; True while it sees everything."""
    if blind.error:
        st.warning(f"Cannot tell what kvwatch sees: {blind.error}", icon=":material/visibility_off:")
        return False
    for link in blind.value:
        if link.status == pipeline.BROKEN:
            words, show = f'**{verdicts.NOT_WATCHING}**: the link "{link.name}" is broken.', st.error
        else:
            words, show = (
                f'Cannot tell whether kvwatch watches: the link "{link.name}" is unknown.',
                st.warning,
            )
        fix = f" Fix: {link.fix}" if link.fix else ""
        show(f"{words} {link.evidence}{fix}", icon=":material/visibility_off:")
    return not blind.value


def clearing(firing: pd.DataFrame, now: pd.DataFrame) -> list[str | None]:
    """For each alert firing at the page's time (ALERTS rows), from `now` (data.firing_alerts): None
    while it fires, when it clears while its keep_firing_for holds it, or that it has cleared since."""
    found = []
    for alert in firing.to_dict("records"):
        labels = {k: v for k, v in alert.items() if k not in ("__name__", "alertname", "alertstate", "value")}
        held = ui.now_firing(now, alert["alertname"], {k: v for k, v in labels.items() if isinstance(v, str)})
        if held is None:
            found.append("cleared since this page's time")
        else:
            found.append(
                None if pd.isna(held["stopped_at"]) else f"clearing at {ui.clock(held['clears_at'])}"
            )
    return found


def banner(firing: pd.DataFrame, now: pd.DataFrame | None, watching: bool) -> None:
    """Every kvwatch alert firing at the page's time, the critical ones first, apart from those whose
    signal is healthy again (with when they clear); or that none is, only while kvwatch sees everything:
    a blind kvwatch fires nothing, and that is no health. `now` (data.firing_alerts) tells held alerts
    apart; None when it could not be read."""
    if firing.empty:
        if watching:
            st.success("No kvwatch alert is firing.", icon=":material/check_circle:")
        return
    clears = [None] * len(firing) if now is None else clearing(firing, now)
    firing = firing.assign(clears=clears)
    still, healed = firing[firing["clears"].isna()], firing[firing["clears"].notna()]
    if not still.empty:
        rank = {severity: i for i, severity in enumerate(SEVERITIES)}
        alerts = sorted(
            (rank.get(a["severity"], len(rank)), a["alertname"], subject(a), a["severity"])
            for _, a in still.iterrows()
        )
        names = "; ".join(f"**{name}** ({severity}) on {about}" for _, name, about, severity in alerts)
        show = st.error if alerts[0][0] == 0 else st.warning
        show(f"Firing now: {names}. See the Alerts page for their runbooks.", icon=":material/notifications:")
    if not healed.empty:
        names = "; ".join(
            f"**{a['alertname']}** on {subject(a)}, {a['clears']}"
            for _, a in healed.sort_values("alertname").iterrows()
        )
        st.info(
            f"Healthy again: {names}. Their signals are fine again; an alert's keep_firing_for holds it "
            "firing a while after, so that a flapping signal does not page twice.",
            icon=":material/published_with_changes:",
        )


class Board:
    """One refresh of the Overview: every number's points over the span, every verdict's states at its end
    and the alerts firing now, in `cluster` (else the picked one)."""

    def __init__(
        self, over: data.Span, shown: tuple[Shown, ...] = (*SHOWN, *OWN_SHARE), cluster: str | None = None
    ):
        self.over = over
        self.results = {s.query: data.series(s.query, over, cluster) for s in shown}
        self.states = {
            s.verdict.state: data.instant(s.verdict.state, over, cluster) for s in shown if s.verdict
        }
        self.paused = {
            s.verdict.paused[0]: data.instant(s.verdict.paused[0], over, cluster)
            for s in shown
            if s.verdict and s.verdict.paused
        }
        self.firing = data.firing_alerts(over.end)

    def failed(self) -> bool:
        return any(ui.failed(result) for result in (*self.results.values(), *self.states.values()))

    def now(self) -> pd.DataFrame | None:
        """The alerts firing now, from Prometheus' rules API; None when that cannot be read (said once,
        under the banner): the verdicts are then the alerts' plain state at the page's time."""
        return None if self.firing.error else data.of_picked_cluster(self.firing.value)

    def points(self, shown: Shown, **labels: str) -> pd.DataFrame:
        return ui.matching(self.results[shown.query].value, **labels)

    def listeners(self, log: GatewayLog) -> list[str]:
        """The listeners of a gateway log that had sessions come back within its spread window."""
        return sorted(set(self.points(SPREAD, log=log.name).get("listener", [])))

    def judged_by(self, target: Target) -> str:
        """What the route's stickiness is judged by, as KVWatchSessionReuseLost tells: "reuse" where
        Prometheus holds the route's sessions judged by reuse over the range, else "replica"."""
        return "reuse" if not self.points(REUSED_SESSIONS, target=target.name).empty else "replica"

    def tile(self, shown: Shown, judged: bool = True, **labels: str) -> None:
        """`shown` as a tile, with its alert's verdict when `judged` (the route or log is meant sticky)."""
        if shown.verdict and judged:
            states = self.states[shown.verdict.state].value
            paused = self.paused[shown.verdict.paused[0]].value if shown.verdict.paused else None
            verdict = ui.judge(shown.verdict, states, shown.says, self.now(), paused, **labels)
        else:
            verdict = ui.Verdict("gray", NOT_STICKY if shown.verdict else shown.says)
        points = self.points(shown, **labels)
        ui.tile(shown.label, points, self.over.end, shown.unit, verdict, shown.help, shown.rise)


def cached_by_source(board: Board, cluster: str | None) -> None:
    """The delivered ratio split by where the cached KV came from, where the engines say, and what the
    engines' own prefix caches found of what they looked up (the local lookup ratio)."""
    shares = data.instant(panel_queries.CLUSTER_CACHED_SHARE_BY_SOURCE, board.over, cluster)
    with st.container(border=True):
        st.markdown("**Cached prompt tokens by source**")
        if ui.failed(shares):
            return
        if shares.value.empty:
            st.caption("No engine exports where its cached tokens came from.")
        for row in shares.value.sort_values("value", ascending=False).itertuples():
            st.markdown(f"{row.source}: {row.value:.0%}")
        if not shares.value.empty:
            st.caption(f"Each source's share of all prompt tokens, over {queries.WINDOW}.")
        local = board.points(LOCAL_HIT_RATIO)
        now = local[local["time"] == pd.Timestamp(board.over.end, unit="s", tz="UTC")]["value"]
        if not now.empty:
            st.markdown(f"Local lookups found {ui.RATIO.value(float(now.iloc[0]))} of what they looked up.")
            st.caption(f"{LOCAL_HIT_RATIO.help} {LOCAL_HIT_RATIO.says}")
        lmcache_tiers(board, cluster)


def lmcache_tiers(board: Board, cluster: str | None) -> None:
    """What LMCache's multi-process server found of the tokens asked of it, per tier, where it says."""
    tiers = data.instant(panel_queries.CLUSTER_LMCACHE_HIT_SHARE_BY_TIER, board.over, cluster)
    if tiers.error or tiers.value.empty:
        return
    found = ", ".join(
        f"{ui.RATIO.value(row.value)} in {row.source.upper()}"
        for row in tiers.value.sort_values("source").itertuples()
    )
    st.markdown(f"LMCache found {found} of the tokens asked of it.")
    st.caption(f"L1: its CPU memory; L2: disk or a remote store; over {queries.WINDOW}.")


def cache_reuse(board: Board, cluster: str | None) -> None:
    """The delivered hit ratio and where the cached KV came from, of `cluster` alone when given."""
    if cluster is not None:
        board = Board(board.over, (CLUSTER_HIT_RATIO, LOCAL_HIT_RATIO, *OWN_SHARE), cluster)
        if board.failed():
            return
        st.subheader(f"Cluster {cluster}")
    hit_ratio, sources, own = st.columns(3)
    with hit_ratio:
        board.tile(CLUSTER_HIT_RATIO)
    with sources:
        cached_by_source(board, cluster)
    with own:
        own_share(board)
    reuse.decomposition(board.over, cluster, board.now())


def own_share(board: Board) -> None:
    """Real traffic's hit ratio and the probes' share of the prompt tokens, where kvwatch's probes are
    counted: the cluster's ratio above is partly theirs."""
    if board.points(PROBE_SHARE).empty:
        return
    board.tile(REAL_HIT_RATIO)
    board.tile(PROBE_SHARE)


def sticky_words(expected: bool) -> str:
    return "expected to keep each session on one replica" if expected else "not expected to be sticky"


def route(board: Board, target: Target, sessions: data.Result) -> None:
    """A probe route's tiles, under what its sessions' stickiness was judged by over the range (from
    the store's `sessions`): the replica each round named, or the warm rounds' reuse."""
    st.subheader(target.name)
    st.caption(
        f"Probe route, {target.route_mode}, {sticky_words(target.expect_sticky)} · {redact(target.base_url)}"
    )
    if not sessions.error and (evidence := ui.stickiness_evidence(sessions.value, target.name)):
        st.caption(f"Since {ui.as_of(board.over.start)}: {evidence}")
    tiles = ROUTE_TILES[board.judged_by(target)]
    for column, shown in zip(st.columns(len(tiles)), tiles, strict=True):
        with column:
            board.tile(shown, target.expect_sticky, target=target.name)
    reuse.probe_decomposition(board.over, target.name)


def gateway_log(board: Board, log: GatewayLog) -> None:
    listeners = board.listeners(log)
    if not listeners:
        ui.empty(f"No session came back through the gateway log {log.name} within its spread window yet.")
    for listener in listeners:
        st.subheader(f"Gateway log {log.name}, listener {listener}")
        st.caption(f"Real traffic, read from {log.path}, {sticky_words(log.expect_sticky)}.")
        spread, moved, _ = st.columns(3)
        with spread:
            board.tile(SPREAD, log.expect_sticky, log=log.name, listener=listener)
        with moved:
            board.tile(MOVED_BY_FAILOVER, log=log.name, listener=listener, failover="true")


def per_cluster(name: str, points: pd.DataFrame, label: str) -> dict[str, pd.DataFrame]:
    """A cluster-wide number's points as one line per cluster where they carry the cluster label."""
    if label not in points or points[label].nunique() < 2:
        return {name: points}
    return {f"{cluster}: {name}": group for cluster, group in points.groupby(label)}


# Each kind of line in its own colour, none of them red or green: those are the verdicts' and marks'.
LINE_COLORS = {"hit ratio": ui.SERIES_COLORS[0], "sticky": ui.SERIES_COLORS[1], "spread": ui.SERIES_COLORS[3]}
DASHES = ("solid", "dash", "dot", "dashdot")


def changes_figure(lines: dict[str, tuple[str, pd.DataFrame]]) -> go.Figure:
    """One line per name, coloured by the kind of number it is (LINE_COLORS), the lines of one kind
    told apart by their dashes."""
    figure = go.Figure()
    dashes: dict[str, itertools.cycle] = {}
    for name, (kind, points) in lines.items():
        dash = next(dashes.setdefault(kind, itertools.cycle(DASHES)))
        figure.add_scatter(
            x=points["time"], y=points["value"], name=name, mode="lines",
            line={"color": LINE_COLORS[kind], "dash": dash},
        )  # fmt: skip
    figure.update_layout(yaxis={"tickformat": ".0%", "range": [0, 1.05]}, margin={"t": 10}, height=340)
    return figure


def changes(board: Board, config: Config) -> None:
    """The numbers the alerts watch over the range on one chart, with the faults and alerts marked."""
    targets, logs = config.targets, config.gateway_logs
    hit_ratio = per_cluster("cluster hit ratio", board.points(CLUSTER_HIT_RATIO), config.cluster_label)
    lines = {name: ("hit ratio", points) for name, points in hit_ratio.items()}
    lines |= {
        f"{t.name}: {shown.label.lower()}": ("sticky", board.points(shown, target=t.name))
        for t in targets
        if t.expect_sticky
        for shown in ROUTE_TILES[board.judged_by(t)][:1]
    }
    lines |= {
        f"{g.name} / {listener}: real sessions spread": (
            "spread", board.points(SPREAD, log=g.name, listener=listener)
        )
        for g in logs
        if g.expect_sticky
        for listener in board.listeners(g)
    }  # fmt: skip
    st.subheader("Over the range")
    st.caption("The lab's faults and the alerts kvwatch's webhook received are marked when they happened.")
    figure = ui.mark(changes_figure(lines), ui.events(board.over))
    st.plotly_chart(figure, key="overview_changes")


@st.fragment(run_every=data.REFRESH_SECONDS)
def overview() -> None:
    top = st.container()  # the banner goes above the time-range picker
    over = data.span(ui.time_range("overview_range"))
    config = data.settings()
    if ui.failed(config):
        return
    firing = data.instant(panel_queries.FIRING_ALERTS_NOW, over)
    board = Board(over)
    if ui.failed(firing) or board.failed():
        return
    with top:
        banner(firing.value, board.now(), not_watching(data.blind_spots()))
        if board.firing.error:
            st.caption(f"Alerts held by their keep_firing_for are not told apart: {board.firing.error}")
    st.caption(f"As of {ui.as_of(over.end)}, from Prometheus at {redact(config.value.prometheus.url)}.")

    targets, logs = config.value.targets, config.value.gateway_logs
    st.header("Do sessions stay on their replica, and what does it cost?")
    if not targets:
        ui.empty(f"No probe targets in {data.config_path()}: add one to see stickiness and warm rounds.")
    sessions = data.sessions(over.start) if targets else data.Result(pd.DataFrame())
    if sessions.error:
        st.caption(f"What each route's stickiness was judged by is not shown: {sessions.error}")
    for target in targets:
        route(board, target, sessions)
    if not logs:
        ui.empty(f"No gateway logs in {data.config_path()}: add one to watch real sessions.")
    for log in logs:
        gateway_log(board, log)

    st.header("Is the KV cache reused?")
    for cluster in data.clusters_apart():
        cache_reuse(board, cluster)
    changes(board, config.value)


st.title("Overview")
overview()
