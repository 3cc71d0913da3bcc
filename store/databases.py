"""The databases a store can live in, one module per kind behind `Database`, picked by its location:
a path is an SQLite file (the embedded default), a postgresql:// URL a PostgreSQL database that several
`kvwatch serve` shards write at once. A URL's module is imported when a store first needs it: psycopg
would cost every kvwatch command a third of a second of CPU otherwise."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from kvwatch.store.base import Database, StoreError
from kvwatch.store.sqlite import SQLite

SCHEMES = {"postgresql": "postgres", "postgres": "postgres"}  # a URL's scheme: its module here


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
    return _kind(SCHEMES[scheme])(str(location), readonly, password)


def transient(error: Exception) -> bool:
    """Any database's error that is worth trying again (only a database in use raises one)."""
    loaded = [_kind(module) for module in set(SCHEMES.values()) if f"{__package__}.{module}" in sys.modules]
    return any(kind.transient(error) for kind in (SQLite, *loaded))


def _kind(module: str) -> type[Database]:
    return importlib.import_module(f"{__package__}.{module}").DATABASE


def __getattr__(name: str) -> tuple[type[Exception], ...]:
    """ERRORS: what reading a store of any kind may raise past StoreError (for the dashboard)."""
    if name != "ERRORS":
        raise AttributeError(f"module {__name__} has no attribute {name}")
    return tuple(error for kind in (SQLite, *map(_kind, set(SCHEMES.values()))) for error in kind.errors)
