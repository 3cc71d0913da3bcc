"""Plain upstream headers: nginx's `$upstream_addr` (X-Upstream), Envoy's `%UPSTREAM_REMOTE_ADDRESS%`
added under the same name, and the lab's X-Worker-Id. Also how any header a user names is read."""

from __future__ import annotations

from kvwatch.collectors.identity.base import Convention, plain_name


def read(value: object) -> str | None:
    """After a failover nginx lists every upstream it tried, comma-separated: the last one answered."""
    return plain_name(value.rsplit(",", 1)[-1]) if isinstance(value, str) else plain_name(value)


CONVENTION = Convention(name="headers", read=read, headers=("X-Upstream", "X-Worker-Id"))
