"""The recording rules, and the rule files they and the alerts are written to.

prometheus/rules/, alerts/kvwatch.rules.yml and deploy/k8s/prometheusrule.yaml are generated from
`rule_files()` (cli/generate.py, above both these rules and the alerts) by `kvwatch generate` (`make
generate`; a test fails when the committed files are stale). The expressions and series names come from
prometheus/queries.py. Rules are `level:metric:operations`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import yaml

from kvwatch.prometheus.queries import (
    AIBRIX_DECISIONS,
    AIBRIX_ERRORS,
    AIBRIX_LOAD_IMBALANCE,
    AIBRIX_SELECTIONS,
    CACHED_BY_SOURCE,
    CLUSTER_ENGINES_CHANGED,
    CLUSTER_HIT_RATIO,
    CLUSTER_LOAD_IMBALANCE,
    CLUSTER_PROBE_SHARE,
    CLUSTER_REAL_HIT_RATIO,
    CLUSTER_ROUTER_REUSE_LOSS,
    CLUSTER_ROUTER_REUSE_SHARE,
    DELIVERED,
    ENGINE_CACHE_SERIES,
    ENGINE_TTFT,
    FINISHED_REQUESTS,
    GATEWAY_MOVED_SHARE,
    GATEWAY_RETURNING_REQUESTS,
    GATEWAY_SPREAD_SHARE,
    INSTANCE_CACHE_SERIES,
    INSTANCE_CACHED_BY_SOURCE,
    INSTANCE_LMCACHE_HITS_BY_TIER,
    INSTANCE_REQUEST_SHARE,
    INSTANCE_REQUESTS,
    INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
    INSTANCE_ROUTER_FALLBACKS,
    INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS,
    INSTANCE_ROUTER_KV_EVENT_GAPS,
    INSTANCE_ROUTER_KV_EVENT_LAG,
    INSTANCE_ROUTER_KV_EVENT_RESYNCS,
    INSTANCE_ROUTER_PIN_KEPT,
    INSTANCE_ROUTER_PREDICTED_HIT_RATIO,
    INSTANCE_ROUTER_PREDICTIONS,
    INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS,
    INSTANCE_ROUTER_REUSE_LOSS,
    INSTANCE_ROUTER_REUSE_SHARE,
    INSTANCE_ROUTER_REUSE_TOKENS,
    INSTANCE_ROUTER_SESSION_BIND_REJECTIONS,
    INSTANCE_ROUTER_SESSION_BINDINGS,
    INSTANCE_ROUTER_SESSION_INVALIDATIONS,
    INSTANCE_TTFT,
    KV_EVENT_DEGRADED_RANKS,
    KV_EVENT_GAPS,
    KV_EVENT_LAG,
    KV_EVENT_RESYNCS,
    LMCACHE,
    LMCACHE_HITS_BY_TIER,
    LOCAL,
    MOVED_WINDOW,
    PREFIX_MATCH_DECISIONS,
    PROBE_ENGINE_CACHED_TOKENS,
    PROBE_ENGINE_PROMPT_TOKENS,
    QUANTILES,
    REUSE_LEG_NAMES,
    REUSE_LEGS,
    REUSE_LOSSES,
    ROUTE_PROBE_CACHED_TOKENS,
    ROUTE_PROBE_PROMPT_TOKENS,
    ROUTE_PROBE_SHARE,
    ROUTER_PREDICTED_HIT_RATIOS,
    SESSION_BIND_REJECTIONS,
    SESSION_BINDINGS,
    SESSION_INVALIDATIONS,
    SMG_BRANCHES,
    TTFT_BUCKETS,
    WINDOW,
    Grouping,
    TokenRatio,
    cluster_engine_tokens,
    engines_changed,
    first_of,
)
from kvwatch.prometheus.thresholds import THRESHOLDS, Thresholds


class RuleEntry(Protocol):
    """What a rule file holds: a recording rule (`Rule`) or an alert (alerts/alerts.py)."""

    def entry(self) -> dict: ...


@dataclass(frozen=True)
class Rule:
    record: str
    expr: str
    labels: dict[str, str] | None = None

    def entry(self) -> dict:
        entry = {"record": self.record, "expr": rule_expr(self.expr)}
        if self.labels:
            entry["labels"] = self.labels
        return entry


def token_ratio_rules(ratio: TokenRatio, by: Grouping) -> tuple[Rule, ...]:
    """A token-weighted ratio's rules: its rates and its ratio per instance, its ratio per cluster."""
    total, hits, cluster = ratio.instance_total, ratio.instance_hits, by.keeping()
    hit_rate = first_of(*ratio.hit_counters, by=by.instance)
    if ratio.zero_hits_until_created:
        hit_rate += f"\n  or 0 * {first_of(ratio.zero_hits_until_created, by=by.instance)}"
    instance_ratio = f"{hits} / ({total} > 0)"
    if ratio.gauge:
        instance_ratio += f"\n  or max by ({by.instance}) ({ratio.gauge} >= 0)"
    return (
        Rule(total, first_of(*ratio.total_counters, by=by.instance)),
        # min(hit rate, total rate), on instances that have both
        Rule(hits, f"{total} - clamp_min({total} - (\n  {hit_rate}\n), 0)"),
        Rule(ratio.instance_ratio, instance_ratio),
        Rule(
            ratio.cluster_ratio,
            f"sum by ({cluster}) ({hits}) / (sum by ({cluster}) ({total} and {hits}) > 0)",
        ),
    )


