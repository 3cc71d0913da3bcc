"""The recording rules and the engine panels against the lab's real Prometheus: every engine figure the
pages and boards show (hit ratios, lookup ratios, cached tokens by source, request shares, load
imbalance, TTFT quantiles and distributions) matches the replicas' ground truth over one window of
background traffic, on a mixed vLLM + SGLang fleet. The lab runs the rules with their windows at a
quarter of production (two minutes become 30 s): what is checked is the same, in a quarter of the wait."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import pytest

from kvwatch.lab.configs import scale_durations
from kvwatch.prometheus import panel_queries, queries
from labs import finished_evaluation, wait_until_recorded
from processes import http_get

pytestmark = pytest.mark.integration

RULE_TIME_SCALE = 0.25
WINDOW_S = int(scale_durations(queries.WINDOW, RULE_TIME_SCALE).removesuffix("s"))  # the rules' window
# A token ratio over one short window moves with the few requests rate() misses or takes in at its edges
# (below): each holds a whole prompt, so one cold round there shifts an instance's ratio by about 0.02
# (seen in CI: 0.021). Bounds built from every edge request at once would be over 0.3 wide: no check.
TOLERANCE = 0.035
# --fast: Prometheus scrapes every second, with a timeout of a second. rate() takes the increase between
# the first and last samples inside the window; a sample is stamped when its scrape starts but holds what
# was counted until the engine answered. So rate() misses what was counted less than two scrapes after
# the window's start or one before its end, may take in what was counted up to a scrape after its end,
# and extrapolates to the window's length by a factor of at most EXTRAPOLATION.
SCRAPE_S = 1
EXTRAPOLATION = WINDOW_S / (WINDOW_S - 2 * SCRAPE_S)


@dataclass(frozen=True)
class Served:
    """One request as a replica recorded it, with the replica's instance label and engine flavour."""

    record: dict
    instance: str
    flavour: str

    @property
    def tokens_counted_at(self) -> float:
        """When the engine counted its tokens: vLLM at prefill (first token), SGLang when it finished."""
        seconds = self.record["ttft_seconds"] if self.flavour == "vllm" else self.record["e2e_seconds"]
        return self.record["time"] + seconds

    @property
    def finished_at(self) -> float:
        """When both engines counted the request as finished (vllm:request_success_total and
        sglang:num_requests_total)."""
        return self.record["time"] + self.record["e2e_seconds"]

    @property
    def first_token_at(self) -> float:
        """When both engines observed its time to first token."""
        return self.record["time"] + self.record["ttft_seconds"]


@dataclass(frozen=True)
class Window:
    """One evaluation of the rules, and every request the replicas served."""

    prometheus: str
    at: float
    served: list[Served]
    seconds: int = WINDOW_S  # the rules' window, as the lab's --rule-time-scale makes it

    def query(self, expr: str) -> list[dict]:
        expr = panel_queries.fill_variables(expr, window=f"{self.seconds}s", time_range=f"{self.seconds}s")
        params = {"query": expr, "time": self.at}
        answer = http_get(f"{self.prometheus}/api/v1/query", params=params, timeout=10).json()
        return answer["data"]["result"]

    def by_instance(self, expr: str, **labels: str) -> dict[str, float]:
        return {
            sample["metric"]["instance"]: float(sample["value"][1])
            for sample in self.query(expr)
            if labels.items() <= sample["metric"].items()
        }

    def scalar(self, expr: str, **labels: str) -> float:
        (sample,) = [s for s in self.query(expr) if labels.items() <= s["metric"].items()]
        return float(sample["value"][1])

    def inside(self, moment) -> list[Served]:
        """The requests counted inside the window, by the moment `moment(served)` they were counted."""
        ok = [s for s in self.served if s.record.get("ttft_seconds") is not None]
        return [s for s in ok if self.at - self.seconds < moment(s) <= self.at]

    def at_the_edges(self, moment) -> tuple[list[Served], list[Served]]:
        """The requests rate() may miss inside the window, and those it may take in after its end."""
        start, end = self.at - self.seconds, self.at
        missed = [
            s for s in self.inside(moment) if moment(s) <= start + 2 * SCRAPE_S or moment(s) > end - SCRAPE_S
        ]
        ok = [s for s in self.served if s.record.get("ttft_seconds") is not None]
        return missed, [s for s in ok if end < moment(s) <= end + SCRAPE_S]


