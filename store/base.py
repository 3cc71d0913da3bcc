"""What the store asks of a database: a connection speaking kvwatch's SQL, its schema version, and
whether the writer of a session still runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from kvwatch.core.errors import KVWatchError

BUSY_TIMEOUT_SECONDS = 1.0  # the database's own wait for a lock; StoreWriter retries past it

Row = dict  # a result row by column name (sqlite3.Row and psycopg's dict rows both read so)


class StoreError(KVWatchError):
    """The store cannot be opened: missing (read-only), not a kvwatch store, from a newer kvwatch, or
    written by another process already."""


class Database(ABC):
    """One connection to a store's database. Statements use `?` parameters and SQL both databases take;
    the schema's `{serial}` and `{without_rowid}` are each database's own spelling."""

    serial: str  # an integer primary key the database numbers itself
    without_rowid: str  # a table keyed by its primary key alone, where the database can say so
    errors: tuple[type[Exception], ...]  # what the database's driver raises

    def __init__(self, location: str, readonly: bool) -> None:
        self.location = location  # as messages show it: a path, or a URL without its password
        self.readonly = readonly

    @abstractmethod
    def execute(self, sql: str, params: Sequence = ()) -> Iterable[Row]:
        """Run one statement; its rows, with fetchone(), fetchall() and rowcount."""

    @abstractmethod
    def executemany(self, sql: str, rows: Iterable[Sequence]) -> int:
        """Run one statement per row; how many rows they changed."""

    @abstractmethod
    @contextmanager
    def transaction(self, write: bool) -> Iterator[None]:
        """One transaction; a write takes the database's write lock at once where it has one."""

    @abstractmethod
    def schema_version(self) -> int:
        """The schema the store has; 0 for an empty database."""

    @abstractmethod
    def set_schema_version(self, version: int) -> None: ...

    @abstractmethod
    def cut_short(self) -> int:
        """In a writer's first transaction: mark the sessions in flight whose writer is gone as
        interrupted; how many there were."""

    @abstractmethod
    def writer_gone(self) -> Callable[[int | None], bool]:
        """Whether the writer a session names (its `writer` column) is gone, as of now."""

    @property
    def writer(self) -> int | None:
        """This connection's writer id, stored with each session it writes."""
        return None

    @abstractmethod
    def close(self) -> None: ...

    @staticmethod
    def transient(error: Exception) -> bool:
        """The driver's error is worth trying again (a lock, a full disk, a lost connection)."""
        return False


def first_line(error: Exception) -> str:
    """What a driver's error says, in one line (libpq adds hints on lines of their own)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
