"""The numbers the generated rules, alerts and boards judge by, in one place, and the thresholds file that
overrides them without a fork (`kvwatch generate --config FILE`, docs/alerts.md "Thresholds file").

Every field has today's value as its default, so the committed files are the defaults' output. A file
gives any of them at the top level; an unknown key, a value of the wrong type or a bad duration, number
or label is one `ConfigError` naming the file and the key, as the config's are.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from kvwatch.config.loading import ConfigError, load_yaml
from kvwatch.config.settings import cluster_label_problem
from kvwatch.core.labels import CLUSTER_LABEL

_DURATION = re.compile(r"([0-9]+(ms|s|m|h|d|w|y))+")  # a Prometheus duration, e.g. 90s or 1h30m


@dataclass(frozen=True)
class Thresholds:
    """Every alert threshold and window, and the label that tells clusters apart. Durations are for
    production scrape / evaluation intervals of 15 s and serve's default probe interval of 60 s; the
    lab's --fast mode runs the same rules scaled by 1/10."""

    cluster_label: str = CLUSTER_LABEL  # every rule aggregates by it, every board filters by it
    # Share of a probe run's judged sessions that were sticky: by the replica each round names
    # (KVWatchSessionAffinityBroken), or where none names one by every warm round's reuse (...ReuseLost).
    sticky_ratio_below: float = 0.5
    # ... not judged while an engine of the cluster restarted, went down or came back this recently: the
    # gateway moved its sessions. At least two probe intervals and a run, so that it covers the run in
    # flight and the next one (a failed replica's sessions move back once the gateway retries it).
    replica_change_window: str = "5m"
    echo_ratio_below: float = 0.5  # share of a probe run's sessions whose id the gateway echoed
    keyless_share_above: float = 0.5  # share of gateway requests that arrived without a session key
    keyless_rise_factor: float = 2.0  # ... and at least this many times the share an hour earlier
    keyless_share_window: str = "5m"  # ... both shares rated over this window
    spread_share_above: float = 0.5  # share of returning real sessions moved without a failover
    min_returning_sessions: int = 5  # traffic guard of the spread alert
    spread_for: str = "1m"  # ... held this long
    moved_share_above: float = 0.25  # share of returning real requests moved without a failover, over 1m
    min_returning_requests_per_minute: float = 5.0  # traffic guard of the moved-requests alert
    moved_for: str = "0m"  # ... held this long
    warm_cold_ratio_above: float = 0.8  # warm-round TTFT over round-1 TTFT on a sticky route
    warm_round_for: str = "2m"  # ... held this long
    hit_ratio_floor: float = 0.1
    hit_ratio_drop_factor: float = 0.5  # below half of its own average over the previous hour
    min_prompt_tokens_per_second: float = 50.0  # traffic guard of the hit-ratio alerts
    hit_ratio_drop_for: str = "5m"  # ... held this long
    router_predicted_above: float = 0.5  # a router's mean predicted hit ratio
    delivered_per_predicted_below: float = 0.5  # ... of which the engines deliver less than this share
    min_router_predictions_per_second: float = 0.1  # traffic guard of the prediction alert
    prediction_miss_for: str = "5m"  # ... held this long
    routing_loss_above: float = 0.2  # share of a router's prompt tokens held elsewhere than sent
    engine_loss_above: float = 0.2  # share of a router's prompt tokens it predicted cached, not reused
    min_router_prompt_tokens_per_second: float = 50.0  # traffic guard of the reuse-loss alerts
    reuse_loss_for: str = "5m"  # ... held this long
    session_table_full_for: str = "2m"  # a router's session table refusing new sessions this long
    session_invalidated_share_above: float = 0.1  # bound sessions dropped per minute by pod loss or errors
    min_session_invalidations_per_minute: float = 1.0  # traffic guard of the invalidation-surge alert
    session_invalidations_for: str = "5m"  # ... held this long
    kv_event_lag_above: float = 5.0  # seconds a router's KV-event index trails the engines' events
    index_stalled_for: str = "2m"  # ... or gaps / degraded ranks, held this long
    probe_stale_intervals: float = 3.0
    probe_share_above: float = 0.5  # kvwatch's probes' share of the cluster's prompt tokens
    probe_share_for: str = "10m"  # ... held this long
    source_silent_seconds: float = 600.0  # a syslog or OTLP gateway log that received nothing this long
    load_imbalance_above: float = 2.0  # busiest instance over the mean
    load_imbalance_for: str = "15m"  # ... held this long
    # Whether the alerts hold a cleared condition with `keep_firing_for` (Prometheus 2.42+, vmalert
    # 1.92+): false writes them without the field, for a rule engine that refuses the whole file over it.
    keep_firing_for: bool = True

    def problem(self) -> str | None:
        """The first value no rule can use, as `key: what is wrong`; None when every one is usable."""
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool):
                continue  # the loader already checked that it is true or false
            if field.name == "cluster_label":
                wrong = cluster_label_problem(value)
            elif isinstance(value, str):
                wrong = None if _DURATION.fullmatch(value) else f"expected a duration such as 5m, got {value}"
            else:
                wrong = None if value >= 0 else f"must be 0 or more, got {value:g}"
            if wrong:
                return f"{field.name}: {wrong}"
        return None


THRESHOLDS = Thresholds()


def load_thresholds(path: str | os.PathLike) -> Thresholds:
    """Read and check a thresholds file; any problem is one `ConfigError` naming the file."""
    thresholds = load_yaml(Thresholds, path)
    if wrong := thresholds.problem():
        raise ConfigError(f"error in {path}: {wrong}")
    return thresholds
