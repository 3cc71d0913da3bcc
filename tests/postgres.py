"""A real PostgreSQL server for the tests: Debian's `postgresql` binaries, initdb into a temporary
directory, listening on 127.0.0.1 at a free port, one per test session (and one of its own for a test that
stops it and starts it again), stopped by PID.

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

from processes import free_port

USER = "kvwatch"
PASSWORD = "kvwatch-test-password"
START_SECONDS = 20.0
STOP_SECONDS = 10.0
LOG_TAIL_LINES = 30
# No Unix socket (TCP on loopback only), and no durability against a crash of the machine: the server is
# thrown away after the run. A commit still reaches the kernel before it is acknowledged (synchronous_commit
# stays on, cheap without fsync), so that what a client saw committed outlives stop().
SETTINGS = ("unix_socket_directories=", "fsync=off", "full_page_writes=off")


def postgres_bin() -> Path:
    """The newest installed server's binaries (Debian: /usr/lib/postgresql/<major>/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise RuntimeError("PostgreSQL is not installed: `make test` installs Debian's postgresql package")
    return Path(found[-1]).parent


@dataclass
class PostgresServer:
    port: int
    data: Path
    log: Path
    _process: subprocess.Popen | None = None
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

    def start(self) -> None:
        """Runs the server on its data directory and port; returns once it accepts connections."""
        with open(self.log, "ab") as out:
            self._process = subprocess.Popen(
                [*_as_server_user(), postgres_bin() / "postgres", "-D", self.data, "-h", "127.0.0.1",
                 "-p", str(self.port), *(part for setting in SETTINGS for part in ("-c", setting))],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self._wait_ready()

    def stop(self) -> None:
        """An immediate shutdown (SIGQUIT to the postmaster, by PID): every connection is cut at once, as
        in a crash, and the data directory stays for start() to run on again."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGQUIT)
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def log_tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if self._process.poll() is not None:
                pytest.fail(f"postgres exited with {self._process.returncode} at start:\n{self.log_tail()}")
            try:
                self.connect().close()
                return
            except psycopg.OperationalError:
                if time.monotonic() >= deadline:
                    self.stop()
                    pytest.fail(
                        f"postgres did not accept connections within {START_SECONDS} s:\n{self.log_tail()}"
                    )
                time.sleep(0.05)


def _as_server_user() -> list[str]:
    """The command prefix that runs the server unprivileged: `postgres` when we are root."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"]


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    home = Path(tempfile.mkdtemp(prefix="kvwatch-postgres-"))
    data, log = home / "data", home / "postgres.log"
    password_file = home / "password"
    password_file.write_text(PASSWORD)
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        for path in (home, password_file):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    server = PostgresServer(free_port(), data, log)
    try:
        initdb = subprocess.run(
            [*_as_server_user(), postgres_bin() / "initdb", "-D", data, "-U", USER, "--auth=scram-sha-256",
             f"--pwfile={password_file}", "--no-sync", "--encoding=UTF8", "--locale=C"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if initdb.returncode != 0:
            pytest.fail(
                f"initdb failed ({initdb.returncode}):\n{initdb.stdout[-2000:]}{initdb.stderr[-2000:]}"
            )
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session", name="postgres")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the whole test run."""
    with running_postgres() as server:
        yield server


@pytest.fixture(name="postgres_to_stop")
def own_postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of a test's own, which it may stop() and start() again: an outage."""
    with running_postgres() as server:
        yield server