def _ttft_buckets(by: str) -> str:
    parts = [f"sum by ({by}, le) (rate({name}[{WINDOW}]))" for name in TTFT_BUCKETS]
    return "\n  or ".join(parts)


def _engine_ttft_buckets(by: Grouping) -> str:
    """TTFT bucket rates summed per engine family, over the bounds every instance of the family in the
    cluster has.

    vLLM and SGLang buckets differ, and so do two vLLM instances' when one sets its own
    (--custom-histogram-buckets): a bound that only some instances have would mix counts of different
    ranges, so only the shared bounds (always at least +Inf) are summed. Exact, only coarser.
    """

    cluster, cluster_le = by.keeping(), by.keeping("le")

    def shared_bounds(name: str) -> str:
        buckets = f"sum by ({by.instance}, le) (rate({name}[{WINDOW}]))"
        instances = f"count by ({cluster}) (count by ({by.instance}) ({buckets}))"
        everywhere = f"count by ({cluster_le}) ({buckets}) == on({cluster}) group_left() {instances}"
        shared = f"sum by ({cluster_le}) ({buckets} and on({cluster_le}) ({everywhere}))"
        return f'label_replace({shared}, "engine", "{name.split(":")[0]}", "", "")'

    return "\n  or ".join(map(shared_bounds, TTFT_BUCKETS))


def _cached_by_source(instance: str) -> str:
    """Each instance's cached-token rate per source, from its engine's finest split only."""

    def by_source(selector: str, label: str, regex: str) -> str:
        rate = f"rate({selector}[{WINDOW}])"
        if label != "source":
            rate = f'label_replace({rate}, "source", "$1", "{label}", "{regex}")'
        return f"sum by ({instance}, source) ({rate})"

    return f"\n  or on({instance}) ".join(by_source(*split) for split in CACHED_BY_SOURCE)


def _lmcache_tiers(instance: str) -> str:
    """Each instance's LMCache hit-token rate per tier, as `source`."""
    return "\n  or ".join(
        f'sum by ({instance}, source) (label_replace(rate({counter}[{WINDOW}]), "source", "{tier}", "", ""))'
        for counter, tier in LMCACHE_HITS_BY_TIER
    )


def recording_rules(by: Grouping, t: Thresholds = THRESHOLDS) -> tuple[Rule, ...]:
    instance, cluster, requests = by.instance, by.keeping(), INSTANCE_REQUESTS
    return (
        *token_ratio_rules(DELIVERED, by),
        *token_ratio_rules(LOCAL, by),
        *token_ratio_rules(LMCACHE, by),
        Rule(INSTANCE_LMCACHE_HITS_BY_TIER, _lmcache_tiers(instance)),
        Rule(INSTANCE_CACHED_BY_SOURCE, _cached_by_source(instance)),
        *(
            Rule(INSTANCE_TTFT, f"histogram_quantile({q}, {_ttft_buckets(instance)})", {"quantile": q})
            for q in QUANTILES
        ),
        *(
            Rule(ENGINE_TTFT, f"histogram_quantile({q}, {_engine_ttft_buckets(by)})", {"quantile": q})
            for q in QUANTILES
        ),
        Rule(requests, first_of(*FINISHED_REQUESTS, by=instance)),
        Rule(
            INSTANCE_REQUEST_SHARE,
            f"{requests}\n  / on({cluster}) group_left() (sum by ({cluster}) ({requests}) > 0)",
        ),
        Rule(
            CLUSTER_LOAD_IMBALANCE,
            f"max by ({cluster}) ({requests}) / (avg by ({cluster}) ({requests}) > 0)",
        ),
        Rule(
            INSTANCE_CACHE_SERIES,
            f"group by ({instance}, series) ("
            + 'label_replace({__name__=~"'
            + "|".join(ENGINE_CACHE_SERIES)
            + '"}, "series", "$1", "__name__", "(.+)"))',
        ),
        Rule(CLUSTER_ENGINES_CHANGED, engines_changed(by, t.replica_change_window)),
    )


