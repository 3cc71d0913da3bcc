"""Why reuse is low, proven end to end: the lab's router (lab/router.py) in front of lab replicas exports
the reuse decomposition's legs as llm-d's EPP names them, a real Prometheus runs kvwatch's generated rules
and alerts, and three faults each show up as their own loss and alert:

- a workload whose prefix changes every turn: a workload loss, and neither reuse alert;
- a router that spreads sessions while the replicas hold their prefixes: a routing loss;
- engines with prefix caching off behind a router that predicts hits: an engine / index loss.

Each figure is checked against the lab's ground truth: what the replicas' own caches held at decision
time (the router asks each replica at every decision) and the cached tokens the replicas recorded.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
from test_router_prediction import firing, rules_prometheus, value

from conftest import Replica
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.doctor.checks import diagnose
from kvwatch.lab.configs import scale_durations
from kvwatch.prometheus import queries
from labs import finished_evaluation
from paths import REPO
from processes import free_port, http_get, stop, wait_for, wait_http

FIRING_TIMEOUT_S = 120.0
RULE_SCALE = 0.1  # 2m rate windows take 12 s, the alerts' 5m `for` 30 s
RULE_WINDOW = scale_durations(queries.WINDOW, RULE_SCALE)
PROMPT_SUM = "llm_d_epp_prefix_prompt_tokens_sum"
SHARE, LOSS = queries.INSTANCE_ROUTER_REUSE_SHARE, queries.INSTANCE_ROUTER_REUSE_LOSS
TOLERANCE = 0.02
DOCUMENT = " ".join(f"clause {n} of the shared contract says the parties keep every term" for n in range(30))
REUSE_ALERTS = ("KVWatchReuseLostToRouting", "KVWatchReuseLostInEngine")


class LabRouter:
    def __init__(self, process: subprocess.Popen, port: int):
        self.process, self.port, self.url = process, port, f"http://127.0.0.1:{port}"

    def ground_truth(self) -> list[dict]:
        return http_get(f"{self.url}/lab/ground-truth", timeout=5).json()["records"]


@pytest.fixture
def start_lab_router(tmp_path: Path) -> Iterator[Callable[..., LabRouter]]:
    """Start `python -m kvwatch.lab.router` processes; each is stopped by PID at teardown."""
    started: list[subprocess.Popen] = []

    def start(policy: str, replicas: list[Replica]) -> LabRouter:
        port = free_port()
        argv = [sys.executable, "-m", "kvwatch.lab.router", "--port", str(port), "--policy", policy]
        argv += [f"--replica={replica.id}={replica.url}" for replica in replicas]
        log = tmp_path / f"router-{port}.log"
        with log.open("w") as out:
            process = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        started.append(process)
        wait_http(f"http://127.0.0.1:{port}/health", process, log)
        return LabRouter(process, port)

    yield start
    for process in started:
        stop(process)


def changing_prefix(client: httpx.Client) -> None:
    """Every turn's prompt starts with something new (a timestamp, a request id): nothing to reuse."""
    messages = [{"role": "system", "content": f"request {uuid.uuid4()} " + DOCUMENT}]
    client.post("/v1/chat/completions", json={"messages": messages + [{"role": "user", "content": "go"}]})


def two_turns(client: httpx.Client) -> None:
    """A new session: a long document, a question, then a follow-up that extends the first turn."""
    history = [{"role": "system", "content": f"session {uuid.uuid4()} " + DOCUMENT}]
    history.append({"role": "user", "content": "what does clause 3 say"})
    answer = client.post("/v1/chat/completions", json={"messages": history}).json()
    history += [answer["choices"][0]["message"], {"role": "user", "content": "and clause 4"}]
    client.post("/v1/chat/completions", json={"messages": history})


def send_until(
    stop_sending: threading.Event, url: str, traffic: Callable[[httpx.Client], None], errors: list[str]
) -> None:
    """The case's traffic, one session after another, until told to stop (bounded by a deadline); a
    failure ends it and is kept for the test to report."""
    deadline = time.monotonic() + FIRING_TIMEOUT_S + 60
    with httpx.Client(base_url=url, timeout=30, event_hooks={"response": [checked]}) as client:
        while not stop_sending.is_set() and time.monotonic() < deadline:
            try:
                traffic(client)
            except (httpx.HTTPError, KeyError, ValueError) as error:
                errors.append(f"{url}: {error!r}")
                return


