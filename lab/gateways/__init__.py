"""What the lab's replicas sit behind: `nginx`, `envoy` (as Istio and the Gateway API configure it) or
`sagemaker` (Amazon SageMaker's runtime API with stateful sessions).

Each kind is one module behind the `Gateway` interface; `GATEWAYS.lookup` finds one by its `--gateway` name.
"""

from __future__ import annotations

from kvwatch.core.registry import Registry
from kvwatch.lab.gateways import envoy, nginx, sagemaker
from kvwatch.lab.gateways.base import Gateway

GATEWAYS = Registry("gateway", (module.GATEWAY for module in (nginx, envoy, sagemaker)))

__all__ = ["GATEWAYS", "Gateway"]
