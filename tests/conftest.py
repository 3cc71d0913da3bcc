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
import math
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvwatch.cli.main import main
from kvwatch.collectors.gatewaylogs.tally import REFUSED_REASONS
from kvwatch.core.credentials import MAX_SECRET_FILE_BYTES
from kvwatch.lab import stack
from kvwatch.lab.process import LabError
from kvwatch.lab.state import LabState

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TESTDATA = REPO / "tests" / "testdata"
# Test modules share helpers across the two trees (a payload, a parser): each test folder is importable.
sys.path[:0] = sorted({str(p.parent) for p in (REPO / "tests").glob("*/**/test_*.py")})
# Fixtures that start real components: a test that uses one is an integration test.
INTEGRATION_FIXTURES = {"start_lab", "vllm_lab", "vllm_sagemaker_lab", "start_replica", "start_router",
                        "start_smg", "postgres", "postgres_to_stop"}  # fmt: skip


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


# Kept-alive connections to the labs' gateways and replicas: both gateways apply a change to new requests
# on old connections too (nginx closes them as its old workers exit, Envoy routes each request anew).
LAB_CLIENT = httpx.Client(timeout=30)


@pytest.fixture(scope="session", autouse=True)
def _lab_client_closed_at_the_end():
    """LAB_CLIENT's kept-alive sockets closed as the session ends, not left to the collector at exit."""
    yield
    LAB_CLIENT.close()


def chat(url: str, session: str | None = None, content: str = "hello") -> httpx.Response:
    """One short round through a lab gateway or to a replica, with the session header when given."""
    headers = {"X-Session-Id": session} if session else {}
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return LAB_CLIENT.post(f"{url}/v1/chat/completions", json=body, headers=headers)


def upstreams(url: str, sessions: list[str], rounds: int = 3) -> dict[str, list[str]]:
    """The upstream that served each round of each session, all sessions a round (from X-Upstream)."""
    seen: dict[str, list[str]] = {s: [] for s in sessions}
    for _ in range(rounds):
        for session in sessions:
            response = chat(url, session)
            assert response.status_code == 200, response.text
            seen[session].append(response.headers["X-Upstream"])
    return seen


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


# The replicas' admin API by every spelling of its path.
ADMIN_REQUESTS = [
    *(("GET", path) for path in ("/lab/state", "/lab/ground-truth", "//lab/state", "/%6Cab/state")),
    ("GET", "/v1/../lab/state"),
    *(("POST", path) for path in ("/lab/faults", "/lab/reset-cache")),
]


def assert_admin_api_unproxied(lab: Lab, listener: str) -> None:
    """The lab gateway's `listener` proxies no spelling of the replicas' admin API: no fault took."""
    url = getattr(lab, listener)
    for method, path in ADMIN_REQUESTS:
        response = LAB_CLIENT.request(method, url + path, json={"prefix_caching": False})
        assert response.status_code == 404, (method, path, response.text)
    for replica in lab.status["replicas"]:
        assert LAB_CLIENT.get(f"{replica['url']}/lab/state").json()["faults"]["prefix_caching"] is True


def assert_round_robin(url: str, sessions: list[str]) -> None:
    """Strict round robin: each round of each session (three, replicas enough) went to another replica."""
    seen = upstreams(url, sessions)
    assert all(len(set(rounds)) == len(rounds) for rounds in seen.values()), seen


def assert_spread(url: str, sessions: list[str]) -> None:
    """The gateway does not keep sessions: the rounds of some session went to more than one replica."""
    seen = upstreams(url, sessions)
    assert any(len(set(rounds)) > 1 for rounds in seen.values()), seen


def session_pinned_to(lab: Lab, upstream: str) -> str:
    """A session id the lab's affinity listener sends to `upstream` (host:port), out of 200 tried."""
    candidates = (f"pinned-{i}" for i in range(200))
    pinned = next((s for s in candidates if chat(lab.affinity, s).headers["X-Upstream"] == upstream), None)
    assert pinned, f"no session pinned to {upstream}"
    return pinned


def fault(lab: Lab, *args: str) -> None:
    """`kvwatch lab fault ...`, which must succeed."""
    result = lab.cli("fault", *args)
    assert result.returncode == 0, result.stderr


def assert_baseline(lab: Lab, sessions: list[str]) -> None:
    """Affinity pins every session to one replica and echoes its id; every replica is up; no fault."""
    seen = upstreams(lab.affinity, sessions)
    assert all(len(set(rounds)) == 1 for rounds in seen.values()), seen
    assert chat(lab.affinity, "echo-me").headers["X-Session-Id"] == "echo-me"
    status = lab.cli("status", "--json").json
    assert status["faults"] == [] and all(r["url"] for r in status["replicas"])
    assert len(status["replicas"]) == len(lab.status["replicas"])


def heal(lab: Lab, sessions: list[str]) -> None:
    """`kvwatch lab heal`, which must succeed and leave the baseline."""
    result = lab.cli("heal")
    assert result.returncode == 0, result.stderr
    assert_baseline(lab, sessions)


def heal_if_faulted(lab: Lab, sessions: list[str]) -> None:
    """After a test of a shared lab: one that failed before its own heal leaves no fault for the next."""
    if LabState.load(lab.state_dir).faults:
        heal(lab, sessions)


def fault_with_gateway_stopped(lab: Lab, gateway: str, match: str) -> str:
    """`break-affinity` while the gateway's process is stopped (SIGSTOP), so that it cannot take the new
    config: the LabError the fault must fail with, which matches `match`."""
    pid = lab.status["processes"][gateway]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(LabError, match=match) as raised:
            stack.fault(LabState.load(lab.state_dir), "break-affinity")
    finally:
        os.kill(pid, signal.SIGCONT)
    return str(raised.value)


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


# Real vLLM replicas start in about a minute on an idle 2-core machine, several when it is busy.
VLLM_LAB_START_TIMEOUT_S = 600
VLLM_LAB_RULE_TIME_SCALE = 0.25  # 30 s rate windows: a short burst of traffic fills one


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


def start_vllm_sagemaker_lab(state_dir: Path, replicas: int, *options: str) -> Lab:
    """Real vLLM servers with SageMaker stateful sessions behind the lab's SageMaker front, no serve
    probing: the only traffic is the test's. 1 s scrapes and rule windows at a quarter of production, as
    in vllm_lab."""
    return start_lab_in(
        state_dir, "--engine", "vllm", "--gateway", "sagemaker", "--replicas", str(replicas), "--no-probes",
        "--no-dashboard", "--fast", "--rule-time-scale", str(VLLM_LAB_RULE_TIME_SCALE), *options,
        timeout=VLLM_LAB_START_TIMEOUT_S,
    )  # fmt: skip


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