@pytest.fixture(scope="module")
def window(start_lab) -> Window:
    lab = start_lab("--replicas", "4", "--flavours", "vllm,sglang", "--users", "6", "--think", "0.2",
                    "--time-scale", "0.1", "--rule-time-scale", str(RULE_TIME_SCALE))  # fmt: skip
    prometheus = lab.status["prometheus"]
    # The window must lie wholly inside the traffic: rate() extrapolates differently near a series' start.
    time.sleep(WINDOW_S + 20)
    at = finished_evaluation(prometheus, queries.CLUSTER_HIT_RATIO)
    wait_until_recorded(lab.status["replicas"], at)
    served = [
        Served(record, replica["url"].removeprefix("http://"), replica["flavour"])
        for replica in lab.status["replicas"]
        for record in http_get(f"{replica['url']}/lab/ground-truth", timeout=10).json()["records"]
    ]
    return Window(prometheus, at, served)


def reuse(served: list[Served]) -> float:
    return sum(s.record["cached_tokens"] for s in served) / sum(s.record["prompt_tokens"] for s in served)


# Each token ratio the pages show per instance and for the cluster. The lab's replicas look up every
# prompt in their prefix cache and keep all cached KV on the device, so the local lookup ratio and the
# device's share of the prompt tokens are the delivered ratio too.
TOKEN_RATIOS = {
    "delivered": (panel_queries.HIT_RATIO_BY_INSTANCE, queries.CLUSTER_HIT_RATIO, {}),
    "local lookups": (panel_queries.LOCAL_HIT_RATIO_BY_INSTANCE, queries.CLUSTER_LOCAL_HIT_RATIO, {}),
    "cached on the device": (
        panel_queries.CACHED_SHARE_BY_SOURCE,
        panel_queries.CLUSTER_CACHED_SHARE_BY_SOURCE,
        {"source": "device"},
    ),
}


@pytest.mark.parametrize("per_instance, cluster, labels", TOKEN_RATIOS.values(), ids=TOKEN_RATIOS)
def test_token_ratios_match_ground_truth(window: Window, per_instance: str, cluster: str, labels: dict):
    counted = window.inside(lambda s: s.tokens_counted_at)
    shown = window.by_instance(per_instance, **labels)
    assert shown.keys() == {s.instance for s in window.served}
    for instance, value in shown.items():
        expected = reuse([s for s in counted if s.instance == instance])
        assert value == pytest.approx(expected, abs=TOLERANCE), (instance, expected)
    expected = reuse(counted)
    assert 0.3 < expected < 1.0  # real reuse happened, so the comparison means something
    assert window.scalar(cluster, **labels) == pytest.approx(expected, abs=TOLERANCE)


def rate_bounds(served: list[Served], missed: list[Served], extra: list[Served]) -> tuple[Counter, Counter]:
    """Per instance, the fewest and the most requests that rate() times the window can make of
    `served`: less those it may miss, or with those it may take in, extrapolated."""
    counts = Counter(s.instance for s in served)
    most = counts + Counter(s.instance for s in extra)
    return counts - Counter(s.instance for s in missed), Counter(
        {i: n * EXTRAPOLATION for i, n in most.items()}
    )


def test_request_shares_and_load_imbalance_match_ground_truth(window: Window):
    finished = window.inside(lambda s: s.finished_at)
    low, high = rate_bounds(finished, *window.at_the_edges(lambda s: s.finished_at))
    shares = window.by_instance(panel_queries.REQUEST_SHARE_BY_INSTANCE)
    assert shares.keys() == high.keys() == {s.instance for s in window.served}
    for instance, share in shares.items():
        others_low, others_high = low.total() - low[instance], high.total() - high[instance]
        fewest = low[instance] / (low[instance] + others_high)
        most = high[instance] / (high[instance] + others_low)
        assert fewest <= share <= most, (instance, fewest, share, most)
    instances = len(high)
    fewest = max(low.values()) / (high.total() / instances)
    most = max(high.values()) / (low.total() / instances)
    assert fewest <= window.scalar(queries.CLUSTER_LOAD_IMBALANCE) <= most, (fewest, most)


