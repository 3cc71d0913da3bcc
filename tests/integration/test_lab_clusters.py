"""Two lab clusters feeding one central Prometheus, as Thanos Receive or Mimir users run kvwatch: each
cluster's Prometheus agent remote-writes with its cluster's name as an external label, the central one
evaluates kvwatch's rules and alerts the one Alertmanager, which sends to both clusters' kvwatch. A fault
in cluster a alerts for a only, and each cluster's hit ratio is its own replicas' ground truth, with
prefix caching off on one of a's replicas so that the two clusters' ratios are far apart and a ratio
taking in the other cluster's tokens would show it.

The lab runs with --fast (1 s scrapes and rule evaluations, probes every 5 s) and --rule-time-scale 0.1.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from test_alerts_lab import received, wait_for
from test_rules_lab import Served, Window, reuse

from kvwatch.lab.configs import scale_durations
from kvwatch.lab.state import CLUSTER_PORT_STRIDE
from kvwatch.prometheus import queries
from labs import Lab, kill_lab_processes, wait_until_recorded
from processes import free_base_port, http_get, kvwatch

pytestmark = pytest.mark.integration

RULE_TIME_SCALE = 0.1
WINDOW_S = int(scale_durations(queries.WINDOW, RULE_TIME_SCALE).removesuffix("s"))
# A 12 s window holds a third of the requests of test_rules_lab's 30 s one, so each request rate() misses
# or takes in at its edges weighs about three times as much; the remote-written samples arrive within a
# second, as late as a scrape.
TOLERANCE = 0.08
ALERT = "KVWatchSessionAffinityBroken"
LAB_OPTIONS = ("--clusters", "2", "--fast", "--no-dashboard", "--replicas", "2", "--users", "2", "--think",
               "0.2", "--time-scale", "0.1", "--rule-time-scale", str(RULE_TIME_SCALE))  # fmt: skip


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Iterator[Lab]:
    """The central lab, started with `kvwatch lab up --clusters 2` on a block of ports with room for both
    clusters."""
    state_dir = tmp_path_factory.mktemp("clusters") / "state"
    base = free_base_port(span=3 * CLUSTER_PORT_STRIDE)
    try:
        result = kvwatch("lab", "up", "--detach", "--base-port", str(base), "--state-dir", str(state_dir),
                         *LAB_OPTIONS, timeout=300)  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"kvwatch lab up --clusters 2 failed:\n{result.stdout}\n{result.stderr}")
    except BaseException:  # a timed-out `lab up` leaves what it started running
        kill_lab_processes(state_dir)
        raise
    central = Lab(state_dir, base)
    yield central
    central.stop()


@pytest.fixture(scope="module")
def clusters(lab) -> dict[str, Lab]:
    """Each cluster as a lab of its own: its status, its kvwatch store."""
    return {
        name: Lab(lab.state_dir / name, lab.base_port + CLUSTER_PORT_STRIDE * (index + 1))
        for index, name in enumerate(("a", "b"))
    }


@pytest.fixture(scope="module")
def broken_since(lab) -> float:
    """When affinity broke in cluster a; it stays broken until test_heal_resolves_cluster_as_alert."""
    since = time.time()
    result = lab.cli("fault", "break-affinity", "--cluster", "a")
    assert result.returncode == 0, result.stderr
    return since


@pytest.fixture(scope="module")
def caching_off_since(lab, broken_since) -> float:
    """When one of cluster a's two replicas stopped caching; test_heal_resolves_cluster_as_alert heals it."""
    since = time.time()
    result = lab.cli("fault", "disable-prefix-cache", "--replica", "r1", "--cluster", "a")
    assert result.returncode == 0, result.stderr
    return since


def central_query(lab: Lab, expr: str) -> list[dict]:
    answer = http_get(f"{lab.status['prometheus']}/api/v1/query", params={"query": expr}, timeout=10).json()
    return answer["data"]["result"]


