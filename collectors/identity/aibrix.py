"""AIBrix's gateway plugin: the pod it routed to, in `target-pod`."""

from __future__ import annotations

from kvwatch.collectors.identity.base import Convention, plain_name

CONVENTION = Convention(name="aibrix", read=plain_name, headers=("target-pod",))
