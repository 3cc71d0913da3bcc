"""AIBrix's gateway plugin (v0.7): its prefix-cache router's decisions.

`aibrix_prefix_cache_routing_decisions_total{match_percent_bucket}` counts routing decisions by how
much of the prompt the router's own prefix index matched on the chosen pod ("0": none), a prediction
in characters, not engine tokens; `..._selection_total{selection}` says how it chose. Newer gateways
(vllm-project/aibrix#2334) count the decisions taken without the index:
`aibrix_prefix_cache_load_imbalance_total`, later `aibrix_load_imbalance_total` (the pods' running
requests too far apart: the choice narrowed to the least loaded pods) and `..._errors_total{reason}`
(routing failed).
No series counts requests per pod (the `target-pod` response header names it per request).
"""

from __future__ import annotations

from kvwatch.collectors.engines.base import Exposition, Flavour, Reader, Snapshot

PREFIX = "aibrix_prefix_cache_routing_"
# The load-imbalance gate's counter as #2334 named it, then once the gate applied to every strategy.
LOAD_IMBALANCE = ("aibrix_prefix_cache_load_imbalance_total", "aibrix_load_imbalance_total")


def detect(exposition: Exposition) -> int:
    return exposition.count_prefixed("aibrix_")


def read(exposition: Exposition, scraped_at: float) -> Snapshot:
    reader = Reader(exposition)
    return Snapshot(
        flavour="aibrix-gateway",
        scraped_at=scraped_at,
        router_cache_predictions=reader.by_label(
            f"{PREFIX}decisions_total", "match_percent_bucket", optional=True
        ),
        policy_decisions=reader.by_label(f"{PREFIX}selection_total", "selection", optional=True),
        router_fallbacks=_fallbacks(reader),
        missing=tuple(reader.missing),
        invalid=dict(reader.invalid),
    )


def _fallbacks(reader: Reader) -> dict[str, float]:
    """The decisions taken without the prefix index: after a load imbalance, or an error by its reason."""
    errors = reader.by_label(f"{PREFIX}errors_total", "reason", optional=True)
    fallbacks = {f"error:{reason}": count for reason, count in errors.items()}
    imbalance = reader.total(*LOAD_IMBALANCE, optional=True)
    return fallbacks | ({"load_imbalance": imbalance} if imbalance is not None else {})


FLAVOUR = Flavour(name="aibrix-gateway", kind="router", detect=detect, read=read)
