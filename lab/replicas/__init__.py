"""How a lab replica runs: `sim` (kvwatch's simulated engine) or `vllm` (the real vLLM, on CPU).

Each kind is one module behind the `ReplicaKind` interface; `KINDS` maps `--engine` names to them.
"""

from __future__ import annotations

from kvwatch.lab.replicas import sim, vllm
from kvwatch.lab.replicas.base import ReplicaKind

KINDS: dict[str, ReplicaKind] = {module.KIND.name: module.KIND for module in (sim, vllm)}

__all__ = ["KINDS", "ReplicaKind"]
