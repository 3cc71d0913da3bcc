"""kvwatch against real vLLM: two CPU vLLM servers behind the lab's nginx, scraped by its Prometheus.

The truth here is what the engines themselves report: `usage` in their answers, their own counters on
/metrics, and where the gateway log says each request went. Every figure kvwatch shows is compared with
it. The tests run in order: the healthy lab first, then prefix caching switched off on r2 (a restart
with --no-enable-prefix-caching), then healed.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.lab.configs import scale_durations
from kvwatch.prometheus import panel_queries, queries
from labs import VLLM_LAB_RULE_TIME_SCALE, Lab
from processes import http_get, kvwatch, processes_in_group, wait_for

pytestmark = pytest.mark.integration

BLOCK = 128  # vLLM's CPU build; kvwatch must learn it, not be told
WORKLOAD = ("--system-tokens", "300", "--turn-tokens", "100", "--max-tokens", "16")
# The recording rules' rate window in this lab (production's, scaled like the lab's rules).
WINDOW_S = int(scale_durations(queries.WINDOW, VLLM_LAB_RULE_TIME_SCALE).removesuffix("s"))


def counters(url: str) -> dict[str, float]:
    """An engine's own counters, summed over their label sets: {"vllm:prompt_tokens_total": ...}, and
    per source where they have one: {'vllm:prompt_tokens_cached_by_source_total{source="device"}': ...}."""
    text = http_get(f"{url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                by_source = (
                    [f'{sample.name}{{source="{sample.labels["source"]}"}}']
                    if "source" in sample.labels
                    else []
                )
                for name in (sample.name, *by_source):
                    totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def cache_config(url: str) -> dict[str, str]:
    text = http_get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    raise AssertionError(f"{url}/metrics has no vllm:cache_config_info")


def probe(url: str, *options: str) -> dict:
    result = kvwatch("probe", "--base-url", url, "--model", "lab-model", *WORKLOAD, *options, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def prometheus_query(lab: Lab, expr: str, at: float) -> list[dict]:
    response = http_get(
        f"{lab.status['prometheus']}/api/v1/query", params={"query": expr, "time": at}, timeout=10
    )
    response.raise_for_status()
    return response.json()["data"]["result"]


def replica_urls(lab: Lab) -> dict[str, str]:
    return {r["id"]: r["url"] for r in lab.cli("status", "--json").json["replicas"]}


def vllm_processes(leader: int) -> list[str]:
    """The titles vLLM gave the processes it started in the process group of an engine's server."""
    titles = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in processes_in_group(leader)]
    return sorted(title.decode() for title in titles if title.startswith(b"VLLM::"))