def checked(response: httpx.Response) -> None:
    response.read()
    response.raise_for_status()


def query(prometheus: str, expr: str, at: float) -> list[dict]:
    params = {"query": expr, "time": at}
    return http_get(f"{prometheus}/api/v1/query", params=params, timeout=5).json()["data"]["result"]


def scraped_all(prometheus: str, job: str, router: LabRouter) -> bool:
    """Prometheus holds the router's counters as they stand now that its traffic has stopped."""
    total = sum(record["prompt_tokens"] for record in router.ground_truth())
    return value(prometheus, f'sum({PROMPT_SUM}{{job="{job}"}})') == total


def window_records(prometheus: str, job: str, router: LabRouter, at: float) -> list[dict]:
    """The router's decisions whose tokens the recorded figures at `at` cover: those that raised its
    prompt-token count between the first and the last sample of the rules' window (the router counts
    every leg of a request at once, so the window holds whole requests)."""
    (series,) = query(prometheus, f'{PROMPT_SUM}{{job="{job}"}}[{RULE_WINDOW}]', at)
    first, last = float(series["values"][0][1]), float(series["values"][-1][1])
    records, counted = [], 0
    for record in router.ground_truth():
        counted += record["prompt_tokens"]
        if first < counted <= last:
            records.append(record)
    return records


def truth(records: list[dict], replicas: list[Replica]) -> dict[str, float]:
    """The decomposition by the replicas themselves: what the best replica and the chosen one held at
    decision time, what the router predicted the chosen one held, what the chosen one reused."""
    reused = {r["request_id"]: r["cached_tokens"] for replica in replicas for r in replica.ground_truth()}
    prompt = sum(r["prompt_tokens"] for r in records)
    return {
        "available": sum(max(r["held"].values()) for r in records) / prompt,
        "held by the chosen": sum(r["held"][r["replica"]] for r in records) / prompt,
        "routed": sum(r["indexed"][r["replica"]] for r in records) / prompt,
        "delivered": sum(reused[r["request_id"].removeprefix("chatcmpl-")] for r in records) / prompt,
    }


def figures(prometheus: str, job: str, at: float | None = None) -> dict[str, float]:
    """kvwatch's recorded shares and losses of one router, all of one rule evaluation."""
    selector = f'{{__name__=~"{SHARE}|{LOSS}", job="{job}"}}'
    found = query(prometheus, selector, time.time() if at is None else at)
    return {r["metric"].get("leg", r["metric"].get("loss")): float(r["value"][1]) for r in found}


def reuse_alerts(prometheus: str) -> set[tuple[str, str]]:
    return {(name, alert["labels"]["job"]) for name in REUSE_ALERTS for alert in firing(prometheus, name)}


