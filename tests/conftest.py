"""Shared fixtures: free loopback ports and real lab processes, always stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, process: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    """Wait until `url` answers 200, failing early with the process's log if it died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"process exited with {process.returncode} before {url} was up:\n{log.read_text()}"
            )
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def stop(process: subprocess.Popen) -> None:
    """Stop a process we started, by its PID: SIGTERM, then SIGKILL after 10 s."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


class Replica:
    def __init__(self, process: subprocess.Popen, port: int, replica_id: str, flavour: str, log: Path):
        self.process = process
        self.log = log
        self.port = port
        self.id = replica_id
        self.flavour = flavour
        self.url = f"http://127.0.0.1:{port}"

    def ground_truth(self) -> list[dict]:
        return httpx.get(f"{self.url}/lab/ground-truth", timeout=5).json()["records"]

    def set_faults(self, **faults) -> httpx.Response:
        return httpx.post(f"{self.url}/lab/faults", json=faults, timeout=5)


@pytest.fixture
def start_replica(tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    """Start real `kvwatch lab replica` processes; every one is stopped by PID at teardown."""
    started: list[subprocess.Popen] = []

    def start(replica_id: str = "r1", flavour: str = "vllm", *extra: str) -> Replica:
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "collectors.cli",
            "lab",
            "replica",
            "--port",
            str(port),
            "--id",
            replica_id,
            "--flavour",
            flavour,
            *extra,
        ]
        log = tmp_path / f"replica-{replica_id}.log"
        with log.open("w") as out:
            process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        started.append(process)
        wait_http(f"http://127.0.0.1:{port}/health", process, log)
        return Replica(process, port, replica_id, flavour, log)

    yield start
    for process in started:
        stop(process)
