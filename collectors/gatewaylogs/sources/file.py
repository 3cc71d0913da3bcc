"""The `file` source: the access log a gateway writes on this host, followed by each poll
(collectors/gatewaylogs/follower.py)."""

from __future__ import annotations

from kvwatch.collectors.gatewaylogs.sources.base import Source

SOURCE = Source(name="file", default_port=None, receiver=None)
