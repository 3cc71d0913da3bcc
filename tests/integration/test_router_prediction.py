"""Predicted against delivered reuse with real processes: routers' recorded expositions replayed over
HTTP, a lab replica with prefix caching off, and a real Prometheus running kvwatch's generated rules,
until KVWatchRouterPredictionMiss fires; then the overview board's router panels show what those series
imply."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from loopback import QuietHandler, loopback_http

from kvwatch.alerts.verdicts import FIRING, ROUTER_PREDICTION_MISS
from kvwatch.collectors.engines.base import COUNT_SUFFIXES
from kvwatch.grafana import panels, routers
from kvwatch.lab.components import prometheus_process
from kvwatch.lab.configs import rule_files
from kvwatch.lab.state import LabState
from kvwatch.prometheus import panel_queries, queries
from paths import TESTDATA
from processes import free_base_port, http_get, stop, wait_http

ROUTERS = TESTDATA / "routers"
# Served at these paths by one replay server: llm-d's EPP predicts, SMG's manual policy counts its sticky
# decisions, its cache_aware policy (captured from the real SMG) its tree matches, and predicts too.
ROUTER_EXPOSITIONS = {
    "/metrics": ROUTERS / "llm-d-epp-0.10.prom",
    "/smg/metrics": ROUTERS / "smg-1.13.prom",
    "/smg-cache-aware/metrics": ROUTERS / "smg-1.13-cache-aware.prom",
}
PREDICTING = {"router", "smg-cache-aware"}  # the jobs whose predictions the engine does not deliver
RULE_TIME_SCALE = 0.05  # 2m rate windows take 6 s, the alert's 5m `for` 15 s
FIRING_TIMEOUT_S = 90.0
GROWING = (*COUNT_SUFFIXES, "_sum")  # counts, and the sums of histograms of non-negative values
# What the alert compares, shown when it does not fire.
RECORDED = (
    queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO,
    queries.INSTANCE_ROUTER_PREDICTIONS,
    queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED,
    queries.CLUSTER_HIT_RATIO,
    f"sum({queries.INSTANCE_PROMPT_TOKENS})",
)


def replayed(text: str, seconds: float) -> str:
    """The exposition `seconds` into a steady replay: every count grows by its recorded value per second."""

    def advance(line: str) -> str:
        series, _, value = line.rpartition(" ")
        if line.startswith("#") or not series.partition("{")[0].endswith(GROWING):
            return line
        return f"{series} {float(value) * seconds}"

    return "\n".join(map(advance, text.splitlines())) + "\n"


@pytest.fixture
def router_replay() -> Iterator[str]:
    """The hand-written router expositions served over loopback, their counters growing with time."""
    texts, started = {path: file.read_text() for path, file in ROUTER_EXPOSITIONS.items()}, time.monotonic()

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            body = replayed(texts[self.path], time.monotonic() - started).encode()
            self.answer(200, body, "text/plain; version=0.0.4")

    with loopback_http(Handler) as url:
        yield url.removeprefix("http://")


def test_replayed_counters_grow_at_their_recorded_rate():
    text = '# TYPE a_total counter\na_total 3\nb_bucket{le="1"} 2\nb_sum 1.5\ngauge 7\n'
    expected = '# TYPE a_total counter\na_total 30.0\nb_bucket{le="1"} 20.0\nb_sum 15.0\ngauge 7\n'
    assert replayed(text, 10) == expected


@contextmanager
def rules_prometheus(
    tmp_path: Path, scrape_configs: list[dict], scale: float = RULE_TIME_SCALE
) -> Iterator[str]:
    """A real Prometheus scraping `scrape_configs` every second and running kvwatch's generated rules and
    alerts, time-scaled by `scale`: its URL, until the block ends."""
    state = LabState(tmp_path, free_base_port(), rule_time_scale=scale)
    (tmp_path / "rules").mkdir()
    for name, text in rule_files(state).items():
        (tmp_path / "rules" / name).write_text(text)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules" / "*.yml")],
        "scrape_configs": scrape_configs,
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    process = prometheus_process(state)
    log = tmp_path / "prometheus.log"
    with log.open("w") as out:
        prometheus = subprocess.Popen(process.argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(process.ready_url, prometheus, log)
        yield process.ready_url.removesuffix("/-/ready")
    finally:
        stop(prometheus)


def firing(prometheus: str, alertname: str) -> list[dict]:
    answer = http_get(f"{prometheus}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return [a for a in answer if a["labels"]["alertname"] == alertname and a["state"] == "firing"]


def value(prometheus: str, expr: str) -> float | None:
    result = http_get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5).json()["data"][
        "result"
    ]
    return float(result[0]["value"][1]) if result else None


def router_panel_queries() -> set[str]:
    """The queries of the overview's router row and of its router verdict panel."""
    layout = panels.Layout()
    routers.router_row(layout)
    row = {t["expr"] for panel in layout.panels for t in panel.get("targets", [])}
    return row | {ROUTER_PREDICTION_MISS.state}


