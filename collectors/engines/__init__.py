"""Engine and router metrics flavours behind one interface, and the record they normalise to.

Each module reads one dialect of /metrics (engines: `vllm`, `vllm_legacy`, `sglang`; routers:
`smg` (SMG, once sglang-router), `vllm_router`, `llm_d` (EPP), `dynamo`, `aibrix`; KV caches: `lmcache`,
LMCache's multi-process server) into a `Snapshot` of
cumulative values; `normalise` turns one snapshot into lifetime figures or two into windowed ones.
`ENGINE_FLAVOURS.lookup` finds one by name; `detect_flavour` picks the flavour whose series an exposition has.
"""

from __future__ import annotations

from kvwatch.collectors.engines import (
    aibrix,
    dynamo,
    llm_d,
    lmcache,
    sglang,
    smg,
    vllm,
    vllm_legacy,
    vllm_router,
)
from kvwatch.collectors.engines.base import Exposition, Flavour, Snapshot
from kvwatch.collectors.engines.normalise import Normalised, histogram_quantile, normalise
from kvwatch.core.errors import KVWatchError
from kvwatch.core.registry import Registry

ENGINE_FLAVOURS = Registry(
    "engine flavour",
    (
        module.FLAVOUR
        for module in (vllm, vllm_legacy, sglang, smg, vllm_router, llm_d, dynamo, aibrix, lmcache)
    ),
)

__all__ = [
    "ENGINE_FLAVOURS",
    "Exposition",
    "Flavour",
    "Normalised",
    "Snapshot",
    "UnknownFlavour",
    "detect_flavour",
    "histogram_quantile",
    "normalise",
]


class UnknownFlavour(KVWatchError, ValueError):
    """The exposition matches no flavour, or two equally well."""


def detect_flavour(exposition: Exposition) -> Flavour:
    """The flavour with the most of its telltale series in `exposition`."""
    scores = sorted(
        ((flavour.detect(exposition), name) for name, flavour in ENGINE_FLAVOURS.items()), reverse=True
    )
    (best, name), (runner_up, other) = scores[0], scores[1]
    if best == 0:
        raise UnknownFlavour(f"no series of a known engine or router ({', '.join(ENGINE_FLAVOURS)})")
    if best == runner_up:
        raise UnknownFlavour(f"looks as much like {name} as like {other}; name the flavour explicitly")
    return ENGINE_FLAVOURS[name]