RECORDING_RULES = recording_rules(Grouping())


# Real users' sessions, from the gateway access logs (collectors/gatewaylogs/tally.py): of the sessions
# that came back within the spread window, the share served by more than one upstream, by whether a
# failover moved them; and of the requests that came back over the last minute, the share served by
# another upstream than their session's previous request, by whether a failover explains it.
def gateway_rules(by: Grouping) -> tuple[Rule, ...]:
    listener = by.listener
    returning = f"sum by ({listener}) (rate(kvwatch_gateway_returning_requests_total[{MOVED_WINDOW}]))"
    return (
        Rule(
            GATEWAY_SPREAD_SHARE,
            f"sum by ({listener}, failover) (kvwatch_gateway_session_spread_sessions)\n"
            f"  / on({listener}) group_left()\n"
            f"  (sum by ({listener}) (kvwatch_gateway_returning_sessions) > 0)",
        ),
        Rule(GATEWAY_RETURNING_REQUESTS, returning),
        Rule(
            GATEWAY_MOVED_SHARE,
            f"sum by ({listener}, failover) (rate(kvwatch_gateway_moved_requests_total[{MOVED_WINDOW}]))\n"
            f"  / on({listener}) group_left()\n"
            f"  ({returning} > 0)",
        ),
    )


GATEWAY_RULES = gateway_rules(Grouping())


def _share_of(part: str, rest: str, instance: str) -> str:
    """Per instance, the rate of `part` over that of `part` and `rest` together. Routers create a counter
    on its first event, so a missing side counts 0; without traffic on either there is no sample."""
    part_rate, rest_rate = first_of(part, by=instance), first_of(rest, by=instance)
    part_or_0 = f"({part_rate}\n  or 0 * {rest_rate})"
    return f"{part_or_0}\n  / ({part_or_0}\n  + ({rest_rate}\n  or 0 * {part_rate}) > 0)"


def router_rules(by: Grouping) -> tuple[Rule, ...]:
    instance = by.instance
    predictions, predicted_sums = (
        first_of(*(f"{name}_{part}" for name in ROUTER_PREDICTED_HIT_RATIOS), by=instance)
        for part in ("count", "sum")
    )
    return (
        Rule(
            INSTANCE_ROUTER_PIN_KEPT,
            _share_of(
                f'{SMG_BRANCHES}{{branch="occupied_hit"}}',
                f'{SMG_BRANCHES}{{branch="occupied_miss"}}',
                instance,
            ),
        ),
        Rule(
            INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS,
            "\nor ".join(_share_of(*pair, instance) for pair in (AIBRIX_SELECTIONS, *PREFIX_MATCH_DECISIONS)),
        ),
        _fallbacks(by),
        # A mean of per-request ratios only where the router exports no token-weighted prediction.
        Rule(
            INSTANCE_ROUTER_PREDICTIONS,
            f"({predictions})\nunless on({instance}) ({_leg_rate('routed', instance)})",
        ),
        Rule(
            INSTANCE_ROUTER_PREDICTED_HIT_RATIO,
            f"({predicted_sums})\n  / ({INSTANCE_ROUTER_PREDICTIONS} > 0)",
        ),
        Rule(
            INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
            f"{CLUSTER_HIT_RATIO}\n  / on({by.keeping()}) group_right()"
            f" ({INSTANCE_ROUTER_PREDICTED_HIT_RATIO} > 0)",
        ),
        *reuse_rules(by),
        *router_state_rules(by),
    )


