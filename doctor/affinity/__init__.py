"""Session affinity as each gateway or router configures it, one module per system (`nginx`, `envoy`
for Envoy and Istio, `smg`, `vllm_router`, `dynamo`) behind one interface (`Affinity`): the doctor's
fixes name the setting of the system in front of the replicas, or of every system when it cannot tell.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvwatch.core.registry import Registry
from kvwatch.doctor.affinity import dynamo, envoy, nginx, smg, vllm_router
from kvwatch.doctor.affinity.base import Affinity

SYSTEMS = Registry("gateway", (module.AFFINITY for module in (nginx, envoy, smg, vllm_router, dynamo)))

__all__ = ["SYSTEMS", "Affinity", "recognised"]


def recognised(headers: Mapping[str, str]) -> Affinity | None:
    """The system whose marks a response's headers carry (names in any case), if exactly one's."""
    lowered = {name.lower(): value for name, value in headers.items()}
    found = [s for s in SYSTEMS.values() if s.recognise and s.recognise(lowered)]
    return found[0] if len(found) == 1 else None
