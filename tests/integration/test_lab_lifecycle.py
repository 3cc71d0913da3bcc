"""`kvwatch lab up / status / down`: every URL reported, and nothing of the stack left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvwatch.lab import stack
from kvwatch.lab.process import LabError
from paths import REPO
from processes import free_base_port, http_get, kvwatch, processes_mentioning

pytestmark = pytest.mark.integration


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def lab_ports(base: int, replicas: int) -> list[int]:
    return [*range(base, base + 6), *(base + 10 + i for i in range(replicas))]


def scraped_replicas(prometheus: str) -> set[tuple[str, str]]:
    """(replica, flavour) of the replica targets Prometheus scrapes, once it has discovered them."""
    deadline = time.monotonic() + 20
    while True:
        targets = http_get(f"{prometheus}/api/v1/targets").json()["data"]["activeTargets"]
        found = {
            (t["labels"]["replica"], t["labels"]["flavour"])
            for t in targets
            if t["labels"]["job"] == "replicas"
        }
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@pytest.fixture(scope="module")
def lab(start_lab):
    return start_lab(
        "--replicas", "3", "--flavours", "vllm,sglang", "--users", "1", "--time-scale", "0.1", dashboard=True
    )  # fmt: skip


def test_status_json_lists_every_url(lab):
    status = lab.status
    base = lab.base_port
    assert status["gateways"] == {
        "affinity": f"http://127.0.0.1:{base}",
        "round_robin": f"http://127.0.0.1:{base + 1}",
    }
    assert status["prometheus"] == f"http://127.0.0.1:{base + 2}"
    assert status["alertmanager"] == f"http://127.0.0.1:{base + 3}"
    assert status["exporter"] == f"http://127.0.0.1:{base + 4}"
    assert status["dashboard"] == f"http://127.0.0.1:{base + 5}"
    assert status["replicas"] == [
        {"id": f"r{n + 1}", "name": f"r{n + 1} (127.0.0.1:{base + 10 + n})",
         "url": f"http://127.0.0.1:{base + 10 + n}", "flavour": flavour, "prefix_caching": True}
        for n, flavour in enumerate(("vllm", "sglang", "vllm"))
    ]  # fmt: skip
    assert http_get(f"{status['prometheus']}/-/ready").status_code == 200
    assert http_get(f"{status['alertmanager']}/-/ready").status_code == 200
    assert scraped_replicas(status["prometheus"]) == {("r1", "vllm"), ("r2", "sglang"), ("r3", "vllm")}
    text = lab.cli("status").stdout
    assert f"http://127.0.0.1:{base}" in text and "sglang" in text


def test_a_replica_fault_and_its_heal_name_the_replica_by_id_and_address(lab):
    r2 = f"r2 (127.0.0.1:{lab.base_port + 11})"
    result = lab.cli("fault", "disable-prefix-cache", "r2")
    assert result.stdout == f"prefix caching off on {r2}\n", result.stderr
    assert f"faults               disable-prefix-cache on {r2}\n" in lab.cli("status").stdout
    assert lab.cli("heal").stdout == f"healed: disable-prefix-cache on {r2}\n"
    logged = [json.loads(line) for line in (lab.state_dir / "faults.log").read_text().splitlines()]
    assert [(e["action"], e["replica"], e["address"]) for e in logged[-2:]] == [
        ("fault", "r2", f"127.0.0.1:{lab.base_port + 11}"),
        ("heal", None, None),
    ]


def test_a_failed_start_stops_what_it_started(tmp_path):
    """Prometheus dies at start: the replicas and nginx already running must be stopped too."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    fake = fake_bin / "prometheus"
    fake.write_text("#!/bin/sh\necho 'unknown flag --storage.tsdb.path' >&2\nexit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    state_dir, base = tmp_path / "state", free_base_port()
    result = kvwatch("lab", "up", "--detach", "--replicas", "2", "--users", "0", "--base-port", str(base),
                     "--state-dir", str(state_dir), env=env)  # fmt: skip
    assert result.returncode == 1
    assert "prometheus exited with code 3" in result.stderr and "unknown flag" in result.stderr
    assert processes_mentioning(str(state_dir)) == []
    assert not any(listening(port) for port in lab_ports(base, 2))


def test_a_taken_port_is_named_and_nothing_starts(tmp_path):
    state_dir, base = tmp_path / "state", free_base_port()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", base + 2))
        blocker.listen()
        result = kvwatch("lab", "up", "--detach", "--users", "0", "--base-port", str(base),
                         "--state-dir", str(state_dir))  # fmt: skip
    assert result.returncode == 1
    assert f"port {base + 2} on 127.0.0.1 (prometheus) is already in use" in result.stderr
    assert processes_mentioning(str(state_dir)) == []


def test_ctrl_c_on_a_foreground_lab_stops_everything(tmp_path):
    state_dir, base = tmp_path / "state", free_base_port()
    command = [
        *(sys.executable, "-m", "kvwatch.cli.main", "lab", "up", "--replicas", "1", "--users", "1"),
        *("--think", "0.1", "--time-scale", "0.1", "--base-port", str(base), "--state-dir", str(state_dir)),
    ]
    log = tmp_path / "up.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "The lab is up." not in log.read_text():  # everything started, the traffic process last
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert len(processes_mentioning(str(state_dir))) >= 5
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
        assert process.returncode == 0, log.read_text()
        assert "The lab is down." in log.read_text()
        assert processes_mentioning(str(state_dir)) == []
    finally:
        if process.poll() is None:
            process.kill()
        for pid in processes_mentioning(str(state_dir)):
            os.kill(pid, signal.SIGKILL)


def test_a_second_up_on_a_running_lab_is_refused(lab):
    again = kvwatch(
        "lab", "up", "--detach", "--base-port", str(free_base_port()), "--state-dir", str(lab.state_dir)
    )
    assert again.returncode == 1 and "already running" in again.stderr


@pytest.mark.parametrize("command", [["status"], ["down"], ["heal"], ["fault", "break-affinity"]])
def test_commands_without_a_lab_say_how_to_start_one(tmp_path, command):
    result = kvwatch("lab", *command, "--state-dir", str(tmp_path / "none"))
    assert result.returncode == 1 and "kvwatch lab up" in result.stderr


def test_a_command_waiting_too_long_for_the_lock_fails_naming_the_holder(tmp_path):
    holder = f"PID {os.getpid()}\\) has been changing the lab in {tmp_path}"
    # A second open file of the lock: flock refuses it as it would another process.
    with (
        stack.locked(tmp_path),
        pytest.raises(LabError, match=holder),
        stack.locked(tmp_path, timeout_s=0.3),
    ):
        pass
    with stack.locked(tmp_path, timeout_s=0.3):  # released: the next one takes it at once
        pass


def test_down_leaves_no_process_and_no_listener(lab):
    """The module's lab, last: down stops it."""
    state_dir, base = lab.state_dir, lab.base_port
    assert "affinity gateway" in lab.up_output and f"http://127.0.0.1:{base}" in lab.up_output
    assert len(processes_mentioning(str(state_dir))) >= 6
    assert all(listening(port) for port in lab_ports(base, 3))
    down = lab.cli("down")
    assert down.returncode == 0, down.stderr
    assert processes_mentioning(str(state_dir)) == []
    assert not any(listening(port) for port in lab_ports(base, 3))
    assert '"prometheus": null' in lab.cli("status", "--json").stdout