def _fallbacks(by: Grouping) -> Rule:
    """AIBrix's routing attempts its index did not decide (a load imbalance, an error by its reason), per
    decision it routed."""
    instance = by.instance
    imbalanced = (
        f'label_replace({first_of(*AIBRIX_LOAD_IMBALANCE, by=instance)}, "reason", "load_imbalance", "", "")'
    )
    errors = f'label_replace(rate({AIBRIX_ERRORS}[{WINDOW}]), "reason", "error:$1", "reason", "(.+)")'
    return Rule(
        INSTANCE_ROUTER_FALLBACKS,
        f"({imbalanced}\n  or sum by ({by.keeping('job, instance, reason')}) ({errors}))\n"
        f"  / on({instance}) group_left() ({first_of(AIBRIX_DECISIONS, by=instance)} > 0)",
    )


def _leg_rate(leg: str, instance: str) -> str:
    return first_of(*(getattr(legs, leg) for legs in REUSE_LEGS), by=instance)


def _token_share(part: str, whole: str, instance: str) -> str:
    return f"{first_of(part, by=instance)}\n  / ({first_of(whole, by=instance)} > 0)"


def _delivered_share(instance: str) -> str:
    """Each router's delivered share of what its engines were sent; where the router's reuse counter has
    never moved from the zero it is exported at, its stand-in's share (ReuseLegs.until_reported)."""
    shares = []
    for legs in REUSE_LEGS:
        share = _token_share(legs.delivered, legs.delivered_of, instance)
        if legs.until_reported is None:
            shares.append(share)
            continue
        reported = f"({share})\n  and on({instance}) (sum by ({instance}) ({legs.delivered}) > 0)"
        shares += [reported, _token_share(*legs.until_reported, instance)]
    return "\n  or ".join(f"({share})" for share in shares)


def _losses(share: str, record: str, by: str) -> tuple[Rule, ...]:
    """Each named loss of a decomposition's shares: the leg above it minus the one below it."""

    def leg(name: str | None) -> str:
        return "1" if name is None else f'sum by ({by}) ({share}{{leg="{name}"}})'

    return tuple(
        Rule(record, f"{leg(above)} - {leg(below)}", {"loss": loss})
        for loss, (above, below) in REUSE_LOSSES.items()
    )


def reuse_rules(by: Grouping) -> tuple[Rule, ...]:
    """The reuse decomposition of routers that export its legs: each leg's token rate (the delivered one
    as the engines' reused share of the router's prompt tokens), its share of the prompt per router and
    per cluster, and the losses between the legs."""
    instance, cluster, tokens = by.instance, by.keeping(), INSTANCE_ROUTER_REUSE_TOKENS
    delivered_share = _delivered_share(instance)
    prompt = f'{tokens}{{leg="prompt"}}'
    legs = (
        Rule(tokens, _leg_rate("prompt", instance), {"leg": "prompt"}),
        Rule(tokens, _leg_rate("available", instance), {"leg": "available"}),
        Rule(tokens, _leg_rate("routed", instance), {"leg": "routed"}),
        Rule(tokens, f"({delivered_share})\n  * on({instance}) {prompt}", {"leg": "delivered"}),
    )
    shares = f'{tokens}{{leg=~"{"|".join(REUSE_LEG_NAMES)}"}}'
    return (
        *legs,
        Rule(INSTANCE_ROUTER_REUSE_SHARE, f"{shares}\n  / on({instance}) group_left() ({prompt} > 0)"),
        Rule(
            CLUSTER_ROUTER_REUSE_SHARE,
            f"sum by ({by.keeping('leg')}) ({shares})\n"
            f"  / on({cluster}) group_left() (sum by ({cluster}) ({prompt}) > 0)",
        ),
        *_losses(INSTANCE_ROUTER_REUSE_SHARE, INSTANCE_ROUTER_REUSE_LOSS, instance),
        *_losses(CLUSTER_ROUTER_REUSE_SHARE, CLUSTER_ROUTER_REUSE_LOSS, cluster),
    )


def router_state_rules(by: Grouping) -> tuple[Rule, ...]:
    """Routers' session tables and KV-event index health, per instance (router_state in collectors)."""
    instance = by.instance
    return (
        Rule(INSTANCE_ROUTER_SESSION_BINDINGS, f"sum by ({instance}) ({SESSION_BINDINGS})"),
        Rule(INSTANCE_ROUTER_SESSION_BIND_REJECTIONS, first_of(SESSION_BIND_REJECTIONS, by=instance)),
        Rule(
            INSTANCE_ROUTER_SESSION_INVALIDATIONS,
            first_of(SESSION_INVALIDATIONS, by=by.keeping("job, instance, reason")),
        ),
        Rule(INSTANCE_ROUTER_KV_EVENT_LAG, f"max by ({instance}) ({KV_EVENT_LAG})"),
        Rule(INSTANCE_ROUTER_KV_EVENT_GAPS, first_of(KV_EVENT_GAPS, by=instance)),
        Rule(INSTANCE_ROUTER_KV_EVENT_RESYNCS, first_of(KV_EVENT_RESYNCS, by=instance)),
        Rule(INSTANCE_ROUTER_KV_EVENT_DEGRADED_RANKS, f"sum by ({instance}) ({KV_EVENT_DEGRADED_RANKS})"),
    )


