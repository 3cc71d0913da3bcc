"""SMG, the Shepherd Model Gateway (SGLang's router, PyPI `smg` >= 1.x): the worker's URL in a header."""

from __future__ import annotations

from kvwatch.collectors.identity.base import Convention, plain_name

CONVENTION = Convention(name="smg", read=plain_name, headers=("x-smg-routed-worker-id",))