def panel_values(prometheus: str, expr: str) -> dict[str, float]:
    """A panel query's values now, with the board's variables matching everything, by job."""
    expr = panel_queries.fill_variables(expr, window="30s", time_range="5m")
    result = http_get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5).json()["data"][
        "result"
    ]
    return {r["metric"].get("job", "cluster"): float(r["value"][1]) for r in result}


@pytest.mark.integration
def test_a_router_predicting_hits_on_an_engine_without_caching_fires_prediction_miss(
    start_replica, router_replay, tmp_path: Path
):
    replica = start_replica("r1", "vllm", "--time-scale", "0.05", "--answer-tokens", "4")
    replica.set_faults(prefix_caching=False).raise_for_status()

    scrape_configs = [
        {"job_name": "router", "static_configs": [{"targets": [router_replay]}]},
        *(
            {
                "job_name": job,
                "metrics_path": f"/{job}/metrics",
                "static_configs": [{"targets": [router_replay]}],
            }
            for job in ("smg", "smg-cache-aware")
        ),
        {"job_name": "replicas", "static_configs": [{"targets": [f"127.0.0.1:{replica.port}"]}]},
    ]
    with rules_prometheus(tmp_path, scrape_configs) as url:
        body = {
            "model": "lab-model",
            "messages": [{"role": "user", "content": "What did we cover so far? " * 20}],
        }
        deadline = time.monotonic() + FIRING_TIMEOUT_S
        with httpx.Client(base_url=replica.url, timeout=10) as client:
            while {a["labels"]["job"] for a in firing(url, "KVWatchRouterPredictionMiss")} != PREDICTING:
                assert time.monotonic() < deadline, f"not firing within {FIRING_TIMEOUT_S} s: " + str(
                    {rule: value(url, rule) for rule in RECORDED}
                )
                for _ in range(3):  # the engine's traffic: well above the alert's prompt-token floor
                    client.post("/v1/chat/completions", json=body).raise_for_status()
                time.sleep(0.2)
        # The replayed indexer predicts 8 of every 10 lookups, SMG's tree matched 83 % of each prompt;
        # the engine computed every prompt token.
        smg_predicted = 15.012345679012352 / 18
        assert value(url, queries.CLUSTER_HIT_RATIO) == 0
        # The board's router panels and verdict, as Grafana would ask, per job (one instance each).
        expected = {
            queries.INSTANCE_ROUTER_PREDICTED_HIT_RATIO: {"router": 0.8, "smg-cache-aware": smg_predicted},
            panel_queries.HIT_RATIO_BY_INSTANCE: {"replicas": 0},
            queries.CLUSTER_HIT_RATIO: {"cluster": 0},
            queries.INSTANCE_ROUTER_DELIVERED_PER_PREDICTED: {"router": 0, "smg-cache-aware": 0},
            queries.INSTANCE_ROUTER_PIN_KEPT: {"smg": 6 / 7},  # 6 kept their worker, 1 moved
            queries.INSTANCE_ROUTER_PREFIX_MATCH_DECISIONS: {"smg-cache-aware": 15 / 18},  # 3 by wait
            queries.INSTANCE_ROUTER_FALLBACKS: {},  # AIBrix's: no AIBrix among the replayed routers
            ROUTER_PREDICTION_MISS.state: dict.fromkeys(PREDICTING, FIRING),
        }
        assert set(expected) == router_panel_queries()
        for expr, by_job in expected.items():
            assert panel_values(url, expr) == pytest.approx(by_job), expr
