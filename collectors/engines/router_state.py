"""What a router keeps besides its routing decisions, normalised across routers: its session table and the
health of its KV-event index.

Session tables: llm-d's session binding tracker (`llm_d_epp_session_control_bindings`, the sessions bound
now; `..._invalidations_total{reason=idle|pod_delete|close|error}`; `..._bind_rejections_total`, new
sessions refused) and `llm_d_epp_session_state_entries`. Dynamo's affinity table (off unless the
frontend runs `--router-session-affinity-ttl-secs`, at most 65,536 sessions, a 503 for a new one when
full) exports no series of its own (none in Dynamo 1.6.1 with the flag on,
tests/testdata/routers/dynamo-1.6.1-frontend-kv-mocker.prom): a full table shows as 503 answers.

KV-event index health: SMG's (`smg_kv_event_lag_seconds`, how far its index trails the engines' events;
`smg_kv_event_gaps_total`, batches the events skipped; `smg_kv_event_resyncs_total`, rebuilds from a
snapshot; `smg_kv_event_degraded_ranks`, ranks whose events it cannot trust). An index that stalls
predicts reuse the engines no longer hold. Counters appear on their first event: absence is no problem.
Every router flavour reads both families, whichever names its exposition carries (the lab's SageMaker
front exports both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar, TypeVar

from kvwatch.collectors.engines.base import Reader

SESSION_BINDINGS = "llm_d_epp_session_control_bindings"
SESSION_INVALIDATIONS = "llm_d_epp_session_control_invalidations_total"
SESSION_BIND_REJECTIONS = "llm_d_epp_session_control_bind_rejections_total"
SESSION_STATE_ENTRIES = "llm_d_epp_session_state_entries"
KV_EVENT_LAG = "smg_kv_event_lag_seconds"
KV_EVENT_GAPS = "smg_kv_event_gaps_total"
KV_EVENT_RESYNCS = "smg_kv_event_resyncs_total"
KV_EVENT_DEGRADED_RANKS = "smg_kv_event_degraded_ranks"


@dataclass(frozen=True)
class SessionTable:
    """A router's session table: sessions bound now (a gauge), invalidations by reason and new sessions
    refused (counters: cumulative in a snapshot, increases in a window)."""

    COUNTERS: ClassVar = ("invalidations", "bind_rejections")

    bindings: float | None
    invalidations: Mapping[str, float] = field(default_factory=dict)
    bind_rejections: float | None = None


@dataclass(frozen=True)
class IndexHealth:
    """A router's KV-event index: its lag behind the engines' events and its degraded ranks (gauges, the
    worst of its ranks / their count), event gaps and resyncs (counters)."""

    COUNTERS: ClassVar = ("gaps", "resyncs")

    lag_seconds: float | None
    gaps: float | None = None
    resyncs: float | None = None
    degraded_ranks: float | None = None


def read_session_table(reader: Reader) -> SessionTable | None:
    """llm-d's session binding tracker, None when the router exports none of it."""
    exposition = reader.exposition
    if not any(map(exposition.has, (SESSION_BINDINGS, SESSION_INVALIDATIONS, SESSION_BIND_REJECTIONS))):
        return None
    return SessionTable(
        bindings=reader.total(SESSION_BINDINGS, SESSION_STATE_ENTRIES, optional=True),
        invalidations=reader.by_label(SESSION_INVALIDATIONS, "reason", optional=True),
        bind_rejections=reader.total(SESSION_BIND_REJECTIONS, optional=True),
    )


def read_index_health(reader: Reader) -> IndexHealth | None:
    """SMG's KV-event index health, None when the router exports none of it (no KV events subscribed)."""
    names = (KV_EVENT_LAG, KV_EVENT_GAPS, KV_EVENT_RESYNCS, KV_EVENT_DEGRADED_RANKS)
    if not any(map(reader.exposition.has, names)):
        return None
    return IndexHealth(
        lag_seconds=reader.maximum(KV_EVENT_LAG, optional=True),
        gaps=reader.total(KV_EVENT_GAPS, optional=True),
        resyncs=reader.total(KV_EVENT_RESYNCS, optional=True),
        degraded_ranks=reader.total(KV_EVENT_DEGRADED_RANKS, optional=True),
    )


# (now, before) -> a counter's increase, as normalise counts it (None when unknown).
Increase = Callable[[float | None, float | None], float | None]
State = TypeVar("State", SessionTable, IndexHealth)


def windowed(now: State | None, before: State | None, increase: Increase) -> State | None:
    """The record over a window: its gauges as they are now, its COUNTERS' increases (a labelled
    counter's per label, the labels whose increase is unknown left out)."""
    if now is None:
        return None
    old = before or type(now)(None)
    counters = {name: _increase(getattr(now, name), getattr(old, name), increase) for name in now.COUNTERS}
    return replace(now, **counters)


def _increase(now: float | Mapping | None, before: float | Mapping | None, increase: Increase):
    if not isinstance(now, Mapping):
        return increase(now, before)
    increases = {label: increase(value, before.get(label)) for label, value in now.items()}
    return {label: n for label, n in increases.items() if n is not None}
