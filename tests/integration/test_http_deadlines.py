"""Every HTTP exchange kvwatch starts ends by its deadline, the body included: against a real server on
127.0.0.1 that sends its headers, then a byte every TRICKLE_S, each call gives up within its deadline.
httpx's and requests' own timeouts bound each read only, so without the deadline these calls never
return (the timeout mark fails them)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import streamlit as st

from kvwatch.collectors.probe import blocksize
from kvwatch.collectors.probe.blocksize import BlockSizeSources
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.core import connections
from kvwatch.core.errors import UpstreamTimeout
from kvwatch.dashboard import data
from kvwatch.doctor import caching, route
from kvwatch.lab import stack, supervisor
from kvwatch.lab.process import LabError, Process
from kvwatch.lab.state import LabState
from kvwatch.prometheus import queries
from tools import board_preview

TRICKLE_S = 0.04  # well inside every per-read timeout below: only a deadline over the whole exchange ends it
DEADLINE_S = 0.2
# Without a deadline a call reads the 1 MB body a byte each TRICKLE_S, for hours; with one it returns in
# its deadline and the loop's time, which a loaded machine stretches (0.76 s seen for a 0.2 s deadline).
LOOP_MARGIN_S = 1.5
HANGS_WITHOUT_A_DEADLINE = pytest.mark.timeout(15)


@pytest.fixture(scope="module")
def trickle() -> Iterator[str]:
    """The URL of a server that answers every request with headers, then one byte every TRICKLE_S."""
    stopping = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)

    def answer(connection: socket.socket) -> None:
        with connection:
            try:
                while b"\r\n\r\n" not in connection.recv(65536):
                    pass
                connection.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
                )
                while not stopping.wait(TRICKLE_S):
                    connection.sendall(b" ")
            except OSError:  # the client gave up
                pass

    def serve() -> None:
        while not stopping.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    server = threading.Thread(target=serve)
    server.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stopping.set()
    server.join()
    listener.close()


def within_deadline(call, deadline: float = DEADLINE_S):
    """What `call()` returned, checking it took no more than its deadline (and a margin for the loop)."""
    began = time.monotonic()
    result = call()
    assert time.monotonic() - began < deadline + LOOP_MARGIN_S
    return result


@HANGS_WITHOUT_A_DEADLINE
def test_the_shared_helpers_end_a_trickling_exchange(trickle):
    async def asynchronous():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return await connections.request(client, "GET", trickle, DEADLINE_S)

    for call in (
        lambda: asyncio.run(asynchronous()),
        lambda: connections.request_sync("GET", trickle, DEADLINE_S),
    ):
        with pytest.raises(httpx.TimeoutException, match=f"no complete answer within {DEADLINE_S:g} s"):
            within_deadline(call)


@HANGS_WITHOUT_A_DEADLINE
def test_learning_the_block_size_gives_up_on_a_trickling_prometheus_and_metrics(trickle, monkeypatch):
    monkeypatch.setattr(blocksize, "TIMEOUT_S", DEADLINE_S)
    sources = BlockSizeSources(prometheus_url=trickle, metrics_urls=(f"{trickle}/metrics",))
    found = within_deadline(lambda: asyncio.run(blocksize.learn(sources, [])), 2 * DEADLINE_S)
    assert found.source == "default; no engine evidence"


@HANGS_WITHOUT_A_DEADLINE
def test_the_doctor_gives_up_on_trickling_models_and_prometheus(trickle, monkeypatch):
    monkeypatch.setattr(caching, "PROMETHEUS_TIMEOUT_S", DEADLINE_S)
    probe = ProbeSettings(base_url=trickle, model="m", timeout_seconds=DEADLINE_S)

    async def ask(question):
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return await question(client)

    assert within_deadline(lambda: asyncio.run(ask(lambda client: route._models(client, probe)))) is None
    with pytest.raises(UpstreamTimeout):
        within_deadline(lambda: asyncio.run(caching._caching_off_in_prometheus(trickle)))


@HANGS_WITHOUT_A_DEADLINE
def test_the_readme_picture_gives_up_on_a_trickling_prometheus(trickle, monkeypatch):
    monkeypatch.setattr(board_preview, "PROMETHEUS_TIMEOUT_S", DEADLINE_S)
    query = {"expr": "up", "instant": True}
    with pytest.raises(UpstreamTimeout):
        within_deadline(lambda: board_preview.evaluate(trickle, query, start=0.0, end=60.0, window="5m"))


@HANGS_WITHOUT_A_DEADLINE
def test_the_dashboard_says_in_one_line_that_prometheus_or_alertmanager_trickles(
    trickle, tmp_path, monkeypatch
):
    config = tmp_path / "kvwatch.yaml"
    config.write_text(
        "targets: [{name: t, base_url: 'http://127.0.0.1:1', model: m}]\n"
        f"prometheus: {{url: '{trickle}'}}\nalertmanager: {{url: '{trickle}'}}\n"
    )
    monkeypatch.setattr(sys, "argv", ["app.py", "--config", str(config)])
    monkeypatch.setattr(data, "TIMEOUT_SECONDS", DEADLINE_S)
    st.cache_data.clear()
    try:
        chart = within_deadline(lambda: data.series(queries.CLUSTER_HIT_RATIO, data.span(900)))
        alerts = within_deadline(data.alerts)
    finally:
        st.cache_data.clear()
    assert chart.error == f"Prometheus at {trickle} did not answer within {DEADLINE_S} s."
    assert alerts.error == f"Alertmanager at {trickle}/api/v2/alerts did not answer within {DEADLINE_S} s."


@pytest.fixture
def lab_process(tmp_path) -> Iterator[subprocess.Popen]:
    """A live process of a lab in tmp_path (its command line names the directory), stopped by PID."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(tmp_path)])
    # Until it has exec'd, the child still shows pytest's command line: the lab would not know it.
    cmdline = Path(f"/proc/{process.pid}/cmdline")
    for _ in range(500):  # 5 s at most
        if str(tmp_path).encode() in cmdline.read_bytes():
            break
        time.sleep(0.01)
    yield process
    process.kill()
    process.wait()


@HANGS_WITHOUT_A_DEADLINE
def test_the_lab_waits_no_longer_than_its_deadline_on_a_trickling_process(
    trickle, tmp_path, monkeypatch, lab_process
):
    monkeypatch.setattr(supervisor, "READY_POLL_TIMEOUT_S", DEADLINE_S)
    state = LabState(tmp_path, 20000)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "prometheus.log").write_text("")
    waited = Process("prometheus", [], f"{trickle}/-/ready", ready_timeout_s=DEADLINE_S / 2)
    with pytest.raises(LabError, match="did not become ready"):
        within_deadline(lambda: supervisor._wait_ready(state, [(waited, lab_process)]))


@HANGS_WITHOUT_A_DEADLINE
def test_a_prometheus_reload_gives_up_on_a_trickling_prometheus(trickle, tmp_path, monkeypatch, lab_process):
    monkeypatch.setattr(stack, "PROMETHEUS_STATUS_TIMEOUT_S", DEADLINE_S)
    monkeypatch.setattr(stack, "PROMETHEUS_RELOAD_TIMEOUT_S", DEADLINE_S / 2)
    state = LabState(tmp_path, int(trickle.rsplit(":", 1)[1]) - 2)  # its Prometheus port is the trickle's
    state.processes["prometheus"] = lab_process.pid
    (tmp_path / "prometheus.yml").write_text("scrape_configs: []\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "prometheus.log").write_text("")
    with pytest.raises(LabError, match="did not load the new config"):
        within_deadline(lambda: stack._reload_prometheus(state))
