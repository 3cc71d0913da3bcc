"""What the lab's replicas sit behind: `nginx` or `envoy` (as Istio and the Gateway API configure it).

Each kind is one module behind the `Gateway` interface; `GATEWAYS` maps `--gateway` names to them.
"""

from __future__ import annotations

from kvwatch.lab.gateways import envoy, nginx
from kvwatch.lab.gateways.base import Gateway

GATEWAYS: dict[str, Gateway] = {module.GATEWAY.name: module.GATEWAY for module in (nginx, envoy)}

__all__ = ["GATEWAYS", "Gateway"]
