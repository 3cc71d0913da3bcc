"""nginx: the session header as a `$http_` variable, hashed by a consistent `upstream` hash."""

from __future__ import annotations

from collections.abc import Mapping

from kvwatch.doctor.affinity.base import Affinity


def variable(header: str) -> str:
    return "$http_" + header.lower().replace("-", "_")


def forward(header: str) -> str:
    return f"`proxy_set_header {header} {variable(header)};` in every proxying location"


def echo(header: str) -> str:
    return f"`add_header {header} {variable(header)} always;`"


def hash_on(header: str) -> str:
    return f"`hash {variable(header)} consistent;` in the upstream (not $request_id, not round robin)"


def recognise(headers: Mapping[str, str]) -> bool:
    return headers.get("server", "").lower().startswith("nginx")


AFFINITY = Affinity("nginx", "nginx", forward, echo, hash_on, recognise)