def bounds(window: Window) -> dict[str, list[float]]:
    """Each engine family's finite TTFT bucket bounds, as its heatmap has them (the lab's instances of
    one family all have the same)."""
    return {
        family: sorted(float(s["metric"]["le"]) for s in window.query(heatmap) if s["metric"]["le"] != "+Inf")
        for family, heatmap in panel_queries.ENGINE_TTFT_BUCKET_RATES.items()
    }


def assert_quantiles_in_the_ground_truths_bucket(window: Window, expr: str, by: str, of, slack: float):
    """histogram_quantile() interpolates inside the bucket holding the quantile's rank, so the true
    quantile lies in the bucket of the shown one: at most `quantile` of the TTFTs lie below the bucket
    and at least `quantile` up to its top, but for the requests rate() may miss at the window's edges
    or take in, and `slack`. `of(value of by)` selects the requests a series is computed from."""
    observed = window.inside(lambda s: s.first_token_at)
    edges = sum(window.at_the_edges(lambda s: s.first_token_at), [])
    finite_of = bounds(window)
    for sample in window.query(expr):
        picked = of(sample["metric"][by])
        ttfts = [s.record["ttft_seconds"] for s in observed if picked(s)]
        uncertain = sum(map(picked, edges)) / len(ttfts) + slack
        shown, quantile = float(sample["value"][1]), float(sample["metric"]["quantile"])
        (finite,) = {tuple(finite_of[s.flavour]) for s in observed if picked(s)}
        below = max((b for b in finite if b < shown), default=0.0)
        top = min(b for b in finite if b >= shown)
        share_below = sum(t <= below for t in ttfts) / len(ttfts)
        share_to_top = sum(t <= top for t in ttfts) / len(ttfts)
        assert share_below <= quantile + uncertain and share_to_top >= quantile - uncertain, (
            sample["metric"], shown, (below, share_below), (top, share_to_top), uncertain
        )  # fmt: skip


def test_engine_ttft_quantiles_lie_in_the_ground_truths_bucket(window: Window):
    instances = {s.instance for s in window.served}
    per_instance = window.query(panel_queries.TTFT_QUANTILES_BY_INSTANCE)
    assert {(s["metric"]["instance"], s["metric"]["quantile"]) for s in per_instance} == {
        (instance, quantile) for instance in instances for quantile in queries.QUANTILES
    }
    # One instance's buckets are scraped together: rate() extrapolates them all alike.
    assert_quantiles_in_the_ground_truths_bucket(
        window, panel_queries.TTFT_QUANTILES_BY_INSTANCE, "instance", lambda i: lambda s: s.instance == i, 0
    )
    engines = {s["metric"]["engine"] for s in window.query(queries.ENGINE_TTFT)}
    assert engines == {s.flavour for s in window.served}
    # A family sums instances whose windows rate() extrapolates by different factors.
    assert_quantiles_in_the_ground_truths_bucket(
        window, queries.ENGINE_TTFT, "engine", lambda e: lambda s: s.flavour == e, EXTRAPOLATION - 1
    )


@pytest.mark.parametrize("flavour", panel_queries.ENGINE_TTFT_BUCKET_RATES)
def test_engine_ttft_heatmap_counts_the_ground_truths_first_tokens(window: Window, flavour: str):
    """Each heatmap cell is first tokens per second up to its bound, over the panel's rate window."""
    observed = [s for s in window.inside(lambda s: s.first_token_at) if s.flavour == flavour]
    missed, extra = (
        [s for s in edge if s.flavour == flavour] for edge in window.at_the_edges(lambda s: s.first_token_at)
    )
    cells = window.query(panel_queries.ENGINE_TTFT_BUCKET_RATES[flavour])
    assert observed and len(cells) > 2
    for cell in cells:
        bound = float(cell["metric"]["le"])
        up_to = [s for s in observed if s.record["ttft_seconds"] <= bound]
        low, high = rate_bounds(
            up_to, *([s for s in edge if s.record["ttft_seconds"] <= bound] for edge in (missed, extra))
        )
        shown = float(cell["value"][1]) * WINDOW_S
        assert low.total() <= shown <= high.total(), (bound, low.total(), shown, high.total())
