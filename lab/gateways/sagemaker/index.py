"""The SageMaker front's stand-in for a router's KV-event index health, under SMG's names
(`smg_kv_event_lag_seconds`, `_gaps_total`, `_resyncs_total`, `_degraded_ranks`), per instance. The front
routes by sessions and strategies and keeps no real index: it follows its instances' events in lockstep
(lag 0), until the lab's `stall-index` fault stalls it: then every instance's lag grows with the time
since, each request it routes misses its events (a gap), each instance has a degraded rank; the heal
resyncs it. What kvwatch's rules and KVWatchRouterIndexStalled read, with a known truth."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

STALL_INDEX = "stall-index"  # the lab fault (a front fault: the front's config carries it)


@dataclass
class IndexHealth:
    clock: Callable[[], float] = time.monotonic
    stalled_since: float | None = None
    gaps: int = 0
    resyncs: int = 0

    def follow(self, faults: Iterable[str]) -> None:
        """Stall when the fault appears, resync when it goes."""
        stalled = STALL_INDEX in faults
        if stalled and self.stalled_since is None:
            self.stalled_since = self.clock()
        elif not stalled and self.stalled_since is not None:
            self.stalled_since, self.resyncs = None, self.resyncs + 1

    def routed(self) -> None:
        """A request routed while stalled: the events it caused never reach the index."""
        if self.stalled_since is not None:
            self.gaps += 1

    def exposition(self, instances: Iterable[str]) -> str:
        lag = 0.0 if self.stalled_since is None else self.clock() - self.stalled_since
        degraded = int(self.stalled_since is not None)
        ids = list(instances)
        lines = [
            "# HELP smg_kv_event_lag_seconds How far the index trails the instance's KV events.",
            "# TYPE smg_kv_event_lag_seconds gauge",
            *(f'smg_kv_event_lag_seconds{{worker="{i}"}} {lag:.3f}' for i in ids),
            "# HELP smg_kv_event_degraded_ranks Ranks whose KV events the index cannot trust.",
            "# TYPE smg_kv_event_degraded_ranks gauge",
            *(f'smg_kv_event_degraded_ranks{{worker="{i}"}} {degraded}' for i in ids),
            "# HELP smg_kv_event_gaps_total KV event batches the index missed.",
            "# TYPE smg_kv_event_gaps_total counter",
            f'smg_kv_event_gaps_total{{outcome="missed"}} {self.gaps}',
            "# HELP smg_kv_event_resyncs_total Index rebuilds from a snapshot.",
            "# TYPE smg_kv_event_resyncs_total counter",
            f'smg_kv_event_resyncs_total{{reason="gap"}} {self.resyncs}',
        ]
        return "\n".join(lines) + "\n"
