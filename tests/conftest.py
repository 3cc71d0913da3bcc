"""Shared fixtures: free loopback ports and real lab processes, always stopped by PID.

The tests live in two trees: tests/unit/<package>/ (each kvwatch package's own tests, quick; `make
test-unit`) and tests/integration/ (labs and real components). A test anywhere that starts a real
component through a fixture here (a lab, a replica, a router, PostgreSQL) is marked `integration`, so
that `make test-unit` leaves it out."""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import os
import ssl
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway_checks import LAB_CLIENT
from kvwatch.collectors.gatewaylogs.tally import REFUSED_REASONS
from kvwatch.core.credentials import MAX_SECRET_FILE_BYTES
from labs import (
    VLLM_LAB_RULE_TIME_SCALE,
    VLLM_LAB_START_TIMEOUT_S,
    Lab,
    start_lab_in,
    start_vllm_sagemaker_lab,
)
from paths import REPO
from processes import free_port, http_get, http_post, stop, wait_http

# Test modules share helpers across the two trees (a payload, a parser): each test folder is importable.
sys.path[:0] = sorted({str(p.parent) for p in (REPO / "tests").glob("*/**/test_*.py")})
# PostgreSQL's fixtures, for every module: one server for the whole run (a worker's, under xdist).
pytest_plugins = ["postgres"]
# Fixtures that start real components: a test that uses one is an integration test.
INTEGRATION_FIXTURES = {"start_lab", "vllm_lab", "vllm_sagemaker_lab", "start_replica", "start_router",
                        "start_smg", "postgres", "postgres_to_stop"}  # fmt: skip


_DATETIME = datetime  # the real class, which set_wall_clock replaces in every module that holds it


class _AnyDatetime(type):
    """`isinstance(d, <the replacement>)` holds for every datetime, as it did for the real class."""

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, _DATETIME)


def set_wall_clock(monkeypatch, reading: Callable[[], float]) -> None:
    """The wall clock as every Python reader sees it is `reading`: time.time(), and datetime.now() also
    where a module holds the class itself (APScheduler does). The monotonic clock is left alone."""
    monkeypatch.setattr(time, "time", reading)

    class WallClockDatetime(_DATETIME, metaclass=_AnyDatetime):
        @classmethod
        def now(cls, tz=None):
            return _DATETIME.fromtimestamp(reading(), tz)

    for module in list(sys.modules.values()):
        held = getattr(module, "__dict__", {}).get("datetime")
        if held is _DATETIME or isinstance(held, _AnyDatetime):
            monkeypatch.setattr(module, "datetime", WallClockDatetime)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key, made by openssl."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def server_tls(certificate) -> ssl.SSLContext:
    """A server's TLS context with the self-signed certificate."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    return context


@contextlib.contextmanager
def behind_a_dead_proxy() -> Iterator[None]:
    """An environment like a machine's whose proxy is set for pip and curl (here a loopback port nothing
    listens on, so that anything sent through it is refused): what is started meanwhile inherits it."""
    proxy = f"http://127.0.0.1:{free_port()}"
    with pytest.MonkeyPatch.context() as environment:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            environment.setenv(name, proxy)
            environment.setenv(name.lower(), proxy)
        environment.delenv("NO_PROXY", raising=False)
        environment.delenv("no_proxy", raising=False)
        yield


class Replica:
    def __init__(self, process: subprocess.Popen, port: int, replica_id: str, flavour: str, log: Path):
        self.process = process
        self.log = log
        self.port = port
        self.id = replica_id
        self.flavour = flavour
        self.url = f"http://127.0.0.1:{port}"

    def ground_truth(self) -> list[dict]:
        return http_get(f"{self.url}/lab/ground-truth", timeout=5).json()["records"]

    def set_faults(self, **faults) -> httpx.Response:
        return http_post(f"{self.url}/lab/faults", json=faults, timeout=5)


class RecordingTally:
    """A gateway-log source's counting side (take_records, refuse), recording what it is handed."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.refused: list[str] = []

    def take_records(self, records, received_at: float) -> None:
        self.records.extend(dict(record) for record in records)

    def refuse(self, reason: str, count: int = 1) -> None:
        assert reason in REFUSED_REASONS, f"{reason!r} is none of the tally's REFUSED_REASONS"
        self.refused.extend([reason] * count)


