"""Running and waiting for the processes a test starts, on loopback ports no other test holds, and
asking them over HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvwatch.cli.main import main
from paths import REPO

# One TLS context for the suite's own requests: httpx builds one per call otherwise, loading the CA
# bundle each time (about 50 ms of CPU), and the suite polls labs and Prometheus many times a second.
TLS = httpx.create_ssl_context()


def http_get(url: str, **options) -> httpx.Response:
    return httpx.get(url, verify=TLS, **options)


def http_post(url: str, **options) -> httpx.Response:
    return httpx.post(url, verify=TLS, **options)


def wait_for(condition, what: str, timeout: float = 120.0, every: float = 1.0):
    """Poll until `condition()` returns something truthy, and return it; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(every)
    raise AssertionError(f"{what} within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, process: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    """Wait until `url` answers 200, failing early with the process's log if it died. The deadline is
    generous: a process starts in a second or two, but several minutes of a busy machine's suite slow it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"process exited with {process.returncode} before {url} was up:\n{log.read_text()}"
            )
        try:
            if http_get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def poll(ask: Callable[[], object], what: str, timeout: float, log: Path | None = None) -> object:
    """What `ask` returns once it is truthy; fails naming `what`, with the tail of `log` if given, after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if answer := ask():
            return answer
        time.sleep(0.5)
    tail = f"\n{log.read_text()[-2000:]}" if log else ""
    pytest.fail(f"{what}: not within {timeout} s{tail}")


def launch(argv: list[str], log: Path, ready: str, timeout: float = 20.0, **options) -> subprocess.Popen:
    """`argv` started with its output in `log`, once `ready` (a URL) answers 200 within `timeout`
    seconds; stopped if it never does."""
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **options)
    try:
        wait_http(ready, process, log, timeout)
    except BaseException:
        stop(process)
        raise
    return process


def start_prometheus(directory: Path, port: int) -> tuple[subprocess.Popen, Path]:
    """A real Prometheus of `directory`/prometheus.yml on 127.0.0.1:`port`, its data and its log in
    `directory`, once it is ready: the process and its log."""
    log = directory / "prometheus.log"
    argv = ["prometheus", f"--config.file={directory}/prometheus.yml",
            f"--storage.tsdb.path={directory}/data", f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    return launch(argv, log, f"http://127.0.0.1:{port}/-/ready"), log


def stop(process: subprocess.Popen) -> None:
    """Stop a process we started, by its PID: SIGTERM, then SIGKILL after 10 s."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


PORT_CLAIMS = Path(os.environ.get("TMPDIR", "/tmp")) / "kvwatch-test-port-blocks"


def _claim(base: int) -> bool:
    """Claims a port block for this process, so that a pytest beside it (the other lane) does not pick
    the block while this one's lab is still starting and has bound none of it. A dead process's claim
    is taken over."""
    PORT_CLAIMS.mkdir(exist_ok=True)
    claim = PORT_CLAIMS / str(base)
    with contextlib.suppress(FileNotFoundError):
        owner = claim.read_text()
        if not owner.isdigit() or owner == str(os.getpid()) or Path(f"/proc/{owner}").exists():
            return False  # being written, this process's own, or a live one's
        claim.unlink()
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        file.write(str(os.getpid()))
    return True


def free_base_port(span: int = 20) -> int:
    """A base port whose next `span` ports are all free on 127.0.0.1 (the lab's port block), claimed."""
    rng = random.Random()
    for _ in range(50):
        # Below 32768: above it, Linux hands out ephemeral ports for outgoing connections.
        base = rng.randrange(20000, 32000, 100)
        if not _claim(base):
            continue
        sockets = []
        try:
            for port in range(base, base + span):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free block of ports on 127.0.0.1")


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains `text`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if text in cmdline and state != "Z" and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def kvwatch(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvwatch.cli.main", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def kvwatch_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`kvwatch ARGS` in this process, its output as kvwatch() gives it: for what a command prints, where a
    process of its own (about a second of CPU to import kvwatch) proves nothing more."""
    capsys.readouterr()
    code = main(list(args))
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(["kvwatch", *args], code, printed.out, printed.err)


# A bounded child limits its own address space before it imports kvwatch. Not by a preexec_fn: that runs
# Python in a fork of this process, and the gRPC threads an OTLP test left in it abort such a fork.
_BOUNDED = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"


_KVWATCH = "import sys\nfrom kvwatch.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"


def kvwatch_bounded(*args: str) -> subprocess.CompletedProcess:
    """`kvwatch ARGS` with 60 s and 2 GiB of address space: one that would read a FIFO forever or
    /dev/zero into memory fails its test (a timeout, a MemoryError) instead of the machine."""
    return subprocess.run(
        [sys.executable, "-c", _BOUNDED + _KVWATCH, *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


# Runs each command of argv[1] (a JSON list of argument lists) in turn, each one's stdout and stderr taken at
# the file descriptors (what its logging writes too), and writes [[code, stdout, stderr], ...] to argv[2].
_EACH_IN_TURN = """
import json, os, sys, tempfile
from kvwatch.cli.main import main

results = []
for args in json.loads(sys.argv[1]):
    kept = [os.dup(1), os.dup(2)]
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    for fd, file in zip((1, 2), files):
        os.dup2(file.fileno(), fd)
    try:
        code = main(args)
    except SystemExit as stopped:
        code = stopped.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in zip((1, 2), kept):
            os.dup2(original, fd)
            os.close(original)
    printed = []
    for file in files:
        file.seek(0)
        printed.append(file.read().decode())
        file.close()
    results.append([code, *printed])
with open(sys.argv[2], "w") as written:
    json.dump(results, written)
"""


def kvwatch_bounded_each(commands: list[list[str]], tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """Each `kvwatch ARGS` of `commands` in turn, in one process of its own bounded as kvwatch_bounded's:
    commands refused at start-up, checked without importing kvwatch again (a second of CPU) for each."""
    results = tmp_path / "kvwatch-each.json"
    bounded = subprocess.run(
        [sys.executable, "-c", _BOUNDED + _EACH_IN_TURN, json.dumps(commands), str(results)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bounded.returncode == 0, bounded.stdout + bounded.stderr
    return [
        subprocess.CompletedProcess(["kvwatch", *args], code, out, err)
        for args, (code, out, err) in zip(commands, json.loads(results.read_text()), strict=True)
    ]


def processes_in_group(pgid: int) -> list[int]:
    """Live processes of process group `pgid`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(proc.name))
    return found
