"""kvwatch's reuse judgment on two real vLLM instances behind the lab's SageMaker front, through the real
AWS SDK (botocore): with the front ignoring session ids, every warm round caches exactly what the instance
the front chose holds of that session's own history (each session's marker keeps the others' cached
prompts out), as vLLM counts it, so the reuse drops and every session is judged not sticky; healed, every
session is sticky again. End to end, `kvwatch serve` probing the endpoint, the lab's Prometheus and
Alertmanager: KVWatchSessionReuseLost fires on the share of sessions that lost their reuse, whatever the
warm rounds' reuse (about three quarters here, which its description gives), and resolves once healed;
KVWatchSessionAffinityBroken never fires. And the article's experiment, sessions against none, on the
same two instances.
In the real-vLLM lane of `make test` (scripts/test.sh)."""

from __future__ import annotations

import contextlib
import math
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sagemaker_client as sagemaker
import yaml

from kvwatch.core.promapi import PrometheusApi
from kvwatch.lab.gateways.sagemaker import LAB_REGION
from kvwatch.prometheus import queries
from kvwatch.prometheus.thresholds import THRESHOLDS
from kvwatch.store.history import Store
from labs import VLLM_LAB_START_TIMEOUT_S, Lab, start_vllm_sagemaker_lab, stop_lab_serve
from processes import http_get, kvwatch, launch, stop, wait_for

BLOCK = 128  # the lab's vLLM KV block
WORKLOAD = ("--system-tokens", "300", "--turn-tokens", "100", "--max-tokens", "16")
# kvwatch serve's probe of the endpoint: three sessions of four rounds each run, every 15 s (back to back
# on a busy machine). With each round on a random instance, a session stays on one with a chance of 1 in
# 8, so a run has two sticky sessions of three (the share at the alert's floor) with a chance of 1 in 23.
PROBE = {"sessions_per_run": 3, "rounds": 4, "interval_seconds": 15,
         "workload": {"system_tokens": 300, "turn_tokens": 100, "max_tokens": 16}}  # fmt: skip
