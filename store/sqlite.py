"""SQLite, the embedded default: one file, one writing process and any number of readers.

WAL mode lets readers see the last commit while a write is in progress, a busy timeout absorbs the
short moments when SQLite must lock, and the writer retries what takes longer. The writing process
holds an exclusive lock on a file beside the store (`<store>-writer.lock`) for as long as it runs: a
session still in flight when no process holds it was cut short by the writer's death.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvwatch.store import base
from kvwatch.store.base import Database, StoreError

WRITER_LOCK_SUFFIX = "-writer.lock"
# The writer's page cache. It appends sessions and rewrites the one in flight, so the pages it touches
# again are few (each B-tree's root, interior and last pages); SQLite's default of 2 MiB would instead
# fill with the history over hours of probing, a resident set that grows as if it leaked.
WRITER_CACHE_KIB = 128
# SQLite's result codes worth trying again: a lock held elsewhere, a full disk, a failed read or write.
RETRIED = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR})


class SQLite(Database):
    serial = "INTEGER PRIMARY KEY"
    without_rowid = "WITHOUT ROWID"
    errors = (sqlite3.Error,)

    def __init__(self, location: str, readonly: bool, password: str | None = None) -> None:
        super().__init__(location, readonly)
        self.path = Path(location)
        self._writer_lock_path = self.path.with_name(self.path.name + WRITER_LOCK_SUFFIX)
        if readonly and not self.path.is_file():
            raise StoreError(f"no kvwatch store at {self.path}")
        self._writer_lock = None if readonly else self._lock_writer()
        try:
            self._db = self._connect()
        except BaseException as error:
            self._unlock_writer()
            if isinstance(error, sqlite3.Error):
                raise StoreError(f"cannot open the kvwatch store {self.path}: {error}") from None
            raise

    def _lock_writer(self) -> int:
        """The writer's lock, taken before the schema is checked, so that marking the sessions a dead
        writer left in flight never touches those of a live one. A reader checking it holds it for an
        instant: that is waited for, another writer is not."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = os.open(self._writer_lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise StoreError(
                f"cannot open the kvwatch store {self.path}: cannot create {error.filename}: {error.strerror}"
            ) from None
        deadline = time.monotonic() + base.BUSY_TIMEOUT_SECONDS
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return lock
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(lock)
                    raise StoreError(
                        f"another process writes the kvwatch store {self.path} (one kvwatch serve per store)"
                    ) from None
                time.sleep(0.01)

    def _unlock_writer(self) -> None:
        if self._writer_lock is not None:
            os.close(self._writer_lock)  # releases the lock
            self._writer_lock = None

    def _connect(self) -> sqlite3.Connection:
        uri = self.path.resolve().as_uri() + ("?mode=ro" if self.readonly else "")
        # Autocommit (isolation_level=None): every transaction is explicit, see transaction().
        db = sqlite3.connect(
            uri, uri=True, timeout=base.BUSY_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=False
        )
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA foreign_keys = ON")
            if not self.readonly:
                db.execute("PRAGMA journal_mode = WAL")  # kept in the file: readers use it too
                db.execute(f"PRAGMA cache_size = -{WRITER_CACHE_KIB}")  # negative: KiB, not pages
                db.execute(
                    "PRAGMA synchronous = NORMAL"
                )  # safe with WAL: a crash loses at most the last commit
        except BaseException:
            db.close()
            raise
        return db

    def execute(self, sql: str, params: Sequence = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, params)

    def executemany(self, sql: str, rows) -> int:
        return self._db.executemany(sql, rows).rowcount

    @contextmanager
    def transaction(self, write: bool) -> Iterator[None]:
        """BEGIN IMMEDIATE for a write, so it never has to upgrade a read lock and fail with "database
        is locked"."""
        self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield
        except BaseException:
            if self._db.in_transaction:  # SQLite has rolled back already after some errors (a full disk)
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def set_schema_version(self, version: int) -> None:
        self._db.execute(f"PRAGMA user_version = {version}")

    def cut_short(self) -> int:
        """This process holds the writer's lock: every session in flight is a dead writer's."""
        return self._db.execute(
            "UPDATE sessions SET in_flight = 0, interrupted = 1 WHERE in_flight = 1"
        ).rowcount

    def writer_gone(self) -> Callable[[int | None], bool]:
        gone = self._no_writer()
        return lambda writer: gone

    def _no_writer(self) -> bool:
        if self._writer_lock is not None:
            return False
        try:
            lock = os.open(self._writer_lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(lock)
        return True

    def close(self) -> None:
        self._db.close()
        self._unlock_writer()

    @staticmethod
    def transient(error: Exception) -> bool:
        return isinstance(error, sqlite3.OperationalError) and error.sqlite_errorcode & 0xFF in RETRIED
