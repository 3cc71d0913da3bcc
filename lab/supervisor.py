"""Start, wait for and stop the lab's processes, each tracked by PID in the lab state and run in a
process group of its own."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import time

import httpx

from kvwatch.core.connections import request_sync
from kvwatch.lab.configs import REPO
from kvwatch.lab.process import LabError, Process, is_ours, log_tail
from kvwatch.lab.state import LabState

STOP_TIMEOUT_S = 10.0
# Each poll of a waiting loop, the whole answer included: a server that trickles must not outlast the loop.
READY_POLL_TIMEOUT_S = 1.0


def reap() -> None:
    """Collect exited children so they do not linger as zombies while a foreground lab runs."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _spawn(state: LabState, process: Process) -> subprocess.Popen:
    """Start one process in a session of its own (its children share its process group)."""
    log = state.directory / "logs" / f"{process.name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            process.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env={**{k: v for k, v in os.environ.items() if k not in process.unset}, **process.env},
            start_new_session=True,
        )
    state.processes[process.name] = popen.pid
    state.save()
    return popen


def _wait_ready(state: LabState, started: list[tuple[Process, subprocess.Popen]]) -> None:
    """Wait until every started process serves; the first that exits or times out raises LabError."""
    began = time.monotonic()
    waiting = dict(enumerate(started))
    while waiting:
        for key, (process, popen) in list(waiting.items()):
            if popen.poll() is not None:
                raise LabError(
                    f"{process.name} exited with code {popen.returncode} while starting:\n"
                    f"{log_tail(state, process.name)}"
                )
            if process.ready_url is None and process.ready_udp_port is None:
                if time.monotonic() - began > 0.3:
                    del waiting[key]
                continue
            if _serves(process):
                del waiting[key]
                continue
            if time.monotonic() - began > process.ready_timeout_s:
                where = process.ready_url or f"UDP 127.0.0.1:{process.ready_udp_port}"
                raise LabError(
                    f"{process.name} did not become ready at {where} in "
                    f"{process.ready_timeout_s:.0f} s; its log ends:\n{log_tail(state, process.name)}"
                )
        time.sleep(0.1)


def _serves(process: Process) -> bool:
    """Whether the process answers its ready URL, or holds its UDP port (a bind of ours then fails)."""
    if process.ready_url is None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind(("127.0.0.1", process.ready_udp_port))
            except OSError as error:
                return error.errno == errno.EADDRINUSE
            return False
    try:
        return request_sync("GET", process.ready_url, READY_POLL_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


def start_processes(state: LabState, *processes: Process) -> None:
    """Start processes side by side and return once all of them serve."""
    _wait_ready(state, [(process, _spawn(state, process)) for process in processes])


def _signal_group(pid: int, signum: int) -> None:
    """Signal a process and its children (a real engine's workers), which share its process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def stop_processes(state: LabState, names: list[str]) -> float:
    """SIGTERM each named process that still runs, wait, then SIGKILL what is left; forget their PIDs.
    Returns once they are gone, with the wall time of the SIGTERM: a server stops listening at it but
    exits only once its in-flight requests are done, seconds later."""
    pids = {name: state.processes[name] for name in names if name in state.processes}
    running = [pid for pid in pids.values() if is_ours(state, pid)]  # a dead one's PID may be reused
    signalled = time.time()
    for pid in running:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(is_ours(state, pid) for pid in running) and time.monotonic() < deadline:
        reap()
        time.sleep(0.05)
    for pid in running:
        _signal_group(pid, signal.SIGKILL)  # the leader's stragglers too; the group is still ours
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (left := [pid for pid in running if is_ours(state, pid)]) and time.monotonic() < deadline:
        reap()
        time.sleep(0.05)
    if left:
        raise LabError(f"processes {left} survived SIGKILL for {STOP_TIMEOUT_S:.0f} s")
    for name in pids:
        del state.processes[name]
    state.save()
    return signalled


def check_ports_free(ports: dict[str, int]) -> None:
    for name, port in ports.items():
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                raise LabError(
                    f"port {port} on 127.0.0.1 ({name}) is already in use; choose another --base-port"
                ) from None


def running_processes(state: LabState) -> dict[str, int]:
    return {name: pid for name, pid in state.processes.items() if is_ours(state, pid)}
