"""A lab a test started (`kvwatch lab up --detach`), and waiting for what its Prometheus and replicas
recorded."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from processes import free_base_port, http_get, kvwatch, processes_in_group, processes_mentioning, wait_for


def wait_until_recorded(replicas: Iterable[dict], at: float) -> None:
    """Until every request the lab's replicas received by `at` has ended, and so has its ground-truth
    record (kept when a request ends): what a comparison with what was scraped by `at` must read."""

    def recorded() -> bool:
        states = [http_get(f"{r['url']}/lab/state", timeout=10).json() for r in replicas]
        return all((state["oldest_in_flight"] or math.inf) > at for state in states)

    wait_for(recorded, "the replicas' records of every request that arrived by then", 60, 0.2)


def finished_evaluation(prometheus: str, record: str, after: float = 0.0) -> float:
    """The time of an evaluation of `record`'s rule group after `after` that Prometheus has finished.
    It evaluates a group's rules one after another, each written when it ends and stamped with the
    evaluation's time: read at that time while the group is halfway, the later rules answer from the
    evaluation before. The next evaluation begins only once this one has ended."""

    def latest() -> float:
        params = {"query": f"max(timestamp({record}))"}
        found = http_get(f"{prometheus}/api/v1/query", params=params, timeout=10).json()["data"]["result"]
        return float(found[0]["value"][1]) if found else 0.0

    at = wait_for(lambda: (moment := latest()) > after and moment, f"{record} evaluated", 60, 0.2)
    wait_for(lambda: latest() > at, f"the evaluation after {at:.3f} of {record}'s rules", 60, 0.1)
    return at


class Lab:
    """A lab started with `kvwatch lab up --detach` in its own state directory."""

    def __init__(self, state_dir: Path, base_port: int, up_output: str = ""):
        self.state_dir = state_dir
        self.base_port = base_port
        self.up_output = up_output  # what `kvwatch lab up` printed
        self.started_at = time.time()
        self.status = self.cli("status", "--json").json

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """`kvwatch lab ARGS` on this lab; a fault or heal that restarts real vLLM wants a longer
        `timeout` (the lab allows its start minutes on a busy machine)."""
        result = kvwatch("lab", *args, "--state-dir", str(self.state_dir), timeout=timeout)
        if "--json" in args and result.returncode == 0:
            result.json = json.loads(result.stdout)
        return result

    @property
    def affinity(self) -> str:
        return self.status["gateways"]["affinity"]

    @property
    def round_robin(self) -> str:
        return self.status["gateways"]["round_robin"]

    def replica_url(self, replica_id: str) -> str:
        (replica,) = [r for r in self.cli("status", "--json").json["replicas"] if r["id"] == replica_id]
        return replica["url"]

    def access_log(
        self, listener: str, until: Callable[[list[dict]], bool] | None = None, timeout: float = 10
    ) -> list[dict]:
        """The gateway's access log for `listener`; with `until`, once it holds what `until` waits for.
        A gateway writes a request's line only after the answer's last byte (Envoy every 0.2 s), so the
        line of the request just answered may not be there yet."""
        path = self.state_dir / "logs" / f"gateway-{listener}.jsonl"
        deadline = time.monotonic() + timeout
        while True:
            entries = [json.loads(line) for line in path.read_text().splitlines() if line]
            if until is None or until(entries):
                return entries
            assert time.monotonic() < deadline, f"the access log never held it: {entries[-5:]}"
            time.sleep(0.1)

    def stop(self) -> None:
        self.cli("down")
        kill_lab_processes(self.state_dir)


def kill_lab_processes(state_dir: Path) -> None:
    """Belt and braces: nothing of a lab may outlive its test, whatever `down` did. A real engine's
    workers do not name the lab on their command line, but they stay in their leader's process group."""
    leaders = set(processes_mentioning(str(state_dir)))
    with contextlib.suppress(FileNotFoundError, ValueError):
        leaders |= set(json.loads((state_dir / "state.json").read_text())["processes"].values())
    for pid in leaders:
        if processes_in_group(pid):
            os.killpg(pid, signal.SIGKILL)


def stop_lab_serve(lab: Lab) -> int:
    """SIGTERM the lab's `kvwatch serve` and return its PID once its whole process group is gone."""
    pid = lab.status["processes"]["serve"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while processes_in_group(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_in_group(pid), f"kvwatch serve ({pid}) still runs 30 s after SIGTERM"
    return pid


def start_lab_in(state_dir: Path, *options: str, timeout: float = 120) -> Lab:
    """`kvwatch lab up --detach` in its own state directory and port block; its output if it fails. A lab
    that did not come up (a failure, a timeout, a status that cannot be read) leaves no process behind."""
    base = free_base_port()
    try:
        result = kvwatch("lab", "up", "--detach", "--base-port", str(base), "--state-dir", str(state_dir),
                         *options, timeout=timeout)  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"kvwatch lab up failed:\n{result.stdout}\n{result.stderr}")
        return Lab(state_dir, base, result.stdout)
    except BaseException:
        kill_lab_processes(state_dir)
        raise


# Real vLLM replicas start in about a minute on an idle 2-core machine, several when it is busy.
VLLM_LAB_START_TIMEOUT_S = 600


VLLM_LAB_RULE_TIME_SCALE = 0.25  # 30 s rate windows: a short burst of traffic fills one


def start_vllm_sagemaker_lab(state_dir: Path, replicas: int, *options: str) -> Lab:
    """Real vLLM servers with SageMaker stateful sessions behind the lab's SageMaker front, no serve
    probing: the only traffic is the test's. 1 s scrapes and rule windows at a quarter of production, as
    in vllm_lab."""
    return start_lab_in(
        state_dir, "--engine", "vllm", "--gateway", "sagemaker", "--replicas", str(replicas), "--no-probes",
        "--no-dashboard", "--fast", "--rule-time-scale", str(VLLM_LAB_RULE_TIME_SCALE), *options,
        timeout=VLLM_LAB_START_TIMEOUT_S,
    )  # fmt: skip