@pytest.fixture
def start_replica(tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    """Start real `kvwatch lab replica` processes; every one is stopped by PID at teardown."""
    started: list[subprocess.Popen] = []

    def start(replica_id: str = "r1", flavour: str = "vllm", *extra: str, env: dict | None = None) -> Replica:
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "kvwatch.cli.main",
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
            process = subprocess.Popen(
                command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        started.append(process)
        wait_http(f"http://127.0.0.1:{port}/health", process, log)
        return Replica(process, port, replica_id, flavour, log)

    yield start
    for process in started:
        stop(process)


@dataclass(frozen=True)
class Router:
    process: subprocess.Popen
    url: str
    metrics_url: str
    log: Path


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator[Callable[[str, list[Replica]], Router]]:
    """Start the real sglang-router with a policy in front of replicas; each is stopped by PID at teardown."""
    started: list[subprocess.Popen] = []

    def start(policy: str, replicas: list[Replica]) -> Router:
        return _launch_router(tmp_path, started, "sglang_router.launch_router", policy, replicas)

    yield start
    for process in started:
        stop(process)


@pytest.fixture
def start_smg(tmp_path: Path) -> Iterator[Callable[..., Router]]:
    """Start the real SMG (PyPI `smg`, SGLang's router since 1.x) with a policy in front of replicas, plus
    any further `smg launch` flags; each is stopped by PID at teardown."""
    started: list[subprocess.Popen] = []

    def start(policy: str, replicas: list[Replica], *extra: str) -> Router:
        flags = ("--disable-tokenizer-autoload", *extra)
        return _launch_router(tmp_path, started, "smg.launch_router", policy, replicas, flags)

    yield start
    for process in started:
        stop(process)


def _launch_router(
    tmp_path: Path,
    started: list[subprocess.Popen],
    module: str,
    policy: str,
    replicas: list[Replica],
    extra: tuple[str, ...] = (),
) -> Router:
    """Run a router's launcher module on free loopback ports, and wait until it routes to every replica."""
    port = free_port()
    metrics_port = free_port()
    while metrics_port == port:
        metrics_port = free_port()
    command = [
        sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(replica.url for replica in replicas), "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), *extra,
    ]  # fmt: skip
    # The router must never reach out for a tokenizer: point Hugging Face at a dead loopback port.
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    log = tmp_path / f"{module.split('.')[0]}-{policy}-{port}.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    started.append(process)
    router = Router(process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log)
    _wait_router_ready(router, healthy_workers=len(replicas))  # both register workers in the background
    return router


def _wait_router_ready(router: Router, healthy_workers: int, timeout: float = 30.0) -> None:
    """Wait until the router reports every worker healthy; it routes nowhere before its health checks."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise RuntimeError(f"router exited with {router.process.returncode}:\n{router.log.read_text()}")
        try:
            last = http_get(f"{router.url}/readiness", timeout=1.0).json()
        except (httpx.HTTPError, ValueError):
            pass
        else:
            if last.get("status") == "ready" and last.get("healthy_workers") == healthy_workers:
                return
        time.sleep(0.1)
    raise TimeoutError(f"router not ready with {healthy_workers} workers within {timeout} s (last: {last})")


@pytest.fixture(params=["dev-zero", "fifo", "oversize"])
def not_a_secret_file(request, tmp_path: Path) -> tuple[Path, str]:
    """A path a secret file key may name by mistake, and what reading it as one must say."""
    if request.param == "dev-zero":
        return Path("/dev/zero"), "is not a regular file (a FIFO, socket or device)"
    path = tmp_path / request.param
    if request.param == "fifo":
        os.mkfifo(path)
        return path, "is not a regular file (a FIFO, socket or device)"
    path.write_bytes(b"x" * (MAX_SECRET_FILE_BYTES + 1))
    return path, "is larger than 64 KiB: not one {secret}"


@pytest.fixture(scope="session", autouse=True)
def _lab_client_closed_at_the_end():
    """LAB_CLIENT's kept-alive sockets closed as the session ends, not left to the collector at exit."""
    yield
    LAB_CLIENT.close()


def decoded(values: list | dict) -> list[float]:
    """A trace's values: plotly writes a numpy array as base64 of its bytes and their dtype."""
    if isinstance(values, list):
        return values
    return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()


def experiment_replica_bars(at) -> dict[str, dict[str, float]]:
    """The Experiment page's chart of the requests each replica served, route: {replica: requests}; `at`
    is its AppTest."""
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id.endswith("experiment_replicas")]
    bars = json.loads(chart.proto.spec)["data"]
    return {bar["name"]: dict(zip(decoded(bar["x"]), decoded(bar["y"]), strict=True)) for bar in bars}


@pytest.fixture(scope="module")
def start_lab(tmp_path_factory) -> Iterator[Callable[..., Lab]]:
    """Start labs for a test module; each is stopped at the end of the module. Without the dashboard
    unless the module asks for it: on two cores every Streamlit nobody opens slows the whole suite."""
    labs: list[Lab] = []

    def start(*options: str, dashboard: bool = False) -> Lab:
        extra = () if dashboard else ("--no-dashboard",)
        lab = start_lab_in(tmp_path_factory.mktemp("lab") / "state", "--fast", *extra, *options)
        labs.append(lab)
        return lab

    yield start
    for lab in labs:
        lab.stop()


# The modules that take longest, each minutes of one worker mostly waiting for rule windows: collected
# first, so that pytest-xdist (`make test`) starts them first and none is left running alone at the end.
LONGEST_MODULES = (
    "test_probe_share_lab.py",
    "test_alerts_lab.py",
    "test_dashboard_browser.py",
    "test_gateway_moved_lab.py",
    "test_lab_victoriametrics.py",
    "test_rules_lab.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts a real component is an integration test; one that needs the real-vLLM lab may
    be the one that waits for it to start. The longest modules come first."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & INTEGRATION_FIXTURES:
            item.add_marker(pytest.mark.integration)
        if fixtures & {"vllm_lab", "vllm_sagemaker_lab"}:
            item.add_marker(pytest.mark.timeout(VLLM_LAB_START_TIMEOUT_S + 300))
    rank = {name: index for index, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def vllm_lab(tmp_path_factory) -> Iterator[Lab]:
    """One lab of two real vLLM servers (`make vllm` installs vLLM) behind the lab's nginx, for every
    real-engine test module: started once, stopped at the end of the session. No background users and
    no scheduled probes, so the engines' counters move only with a test's own traffic; 1 s scrapes and
    rule windows at a quarter of production. A module that breaks it (a fault) puts it right again."""
    lab = start_lab_in(
        tmp_path_factory.mktemp("vllm-lab") / "state",
        "--engine", "vllm", "--replicas", "2", "--users", "0", "--no-probes", "--no-dashboard", "--fast",
        "--rule-time-scale", str(VLLM_LAB_RULE_TIME_SCALE),
        timeout=VLLM_LAB_START_TIMEOUT_S,
    )  # fmt: skip
    yield lab
    lab.stop()


@pytest.fixture(scope="session")
def vllm_sagemaker_lab(tmp_path_factory) -> Iterator[Lab]:
    """One real vLLM server with SageMaker stateful sessions behind the lab's SageMaker front, for the
    real-engine SageMaker tests: started once, stopped at the end of the session."""
    lab = start_vllm_sagemaker_lab(tmp_path_factory.mktemp("vllm-sagemaker-lab") / "state", replicas=1)
    yield lab
    lab.stop()


@pytest.fixture
def sagemaker_runtime(monkeypatch, tmp_path: Path) -> Iterator[Callable[..., object]]:
    """The real AWS SDK's SageMaker runtime client for a lab front's URL: credentials from the
    environment (dummy ones, set here), no config files, no retries (each error surfaces once)."""
    import botocore.config
    import botocore.session

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDKVWATCHLAB")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kvwatch-lab-secret")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    clients = []

    def client(url: str, **config):
        options = botocore.config.Config(retries={"total_max_attempts": 1}, read_timeout=300, **config)
        session = botocore.session.get_session()
        made = session.create_client(
            "sagemaker-runtime", endpoint_url=url, region_name="eu-west-1", config=options
        )
        clients.append(made)
        return made

    yield client
    for made in clients:  # their pooled connections
        made.close()
    # botocore leaves the connection of an occasional streamed error answer to the garbage collector:
    # collected here, inside the client's fixture, rather than in a later test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
