"""Replica identity: how a response names the replica that served a probe round, one module per
convention (`headers`, `smg`, `aibrix`, `llm_d`, `dynamo`) behind one interface (`Convention`).

A route's probe looks at a list of response headers, then at a list of stream-chunk fields; the first
that names a replica wins. Each header or field is read by the convention that owns it; one that no
convention owns is read as a plain name. `ROUTERS` are the conventions whose routers name the replica
only when the request asks for it (`--router`, a target's `router:`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvwatch.collectors.identity import aibrix, dynamo, headers, llm_d, smg
from kvwatch.collectors.identity.base import Convention, plain_name
from kvwatch.core.registry import Registry

CONVENTIONS = Registry(
    "identity convention", (module.CONVENTION for module in (headers, smg, aibrix, llm_d, dynamo))
)
# In this order: the lab's gateways' X-Upstream first, as before; a router's own header next.
DEFAULT_HEADERS = tuple(name for c in CONVENTIONS.values() for name in c.headers)
DEFAULT_JSON_PATHS = tuple(path for c in CONVENTIONS.values() for path in c.json_paths)
ROUTERS = Registry("router", (c for c in CONVENTIONS.values() if c.request_extras))
_HEADER_READERS = {name.lower(): c.read for c in CONVENTIONS.values() for name in c.headers}
_JSON_READERS = {path: c.read for c in CONVENTIONS.values() for path in c.json_paths}

__all__ = [
    "CONVENTIONS",
    "DEFAULT_HEADERS",
    "DEFAULT_JSON_PATHS",
    "ROUTERS",
    "Convention",
    "from_chunk",
    "from_headers",
    "request_extras",
]


def request_extras(router: str | None) -> Mapping[str, object]:
    """What a request through `router` must carry to be told its replica; {} for any other route."""
    if router is None:
        return {}
    return ROUTERS.lookup(router).request_extras


def from_headers(names: Iterable[str], response_headers: Mapping[str, str]) -> str | None:
    """The replica named by the first of `names` present in the response headers (case-insensitive)."""
    for name in names:
        value = response_headers.get(name)
        if value and (backend := _HEADER_READERS.get(name.lower(), headers.read)(value)):
            return backend
    return None


def from_chunk(paths: Iterable[str], chunk: object) -> str | None:
    """The replica named by the first of the dotted `paths` present in one streamed JSON chunk."""
    for path in paths:
        value = _lookup(chunk, path)
        if value is not None and (backend := _JSON_READERS.get(path, plain_name)(value)):
            return backend
    return None


def _lookup(chunk: object, path: str) -> object:
    for key in path.split("."):
        if not isinstance(chunk, dict):
            return None
        chunk = chunk.get(key)
    return chunk