def pending_or_firing(prometheus: str, job: str) -> list[str]:
    answer = http_get(f"{prometheus}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return [a["labels"]["alertname"] for a in answer if a["labels"].get("job") == job]


@pytest.mark.integration
def test_three_faults_show_up_as_their_own_loss_and_alert(start_replica, start_lab_router, tmp_path: Path):
    timing = ("--time-scale", "0.05", "--answer-tokens", "8")
    caching = [start_replica(f"r{n}", "vllm", *timing) for n in (1, 2)]
    caching_off = [start_replica(f"r{n}", "vllm", *timing) for n in (3, 4)]
    for replica in caching_off:
        replica.set_faults(prefix_caching=False).raise_for_status()
    cases = {  # job: (router, its replicas, its traffic)
        "workload": (start_lab_router("cache-aware", caching), caching, changing_prefix),
        "spread": (start_lab_router("spread", caching), caching, two_turns),
        "engine": (start_lab_router("cache-aware", caching_off), caching_off, two_turns),
    }
    scrape_configs = [
        {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{router.port}"]}]}
        for job, (router, _, _) in cases.items()
    ]
    expected_alerts = {("KVWatchReuseLostToRouting", "spread"), ("KVWatchReuseLostInEngine", "engine")}
    stop_sending, errors = threading.Event(), []
    senders = [
        threading.Thread(target=send_until, args=(stop_sending, router.url, traffic, errors), daemon=True)
        for router, _, traffic in cases.values()
    ]
    with rules_prometheus(tmp_path, scrape_configs, RULE_SCALE) as prometheus:
        for sender in senders:
            sender.start()
        try:
            deadline = time.monotonic() + FIRING_TIMEOUT_S
            while (alerts := reuse_alerts(prometheus)) != expected_alerts:
                assert not errors, errors
                assert time.monotonic() < deadline, f"alerts {alerts}, figures " + str(
                    {job: figures(prometheus, job) for job in cases}
                )
                time.sleep(1)
            quiet = pending_or_firing(prometheus, "workload")
        finally:
            stop_sending.set()
            for sender in senders:
                sender.join(timeout=40)
        assert not errors, errors
        # Traffic stopped: once Prometheus holds the routers' last counts, one rule evaluation's figures
        # against the replicas' truth for exactly the requests of its window.
        for job, (router, _, _) in cases.items():
            wait_for(partial(scraped_all, prometheus, job, router), f"{job}'s last counts scraped", 30, 0.2)
        at = finished_evaluation(prometheus, SHARE, after=time.time())
        measured = {job: figures(prometheus, job, at) for job in cases}
        windows = {job: window_records(prometheus, job, router, at) for job, (router, _, _) in cases.items()}
    lab = {job: truth(windows[job], cases[job][1]) for job in cases}
    for job, found in measured.items():
        known = lab[job]
        # Where caching is on the router's index is the replicas' own view; where it is off, the router
        # predicts what the replicas no longer hold: the routed leg is the router's prediction.
        expected = {
            "available": known["available"] if job != "engine" else known["routed"],
            "routed": known["routed"],
            "delivered": known["delivered"],
        }
        expected |= {
            "workload": 1 - expected["available"],
            "routing": expected["available"] - expected["routed"],
            "engine": expected["routed"] - expected["delivered"],
        }
        assert found == pytest.approx(expected, abs=TOLERANCE), (job, found, known)
        if job != "engine":
            assert known["routed"] == pytest.approx(known["held by the chosen"], abs=TOLERANCE), (job, known)
    # The faults' shapes: each case's loss is the one its fault makes.
    assert lab["workload"]["available"] < 0.05 and measured["workload"]["workload"] > 0.95
    assert measured["spread"]["routing"] > 0.3 and abs(measured["spread"]["engine"]) < TOLERANCE
    assert measured["engine"]["engine"] > 0.3 and lab["engine"]["delivered"] == 0
    assert quiet == [], "the workload's loss is no routing or engine fault"


@pytest.mark.parametrize(
    ("policy", "causes"),
    [("spread", ["dynamo_session_affinity_off"]), ("cache-aware", [])],
)
def test_the_doctor_names_dynamos_affinity_off_behind_a_router_that_ignores_its_session_header(
    start_replica, start_lab_router, policy, causes
):
    """The lab's router passes X-Dynamo-Session-ID on and places every request by itself, as Dynamo's
    frontend does without --router-session-affinity-ttl-secs; its replicas name themselves in Dynamo's
    `nvext.worker_id`. Spreading, the sessions move and the doctor names the missing flag; placing by
    the cache, they stay and it names nothing."""
    router = start_lab_router(policy, [start_replica("r1"), start_replica("r2")])
    probe = ProbeSettings(router.url, "lab-model", session_key="dynamo", router="dynamo", timeout_seconds=10)
    diagnosis = diagnose(probe)
    hash_key = next(c for c in diagnosis.checks if c.name == "hash key")
    assert diagnosis.causes == causes, diagnosis.checks
    if causes:
        assert "they carried X-Dynamo-Session-ID" in hash_key.evidence, hash_key
        assert hash_key.fix.startswith("start the frontend with `--router-session-affinity-ttl-secs N`")
    else:
        assert hash_key.status == "pass", hash_key