def test_status_shows_the_central_urls_and_each_clusters(lab, clusters):
    assert lab.status["prometheus"] == f"http://127.0.0.1:{lab.base_port + 2}"
    assert lab.status["alertmanager"] == f"http://127.0.0.1:{lab.base_port + 3}"
    assert lab.status["clusters"]["a"] == clusters["a"].status
    b = clusters["b"].status
    assert b["cluster"] == "b" and b["alertmanager"] is None
    assert b["gateways"]["affinity"] == f"http://127.0.0.1:{lab.base_port + 2 * CLUSTER_PORT_STRIDE}"
    assert http_get(f"{b['prometheus']}/-/ready").text.startswith("Prometheus Agent is Ready")


def test_break_affinity_in_cluster_a_alerts_for_a_only_everywhere(lab, clusters, broken_since):
    fired = wait_for(clusters["a"], broken_since, ALERT, "firing", cluster="a", target="lab-affinity")
    assert fired["labels"]["cluster"] == "a"
    span = f"{round(time.time() - broken_since) + 1}s"
    firing = central_query(lab, f'max by (cluster) (max_over_time(ALERTS{{alertname="{ALERT}"}}[{span}]))')
    assert [s["metric"] for s in firing] == [{"cluster": "a"}]
    alerts = http_get(
        f"{lab.status['alertmanager']}/api/v2/alerts", params={"filter": f'alertname="{ALERT}"'}
    ).json()
    assert {a["labels"].get("cluster") for a in alerts} == {"a"}
    # Both clusters' kvwatch took every alert of the window, and none for cluster b.
    for cluster in clusters.values():
        stored = {
            a["labels"].get("cluster") for a in received(cluster, broken_since) if a["alertname"] == ALERT
        }
        assert stored == {"a"}
    # Cluster b's probes ran through its affinity gateway all along, and stayed on one replica.
    probed = central_query(
        lab, f'min_over_time(kvwatch_probe_sticky_ratio{{cluster="b",target="lab-affinity"}}[{span}])'
    )
    assert [float(s["value"][1]) for s in probed] == [1.0]


def test_each_clusters_hit_ratio_is_its_own_ground_truth(lab, clusters, caching_off_since):
    time.sleep(max(0.0, caching_off_since + WINDOW_S + 3 - time.time()))  # a window wholly inside the faults
    (evaluated,) = central_query(lab, f'timestamp({queries.CLUSTER_HIT_RATIO}{{cluster="a"}})')
    at = float(evaluated["value"][1])
    wait_until_recorded([r for cluster in clusters.values() for r in cluster.status["replicas"]], at)
    expected, shown = {}, {}
    for name, cluster in clusters.items():
        served = [
            Served(record, replica["url"].removeprefix("http://"), replica["flavour"])
            for replica in cluster.status["replicas"]
            for record in http_get(f"{replica['url']}/lab/ground-truth", timeout=10).json()["records"]
        ]
        window = Window(lab.status["prometheus"], at, served, seconds=WINDOW_S)
        expected[name] = reuse(window.inside(lambda s: s.tokens_counted_at))
        shown[name] = window.scalar(queries.CLUSTER_HIT_RATIO, cluster=name)
    # Real reuse happened in b, and a's uncached replica halved a's: a sum over both would miss each.
    assert 0.6 < expected["b"] < 1.0 and 0.2 < expected["a"] < expected["b"] - 3 * TOLERANCE, expected
    assert shown == pytest.approx(expected, abs=TOLERANCE)


def test_heal_resolves_cluster_as_alert(lab, clusters, broken_since, caching_off_since):
    healed = time.time()
    result = lab.cli("heal", "--cluster", "a")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("cluster a: healed: break-affinity, disable-prefix-cache on r1 (")
    wait_for(clusters["a"], healed, ALERT, "resolved", cluster="a", target="lab-affinity")
    assert not [
        a
        for a in received(clusters["b"], broken_since)
        if a["labels"].get("cluster") == "b" and a["alertname"] == ALERT
    ]