WAIT_S = 600  # a run of twelve rounds takes about a minute on a busy 2-core machine
# Each test may be the one that starts the lab, and the alert's waits for a fire and a resolution.
pytestmark = pytest.mark.timeout(VLLM_LAB_START_TIMEOUT_S + 2 * WAIT_S + 300)
HITS = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", re.MULTILINE)


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch, tmp_path):
    sagemaker.use_lab_credentials(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def two_instances(tmp_path_factory) -> Iterator[Lab]:
    """Two real vLLM instances with stateful sessions behind the front, no serve probing: the only
    traffic is the test's (or a test's own serve's)."""
    lab = start_vllm_sagemaker_lab(
        tmp_path_factory.mktemp("vllm-sagemaker-two") / "state", 2, "--sagemaker-routing", "RANDOM"
    )  # requests without a session: on an instance at random, as SageMaker's default routing
    yield lab
    lab.stop()


def cache_hits(lab: Lab) -> float:
    """The tokens all instances served from their prefix caches so far, by vLLM's own counter."""
    found = [HITS.search(http_get(f"{r['url']}/metrics", timeout=10).text) for r in lab.status["replicas"]]
    assert all(found), "vllm:prefix_cache_hits_total missing"
    return sum(float(match.group(1)) for match in found)


def expected_cached(lab: Lab, session: dict) -> list[int]:
    """Each round's cached tokens as the front's routing and the session's own history make them: what
    the instance the front sent the round to kept of the session's earlier rounds there (prompt and
    answer, in whole blocks), at most the round's prompt less its last token."""
    served = [e["upstream_addr"] for e in sagemaker.rounds_of(lab, session["session_id"], 200)]
    assert len(served) == len(session["rounds"]), (served, session)
    held: dict[str, int] = {}
    expected = []
    for instance, r in zip(served, session["rounds"], strict=True):
        expected.append(min(held.get(instance, 0), (r["prompt_tokens"] - 1) // BLOCK * BLOCK))
        kept = (r["prompt_tokens"] + r["completion_tokens"]) // BLOCK * BLOCK
        held[instance] = max(held.get(instance, 0), kept)
    return expected


def test_with_session_ids_ignored_each_round_reuses_only_what_its_instance_kept(two_instances: Lab):
    lab = two_instances
    sagemaker.fault(lab, "ignore-session-ids")
    try:
        before = cache_hits(lab)
        report, result = sagemaker.probe_json(lab, "--sessions", "6", "--rounds", "4", *WORKLOAD, timeout=600)
        sessions = report["sessions"]
        assert all(s["rounds"] and all(r["error"] is None for r in s["rounds"]) for s in sessions), report
        cached = [[r["cached_tokens"] for r in s["rounds"]] for s in sessions]
        total = sum(map(sum, cached))  # vLLM's counter moves with its engine loop, just after the answers
        (counted,) = wait_for(
            lambda: (hits := cache_hits(lab) - before) >= total and (hits,), "vLLM's counted hits", 30
        )
        assert counted == total, (counted, cached)
        assert cached == [expected_cached(lab, s) for s in sessions], sessions
        warm = [r for s in sessions for r in s["rounds"][1:]]
        reuse = sum(r["cached_tokens"] for r in warm) / sum(r["ideal_cached_tokens"] for r in warm)
        assert reuse < 1, warm
        # Sticky only when all its rounds stayed on one instance: a chance of 1 in 8 each, 1 in 8^6 for all.
        for session in sessions:
            instances = {e["upstream_addr"] for e in sagemaker.rounds_of(lab, session["session_id"], 200)}
            assert (session["evidence"], session["sticky"]) == ("reuse", len(instances) == 1), session
        assert not all(s["sticky"] for s in sessions), sessions
    finally:
        assert lab.cli("heal").returncode == 0
    report, result = sagemaker.probe_json(lab, "--sessions", "2", "--rounds", "3", *WORKLOAD, timeout=600)
    assert result.returncode == 0, result.stderr
    sagemaker.assert_sticky_by_reuse(report, block=BLOCK)


@contextlib.contextmanager
def serving(lab: Lab, directory: Path) -> Iterator[None]:
    """`kvwatch serve` probing the endpoint through botocore (PROBE), in place of the lab's own (which
    probes nothing), on the lab's exporter address: the lab's Prometheus scrapes it and Alertmanager's
    webhook calls it, with the lab's config otherwise."""
    config = yaml.safe_load((lab.state_dir / "kvwatch.yaml").read_text())
    endpoint = {"endpoint_name": sagemaker.ENDPOINT, "region": LAB_REGION, "endpoint_url": lab.affinity}
    model = lab.status.get("model", sagemaker.MODEL)
    config["targets"] = [
        {"name": "lab-affinity", "kind": "sagemaker", "model": model, "route_mode": "affinity",
         "sagemaker": endpoint, **PROBE}
    ]  # fmt: skip
    path = directory / "kvwatch.yaml"
    path.write_text(yaml.safe_dump(config))
    stop_lab_serve(lab)
    argv = [sys.executable, "-m", "kvwatch.cli.main", "serve", "--config", str(path)]
    process = launch(argv, directory / "serve.log", f"{lab.status['exporter']}/-/healthy", timeout=120)
    try:
        yield
    finally:
        stop(process)


def described(alert: dict) -> tuple[float, float]:
    """The share of sessions and the warm reuse KVWatchSessionReuseLost's description gives, as ratios."""
    found = re.match(
        r"Only ([\d.]+)% of the last probe run's sessions through lab-affinity reused their history in "
        r"every warm round, and their warm rounds had ([\d.]+)% of the tokens a pinned session holds "
        r"cached: ",
        alert["annotations"]["description"],
    )
    assert found, alert["annotations"]
    return float(found[1]) / 100, float(found[2]) / 100


def held_by_prometheus(lab: Lab, since: float) -> set[tuple[float, float]]:
    """The (share of sessions, warm reuse) pairs the lab's Prometheus held for the route since `since`."""
    api = PrometheusApi(lab.status["prometheus"], 10)
    shares, reuses = (
        {at: float(v) for one in api.query_range(expr, since, time.time(), 1) for at, v in one["values"]}
        for expr in (queries.REUSED_SESSIONS_RATIO, queries.WARM_REUSE_RATIO)
    )
    return {(shares[at], reuses[at]) for at in shares.keys() & reuses.keys()}


def assert_judged_as_routed(lab: Lab, since: float, until: float) -> int:
    """Each session kvwatch serve stored between those times is sticky exactly when the front sent all
    its rounds to one instance (the front's access log); how many sessions were not."""

    def stored() -> list[dict]:
        with Store(lab.state_dir / "kvwatch.db", readonly=True) as store:
            found = store.sessions(target="lab-affinity", since=since)
        done = [s for s in found if s["finished_at"] <= until and not (s["in_flight"] or s["interrupted"])]
        return done if len(done) >= PROBE["sessions_per_run"] else []  # a whole run, stored after it

    judged = [s for s in wait_for(stored, "a run's sessions in the store", 60) if s["warm_rounds"]]
    assert judged
    for session in judged:
        served = sagemaker.rounds_of(lab, session["session_id"], 200)
        assert len(served) == PROBE["rounds"], (session, served)
        stayed = len({e["upstream_addr"] for e in served}) == 1
        assert (session["evidence"], session["sticky"]) == ("reuse", stayed), (session, served)
    return sum(not s["sticky"] for s in judged)


def test_with_session_ids_ignored_the_reuse_alert_fires_alone_and_resolves_once_healed(
    two_instances: Lab, tmp_path
):
    lab, since = two_instances, time.time()
    prometheus = PrometheusApi(lab.status["prometheus"], 10)
    sagemaker.fault(lab, "ignore-session-ids")
    try:
        with serving(lab, tmp_path):
            (alert,) = wait_for(
                lambda: sagemaker.active_alerts(lab, "KVWatchSessionReuseLost"),
                "ReuseLost at Alertmanager",
                WAIT_S,
            )
            fired_at = time.time()
            assert (alert["labels"]["target"], alert["labels"]["severity"]) == ("lab-affinity", "critical")
            share, reuse = described(alert)
            assert share < THRESHOLDS.sticky_ratio_below, alert["annotations"]
            held = held_by_prometheus(lab, since)
            assert any(math.isclose(share, s, abs_tol=1e-4) and math.isclose(reuse, r, abs_tol=1e-4)
                       for s, r in held), (share, reuse, held)  # fmt: skip
            assert lab.cli("heal").returncode == 0
            assert assert_judged_as_routed(lab, since, fired_at) > 0
            wait_for(
                lambda: not sagemaker.active_alerts(lab, "KVWatchSessionReuseLost"),
                "ReuseLost resolved",
                WAIT_S,
            )
            (now,) = prometheus.query(queries.REUSED_SESSIONS_RATIO)
            assert float(now["value"][1]) >= THRESHOLDS.sticky_ratio_below, now  # healthy runs resolved it
            never = 'ALERTS{alertname="KVWatchSessionAffinityBroken", target="lab-affinity"}'
            assert prometheus.query_range(never, since, time.time(), 1) == []
            assert sagemaker.active_alerts(lab, "KVWatchSessionAffinityBroken") == []
            print(f"ReuseLost fired {fired_at - since:.0f} s after the fault with {share:.0%} of sessions "
                  f"and {reuse:.0%} warm reuse; resolved {time.time() - fired_at:.0f} s after")  # fmt: skip
    finally:
        assert lab.cli("heal").returncode == 0


def test_experiment_sessions_against_no_sessions_on_real_vllm_gives_the_articles_table(
    two_instances: Lab, tmp_path
):
    """The article's A/B on SageMaker, on real vLLM: the same seeded conversations with SessionIds and
    without. With sessions every warm round reuses its whole history (every session sticky by reuse);
    without, each round lands on an instance at random and reuses only what that instance kept, so no
    round of the sessions' arm caches less than the same round without."""
    lab, out = two_instances, tmp_path / "experiment"
    result = kvwatch(
        "experiment", *sagemaker.endpoint(lab.affinity, lab.status.get("model", sagemaker.MODEL)),
        "--out", str(out), "--sessions", "3", "--rounds", "3", *WORKLOAD, "--seed", "7", timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows, routes = sagemaker.experiment_tables(out, sessions=3, rounds=3)
    assert all(float(r["ttft_median_seconds"]) > 0 for r in rows.values()), rows
    for number in (2, 3):
        with_sessions, without = rows["session", number], rows["no_session", number]
        assert with_sessions["cached_tokens"] == with_sessions["ideal_cached_tokens"], (number, rows)
        assert int(with_sessions["cached_tokens"]) >= int(without["cached_tokens"]), (number, rows)
    assert float(routes["session"]["sticky_share"]) == 1.0, routes
    report = (out / "report.md").read_text()
    assert "seed 7" in report and "no_session" in report, report