ROUTER_RULES = router_rules(Grouping())


def probe_share_rules(by: Grouping) -> tuple[Rule, ...]:
    """kvwatch's probes' share of the engines' prompt tokens, per route and per cluster, and the delivered
    ratio of everything else (real traffic): the engines' cached and prompt tokens less the probes'."""
    cluster, route = by.keeping(), by.route
    engine_prompt, engine_cached = cluster_engine_tokens(by)
    probe_prompt, probe_cached = (
        f"sum by ({cluster}) ({series})" for series in (ROUTE_PROBE_PROMPT_TOKENS, ROUTE_PROBE_CACHED_TOKENS)
    )
    return (
        Rule(ROUTE_PROBE_PROMPT_TOKENS, f"sum by ({route}) (rate({PROBE_ENGINE_PROMPT_TOKENS}[{WINDOW}]))"),
        Rule(ROUTE_PROBE_CACHED_TOKENS, f"sum by ({route}) (rate({PROBE_ENGINE_CACHED_TOKENS}[{WINDOW}]))"),
        Rule(
            ROUTE_PROBE_SHARE,
            f"{ROUTE_PROBE_PROMPT_TOKENS}\n  / on({cluster}) group_left() ({engine_prompt} > 0)",
        ),
        Rule(CLUSTER_PROBE_SHARE, f"{probe_prompt}\n  / on({cluster}) ({engine_prompt} > 0)"),
        Rule(
            CLUSTER_REAL_HIT_RATIO,
            f"clamp_min({engine_cached}\n  - on({cluster}) {probe_cached}, 0)\n"
            f"  / on({cluster}) (clamp_min({engine_prompt}\n  - on({cluster}) {probe_prompt}, 0) > 0)",
        ),
    )


PROBE_SHARE_RULES = probe_share_rules(Grouping())
# The rules that rate over the fixed WINDOW: a panel reading one does not follow the time range. (The
# engines' changes are looked for over the thresholds' replica_change_window instead.)
WINDOWED_RULES = tuple(
    rule
    for rule in (*RECORDING_RULES, *ROUTER_RULES, *PROBE_SHARE_RULES)
    if rule.record != CLUSTER_ENGINES_CHANGED
)


# Each rule group kvwatch generates, and the file that holds it: what the generator writes and what the
# pipeline check looks for in Prometheus.
RULE_GROUPS = {
    "kvwatch-engines": "prometheus/rules/kvwatch-engines.yml",
    "kvwatch-gateway": "prometheus/rules/kvwatch-gateway.yml",
    "kvwatch-routers": "prometheus/rules/kvwatch-routers.yml",
    "kvwatch-probe-share": "prometheus/rules/kvwatch-probe-share.yml",
    "kvwatch-alerts": "alerts/kvwatch.rules.yml",
}

HEADER = "# Generated by `kvwatch generate` (prometheus/rules.py, alerts/alerts.py); do not edit.\n"


class _Dumper(yaml.SafeDumper):
    """Multi-line PromQL as YAML block scalars, so the rule files stay readable."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def rule_expr(expr: str) -> str:
    """A rule's expression as its file holds it: a multi-line one ends with a newline."""
    return expr + "\n" if "\n" in expr else expr


def rule_file(group: str, rules: tuple[RuleEntry, ...]) -> str:
    entries = [rule.entry() for rule in rules]
    document = {"groups": [{"name": group, "rules": entries}]}
    return HEADER + yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=1000)


def prometheus_rule(files: dict[str, tuple[str, tuple]]) -> str:
    """Every rule group as one Kubernetes PrometheusRule (prometheus-operator), from the same source."""
    groups = [yaml.safe_load(rule_file(group, rules))["groups"][0] for group, rules in files.values()]
    document = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "kvwatch",
            "labels": {"app.kubernetes.io/name": "kvwatch", "role": "alert-rules"},
        },
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=1000)
