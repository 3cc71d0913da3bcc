"""The databases a store can live in, one module per kind behind `Database`, picked by its location:
a path is an SQLite file (the embedded default), a postgresql:// URL a PostgreSQL database that several
`kvwatch serve` shards write at once."""

from __future__ import annotations

from pathlib import Path

from kvwatch.collectors.stores.base import BUSY_TIMEOUT_SECONDS, Database, StoreError
from kvwatch.collectors.stores.postgres import PostgreSQL
from kvwatch.collectors.stores.sqlite import SQLite

SCHEMES: dict[str, type[Database]] = {"postgresql": PostgreSQL, "postgres": PostgreSQL}
ERRORS = (*SQLite.errors, *PostgreSQL.errors)  # what reading a store may raise past StoreError

__all__ = [
    "BUSY_TIMEOUT_SECONDS",
    "ERRORS",
    "SCHEMES",
    "Database",
    "StoreError",
    "open_database",
    "transient",
]


def scheme_of(location: str | Path) -> str | None:
    """The URL scheme of a location (`postgresql`), or None for a file path."""
    scheme, separator, _ = str(location).partition("://")
    return scheme.lower() if separator else None


def open_database(location: str | Path, readonly: bool, password: str | None = None) -> Database:
    """The database at `location`; StoreError for a URL of a scheme no kvwatch store lives in."""
    scheme = scheme_of(location)
    if scheme is None:
        return SQLite(str(location), readonly)
    if scheme not in SCHEMES:
        known = ", ".join(f"{name}://" for name in SCHEMES)
        raise StoreError(f"unknown store scheme {scheme}://; known: a file path, {known}")
    return SCHEMES[scheme](str(location), readonly, password)


def transient(error: Exception) -> bool:
    """Any database's error that is worth trying again."""
    return any(kind.transient(error) for kind in (SQLite, PostgreSQL))