def test_lab_serves_real_vllm(vllm_lab: Lab):
    status = vllm_lab.status
    assert status["engine"] == "vllm" and status["model"] == "lab-model"
    for url in replica_urls(vllm_lab).values():
        assert http_get(f"{url}/version", timeout=5).json()["version"] == "0.32.0"
        assert cache_config(url)["block_size"] == str(BLOCK)
        assert cache_config(url)["enable_prefix_caching"] == "True"
    models = http_get(f"{vllm_lab.affinity}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["lab-model"]
    # One engine process each, with the model in it: no worker process to import vLLM a third time.
    for replica in ("r1", "r2"):
        assert vllm_processes(status["processes"][f"replica-{replica}"]) == ["VLLM::EngineCore"], replica


def test_probe_through_affinity_is_sticky_and_reuses_all_it_could(vllm_lab: Lab):
    """With no block-size option: 128 learned from the engine, and on every warm round the engine
    reused exactly the ideal (the previous round's prompt and answer, in whole blocks)."""
    urls = replica_urls(vllm_lab)
    before = {r: counters(u) for r, u in urls.items()}
    report = probe(vllm_lab.affinity, "--sessions", "3", "--rounds", "4")
    after = {r: counters(u) for r, u in urls.items()}

    assert report["block_size"]["tokens"] == BLOCK
    assert report["block_size"]["source"].startswith("vllm:cache_config_info")
    sessions = report["sessions"]
    assert all(s["ok"] and s["sticky"] for s in sessions), [s["backends"] for s in sessions]
    for session in sessions:
        for r in session["rounds"][1:]:
            assert r["ideal_cached_tokens"] > 0 and r["ideal_cached_tokens"] % BLOCK == 0
            assert r["cached_tokens"] == r["ideal_cached_tokens"], session["rounds"]
    # The engines' own counters saw exactly what their answers reported.
    reported = [r for s in sessions for r in s["rounds"]]
    for name, field in (("vllm:prompt_tokens_total", "prompt_tokens"),
                        ("vllm:prompt_tokens_cached_total", "cached_tokens")):  # fmt: skip
        moved = sum(after[r][name] - before[r][name] for r in urls)
        assert moved == sum(r[field] for r in reported), name
    # And the gateway log agrees on where each session went.
    by_session: dict[str, set[str]] = {}
    for line in vllm_lab.access_log("affinity"):
        if line["request"] == "POST /v1/chat/completions":
            by_session.setdefault(line["session_id"], set()).add(line["upstream_addr"])
    for session in sessions:
        assert by_session[session["session_id"]] == set(session["backends"])


def test_probe_through_round_robin_is_not_sticky(vllm_lab: Lab):
    report = probe(vllm_lab.round_robin, "--sessions", "2", "--rounds", "4")
    sessions = report["sessions"]
    assert all(s["ok"] for s in sessions)
    assert all(s["sticky"] is False and s["backend_switches"] >= 2 for s in sessions), sessions
    assert len({b for s in sessions for b in s["backends"]}) == 2


def test_scrape_reads_the_real_engines(vllm_lab: Lab):
    urls = replica_urls(vllm_lab)
    result = kvwatch("scrape", *(f"{u}/metrics" for u in urls.values()), "--json")
    assert result.returncode == 0, result.stderr
    for shown, url in zip(json.loads(result.stdout), urls.values(), strict=True):
        raw = counters(url)
        assert shown["flavour"] == "vllm" and shown["error"] is None and shown["missing"] == []
        assert shown["prefix_caching_enabled"] is True
        assert shown["prompt_tokens"] == raw["vllm:prompt_tokens_total"]
        assert shown["cached_tokens"] == raw["vllm:prompt_tokens_cached_total"]
        assert shown["hit_ratio"] == pytest.approx(
            raw["vllm:prompt_tokens_cached_total"] / raw["vllm:prompt_tokens_total"]
        )


def test_doctor_names_the_hash_key_through_round_robin(vllm_lab: Lab):
    result = kvwatch("doctor", "--base-url", vllm_lab.round_robin, "--model", "lab-model", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "hash_key_not_session" in json.loads(result.stdout)["causes"]


def _quiet_since(urls: dict[str, str], seconds: float) -> float:
    """Wait until no engine has counted a prompt token for `seconds`; return since when."""
    level, since = None, time.time()
    deadline = time.monotonic() + 2 * WINDOW_S + 60
    while time.monotonic() < deadline:
        now = {r: counters(u)["vllm:prompt_tokens_total"] for r, u in urls.items()}
        if now != level:
            level, since = now, time.time()
        elif time.time() - since >= seconds:
            return since
        time.sleep(0.5)
    raise AssertionError(f"the engines never stayed idle for {seconds} s")


def _burst(lab: Lab, conversations: int) -> tuple[float, float, float, dict[str, dict[str, float]]]:
    """Two-round conversations sent to every engine directly, after a quiet spell; returns when the
    quiet began, when the burst started and ended, and how much each engine's counters moved in it."""
    urls = replica_urls(lab)
    quiet = _quiet_since(urls, WINDOW_S - 5)
    before = {r: counters(u) for r, u in urls.items()}
    started = time.time()
    for url in urls.values():
        probe(url, "--sessions", str(conversations), "--rounds", "2", "--seed", str(time.time_ns()))
    ended = time.time()
    after = {r: counters(u) for r, u in urls.items()}
    return (
        quiet,
        started,
        ended,
        {r: {n: v - before[r].get(n, 0.0) for n, v in after[r].items()} for r in urls},
    )


# Each ratio kvwatch shows per instance and for the cluster, with the engine counters it stands for:
# (per-instance query, cluster query, labels of the series, hit counter, total counter).
RATIOS = {
    "delivered": (panel_queries.HIT_RATIO_BY_INSTANCE, queries.CLUSTER_HIT_RATIO, {},
                  "vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_total"),
    "local lookups": (panel_queries.LOCAL_HIT_RATIO_BY_INSTANCE, queries.CLUSTER_LOCAL_HIT_RATIO, {},
                      "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    "cached on the device": (
        panel_queries.CACHED_SHARE_BY_SOURCE, panel_queries.CLUSTER_CACHED_SHARE_BY_SOURCE,
        {"source": "device"},
        'vllm:prompt_tokens_cached_by_source_total{source="device"}', "vllm:prompt_tokens_total",
    ),
}  # fmt: skip


def _truth(moved: dict[str, dict[str, float]], hit: str, total: str) -> dict[str, float]:
    """Each engine's hits over its total in the burst, and the cluster's; an engine that counted no
    total (vLLM with caching off looks nothing up) has none and is left out of the cluster's."""
    counted = {r: m for r, m in moved.items() if m.get(total, 0) > 0}
    truth = {r: m.get(hit, 0.0) / m[total] for r, m in counted.items()}
    truth["cluster"] = sum(m.get(hit, 0.0) for m in counted.values()) / sum(
        m[total] for m in counted.values()
    )
    return truth


def _evaluation_after(lab: Lab, quiet: float, started: float, ended: float) -> float:
    """The first evaluation of the rules that saw the engines' counters after the burst (a scrape
    every second) and whose window begins in the quiet before it, so that the window's increase is
    the burst's and nothing else."""

    def evaluated_at(moment: float) -> float | None:
        found = prometheus_query(lab, f"timestamp({queries.CLUSTER_HIT_RATIO})", moment)
        return float(found[0]["value"][1]) if found else None

    first = max(ended + 2.5, quiet + WINDOW_S + 1)
    for moment in range(math.ceil(first), math.floor(started - 2 + WINDOW_S)):
        wait_for(lambda m=moment: (evaluated_at(time.time()) or 0) > m, "the rules evaluated", timeout=30)
        at = evaluated_at(moment)
        if at is not None and at > ended + 2:
            return at
    raise AssertionError(f"no evaluation after the burst ({ended - started:.0f} s) within {WINDOW_S} s")


def _shown(lab: Lab, at: float, per_instance: str, cluster: str, labels: dict) -> dict[str, float]:
    """A ratio as the pages and boards show it at `at`, per replica and for the cluster."""
    port_of = {f"127.0.0.1:{r['url'].rsplit(':', 1)[1]}": r["id"] for r in lab.status["replicas"]}

    def values(expr: str) -> list[tuple[dict, float]]:
        expr = panel_queries.fill_variables(expr, window=f"{WINDOW_S}s", time_range=f"{WINDOW_S}s")
        found = prometheus_query(lab, expr, at)
        return [(s["metric"], float(s["value"][1])) for s in found if labels.items() <= s["metric"].items()]

    shown = {port_of[metric["instance"]]: value for metric, value in values(per_instance)}
    ((_, shown["cluster"]),) = values(cluster)
    return shown


def _assert_ratios_are_the_engines(lab: Lab) -> dict[str, dict[str, float]]:
    """Every ratio, at an evaluation whose window holds the whole burst, within 0.02 of the engines'
    own counters over the burst; returns the truths."""
    quiet, started, ended, moved = _burst(lab, conversations=2)
    at = _evaluation_after(lab, quiet, started, ended)
    truths = {}
    for name, (per_instance, cluster, labels, hit, total) in RATIOS.items():
        truth = truths[name] = _truth(moved, hit, total)
        shown = _shown(lab, at, per_instance, cluster, labels)
        assert shown.keys() == truth.keys(), (name, shown, truth)
        for key, value in truth.items():
            assert shown[key] == pytest.approx(value, abs=0.02), (name, key, shown, truth)
            assert 0 <= shown[key] <= 1, (name, key, shown)
    return truths


def test_recording_rules_equal_the_engines_counters(vllm_lab: Lab):
    truths = _assert_ratios_are_the_engines(vllm_lab)
    assert truths["delivered"]["cluster"] > 0.3  # real reuse, so the comparison means something


# --- prefix caching off on r2 ----------------------------------------------------------------------


def test_disable_prefix_cache_restarts_the_engine_without_caching(vllm_lab: Lab):
    result = vllm_lab.cli("fault", "disable-prefix-cache", "--replica", "r2")
    assert result.returncode == 0, result.stderr
    assert "--no-enable-prefix-caching" in result.stdout
    url = replica_urls(vllm_lab)["r2"]
    # The fault returned only once the restarted engine serves.
    assert cache_config(url)["enable_prefix_caching"] == "False"
    (r2,) = [r for r in vllm_lab.cli("status", "--json").json["replicas"] if r["id"] == "r2"]
    assert r2["prefix_caching"] is False and r2["url"]
    report = probe(url, "--sessions", "1", "--rounds", "3")
    assert [r["cached_tokens"] for r in report["sessions"][0]["rounds"]] == [0, 0, 0]


def test_scrape_says_caching_is_off(vllm_lab: Lab):
    result = kvwatch("scrape", f"{replica_urls(vllm_lab)['r2']}/metrics", "--json")
    (shown,) = json.loads(result.stdout)
    assert shown["prefix_caching_enabled"] is False
    assert shown["cached_tokens"] == 0 and shown["prompt_tokens"] > 0
    assert shown["hit_ratio"] == 0


def test_cluster_hit_ratio_counts_the_uncached_engine_as_zero(vllm_lab: Lab):
    """vLLM stops counting prefix-cache lookups when caching is off; the delivered ratio still counts
    r2's prompt tokens, so the cluster figure is the cluster's real reuse, and r2 drops out of the
    lookup ratio."""
    truths = _assert_ratios_are_the_engines(vllm_lab)
    assert truths["delivered"]["r2"] == 0 and truths["delivered"]["r1"] > 0.3
    assert "r2" not in truths["local lookups"]


def test_doctor_names_prefix_caching_disabled(vllm_lab: Lab):
    result = kvwatch("doctor", "--base-url", vllm_lab.affinity, "--model", "lab-model",
                     "--prometheus", vllm_lab.status["prometheus"], "--json")  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert "prefix_cache_disabled" in report["causes"]
    (check,) = [c for c in report["checks"] if c["name"] == "prefix caching"]
    assert replica_urls(vllm_lab)["r2"].removeprefix("http://") in check["evidence"]


def test_prefix_caching_disabled_alert_fires_for_that_engine_only(vllm_lab: Lab):
    """What reaches the on-call engineer: Alertmanager's alerts that no other alert explains."""
    r2 = replica_urls(vllm_lab)["r2"].removeprefix("http://")
    url = f"{vllm_lab.status['alertmanager']}/api/v2/alerts"

    def active() -> list[dict]:
        params = {"active": "true", "silenced": "false", "inhibited": "false"}
        return http_get(url, params=params, timeout=5).json()

    found = wait_for(
        lambda: [a for a in active() if a["labels"]["alertname"] == "KVWatchPrefixCachingDisabled"],
        "KVWatchPrefixCachingDisabled at Alertmanager",
        timeout=90,
    )
    assert {a["labels"]["instance"] for a in found} == {r2}
    others = {a["labels"]["alertname"] for a in active()} - {"KVWatchPrefixCachingDisabled", "Watchdog"}
    assert not others, others


def test_heal_restarts_the_engine_with_caching(vllm_lab: Lab):
    result = vllm_lab.cli("heal")
    assert result.returncode == 0, result.stderr
    url = replica_urls(vllm_lab)["r2"]
    assert cache_config(url)["enable_prefix_caching"] == "True"
    report = probe(url, "--sessions", "1", "--rounds", "3")
    rounds = report["sessions"][0]["rounds"]
    assert [r["cached_tokens"] == r["ideal_cached_tokens"] for r in rounds[1:]] == [True, True]


def test_no_hit_ratio_above_one_since_the_lab_started(vllm_lab: Lab):
    """Over the lab's start-up and r2's two restarts (counters from zero, series that begin at other
    moments), no recorded hit ratio ever read above 1."""
    lifetime = f"{math.ceil(time.time() - vllm_lab.started_at) + 60}s"
    for ratio in (queries.INSTANCE_HIT_RATIO, queries.CLUSTER_HIT_RATIO, queries.LOCAL.instance_ratio):
        found = prometheus_query(vllm_lab, f"max(max_over_time({ratio}[{lifetime}]))", time.time())
        assert found, f"{ratio} was never recorded"
        assert 0 < float(found[0]["value"][1]) <= 1, (ratio, found)
