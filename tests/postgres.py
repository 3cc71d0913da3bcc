"""A real PostgreSQL server for the tests: Debian's `postgresql` binaries, initdb into a temporary
directory, listening on 127.0.0.1 at a free port, one per test session, stopped by PID.

PostgreSQL refuses to run as root: under root (CI) the server runs as the unprivileged `postgres` user,
which owns its directory. Clients log in as `kvwatch` with a password (scram-sha-256), which the tests
pass as `kvwatch serve` takes it: from an environment variable or a file, never in the URL.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from conftest import free_port

USER = "kvwatch"
PASSWORD = "kvwatch-test-password"
START_SECONDS = 20.0
STOP_SECONDS = 10.0
LOG_TAIL_LINES = 30
# No Unix socket (TCP on loopback only), and no durability: the server is thrown away after the run.
SETTINGS = ("unix_socket_directories=", "fsync=off", "synchronous_commit=off", "full_page_writes=off")


def postgres_bin() -> Path:
    """The newest installed server's binaries (Debian: /usr/lib/postgresql/<major>/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise RuntimeError("PostgreSQL is not installed: `make test` installs Debian's postgresql package")
    return Path(found[-1]).parent


@dataclass
class PostgresServer:
    port: int
    log: Path
    _names: Iterator[int] = field(default_factory=itertools.count)

    def url(self, schema: str | None = None) -> str:
        options = f"?options=-csearch_path%3D{schema}" if schema else ""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres{options}"

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.url(), password=PASSWORD, autocommit=True, connect_timeout=5)

    def new_database(self) -> str:
        """The URL of an empty database, as a store's first writer finds it: a schema of its own in the
        server's one database (much cheaper than a CREATE DATABASE per test)."""
        name = f"kvwatch_{os.getpid()}_{next(self._names)}"
        with self.connect() as db:
            db.execute(f"CREATE SCHEMA {name}")
        return self.url(name)

    def log_tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-LOG_TAIL_LINES:])


def _as_server_user() -> list[str]:
    """The command prefix that runs the server unprivileged: `postgres` when we are root."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"]


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    binaries = postgres_bin()
    home = Path(tempfile.mkdtemp(prefix="kvwatch-postgres-"))
    data, log = home / "data", home / "postgres.log"
    password_file = home / "password"
    password_file.write_text(PASSWORD)
    if os.geteuid() == 0:
        server = pwd.getpwnam("postgres")
        for path in (home, password_file):
            os.chown(path, server.pw_uid, server.pw_gid)
    process = None
    try:
        initdb = subprocess.run(
            [*_as_server_user(), binaries / "initdb", "-D", data, "-U", USER, "--auth=scram-sha-256",
             f"--pwfile={password_file}", "--no-sync", "--encoding=UTF8", "--locale=C"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if initdb.returncode != 0:
            pytest.fail(
                f"initdb failed ({initdb.returncode}):\n{initdb.stdout[-2000:]}{initdb.stderr[-2000:]}"
            )
        server = PostgresServer(free_port(), log)
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [*_as_server_user(), binaries / "postgres", "-D", data, "-h", "127.0.0.1",
                 "-p", str(server.port), *(part for setting in SETTINGS for part in ("-c", setting))],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        _wait_ready(server, process)
        yield server
    finally:
        if process is not None:
            _stop(process)
        shutil.rmtree(home, ignore_errors=True)


def _wait_ready(server: PostgresServer, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_SECONDS
    while True:
        if process.poll() is not None:
            pytest.fail(f"postgres exited with {process.returncode} at start:\n{server.log_tail()}")
        try:
            server.connect().close()
            return
        except psycopg.OperationalError:
            if time.monotonic() >= deadline:
                _stop(process)
                pytest.fail(
                    f"postgres did not accept connections within {START_SECONDS} s:\n{server.log_tail()}"
                )
            time.sleep(0.05)


def _stop(process: subprocess.Popen) -> None:
    """SIGQUIT: PostgreSQL's immediate shutdown, without the checkpoint a server thrown away needs not."""
    if process.poll() is None:
        process.send_signal(signal.SIGQUIT)
        try:
            process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session", name="postgres")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the whole test run."""
    with running_postgres() as server:
        yield server
