"""The Overview's "Why is reuse low?" section: per router that exports the legs, and for the cluster, the
reuse decomposition of the prompt tokens it routed (available -> routed -> delivered) and the three named
losses, the routing and engine ones with the verdicts of the alerts that watch them; and per probe route,
kvwatch's own sessions' decomposition (ideal -> delivered), which kvwatch knows without any router."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvwatch.alerts.verdicts import ENGINE_LOSS, ROUTING_LOSS
from kvwatch.dashboard import data, ui
from kvwatch.prometheus import panel_queries, queries

LEG_WORDS = {
    "available": "the best replica held",
    "routed": "the chosen replica held",
    "delivered": "the engines reused",
}
LOSS_WORDS = {
    "workload": "workload (held nowhere)",
    "routing": "routing (held elsewhere)",
    "engine": "engine / index (predicted, not reused)",
}
VERDICTS = {"routing": ROUTING_LOSS, "engine": ENGINE_LOSS}
LOSS_OK = {
    "routing": "The router sends requests where their prefix is held.",
    "engine": "The engines reuse what the router predicted.",
}
NO_LEGS = (
    "No router in this Prometheus exports the reuse decomposition's legs: llm-d's EPP exports them from "
    "its prefix plugin (llm_d_epp_prefix_*_cached_tokens), Dynamo's KV router from its cache-reuse funnel "
    "(dynamo_component_router_kv_*_cached_prefix_tokens_total)."
)
HELP = (
    f"Of the prompt tokens each router routed, over {queries.WINDOW}, token-weighted: what the best "
    "replica held when it chose, what the chosen replica held as the router predicted, what the engines "
    "reused. The steps down are the losses: a workload with nothing to reuse, a routing choice that gave "
    "reuse up, an engine (or a stale router index) that did not deliver what was predicted."
)


def _percent(value: float | None) -> str:
    return "n/a" if value is None or pd.isna(value) else f"{value:.0%}"


def _by_router(frame: pd.DataFrame, label: str) -> dict[tuple[str, str], dict[str, float]]:
    found: dict[tuple[str, str], dict[str, float]] = {}
    for row in frame.itertuples(index=False):
        found.setdefault((row.job, row.instance), {})[getattr(row, label)] = row.value
    return found


def _cluster(frame: pd.DataFrame, label: str) -> dict[str, float]:
    return {getattr(row, label): row.value for row in frame.itertuples(index=False)}


def legs_line(shares: dict[str, float]) -> str:
    legs = " → ".join(f"{_percent(shares.get(leg))} {words}" for leg, words in LEG_WORDS.items())
    return f"prompt 100% → {legs}"


def decomposition(over: data.Span, cluster: str | None, firing: pd.DataFrame | None) -> None:
    """The section, of `cluster` alone when given."""
    asked = {
        "shares": data.instant(queries.INSTANCE_ROUTER_REUSE_SHARE, over, cluster),
        "losses": data.instant(queries.INSTANCE_ROUTER_REUSE_LOSS, over, cluster),
        "cluster shares": data.instant(queries.CLUSTER_ROUTER_REUSE_SHARE, over, cluster),
        **{loss: data.instant(verdict.state, over, cluster) for loss, verdict in VERDICTS.items()},
    }
    with st.container(border=True):
        st.markdown("**Why is reuse low? Routers' reuse decomposition**")
        if any(ui.failed(result) for result in asked.values()):
            return
        shares, losses = asked["shares"].value, asked["losses"].value
        if shares.empty:
            st.caption(NO_LEGS)
            return
        st.caption(HELP)
        cluster_shares = _cluster(asked["cluster shares"].value, "leg")
        if cluster_shares:
            st.markdown(f"All routers: {legs_line(cluster_shares)}")
        lost = _by_router(losses, "loss") if not losses.empty else {}
        for (job, instance), legs in sorted(_by_router(shares, "leg").items()):
            st.markdown(f"`{job} / {instance}`: {legs_line(legs)}")
            router_losses = lost.get((job, instance), {})
            st.markdown(
                "Lost: "
                + ", ".join(
                    f"{words} {_percent(router_losses.get(loss))}" for loss, words in LOSS_WORDS.items()
                )
            )
            for loss, verdict in VERDICTS.items():
                said = ui.judge(verdict, asked[loss].value, LOSS_OK[loss], firing, job=job, instance=instance)
                st.markdown(f":{said.color}[{said.text}]")


PROBE_HELP = (
    "kvwatch's own probe sessions through this route, over all their rounds and a window of "
    f"{data.MIN_RATE_WINDOW_SECONDS // 60} minutes or more: of their prompt tokens, what a replica holding "
    "each conversation would have cached (the ideal: the previous round's prompt and answer, which kvwatch "
    "knows) and what the engines reused; the gap was lost to routing or to the engine."
)


def probe_decomposition(over: data.Span, target: str) -> None:
    """The probe sessions' own decomposition of one route, when Prometheus holds their tokens."""
    shares = data.instant(panel_queries.PROBE_REUSE_SHARES, over)
    if shares.error or shares.value.empty:
        return
    legs = {row.leg: row.value for row in ui.matching(shares.value, target=target).itertuples(index=False)}
    if not legs:
        return
    available, delivered = legs.get("available"), legs.get("delivered")
    lost = None if available is None or delivered is None else available - delivered
    st.markdown(
        f"Probe sessions' reuse: prompt 100% → {_percent(available)} a pinned replica would hold → "
        f"{_percent(delivered)} the engines reused (lost {_percent(lost)})"
    )
    st.caption(PROBE_HELP)
