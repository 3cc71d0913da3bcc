"""How a lab replica runs: `sim` (kvwatch's simulated engine) or `vllm` (the real vLLM, on CPU).

Each kind is one module behind the `ReplicaKind` interface; `REPLICA_KINDS.lookup` finds one by its
`--engine` name.
"""

from __future__ import annotations

from kvwatch.core.registry import Registry
from kvwatch.lab.replicas import sim, vllm
from kvwatch.lab.replicas.base import ReplicaKind

REPLICA_KINDS = Registry("replica kind", (module.KIND for module in (sim, vllm)))

__all__ = ["REPLICA_KINDS", "ReplicaKind"]
