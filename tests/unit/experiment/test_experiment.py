"""`kvwatch experiment`: its statistics on made-up sessions, and the command against loopback servers
(tests/integration/test_experiment_cli_lab.py runs it end to end in a small lab)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import random
import statistics

import pytest

from kvwatch.cli.main import main
from kvwatch.collectors.probe.blocksize import BlockSize, BlockSizeSources
from kvwatch.collectors.probe.records import RoundResult, SessionResult
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.collectors.probe.workload import Conversation, synthetic
from kvwatch.core.stats import bootstrap_cis, quantile
from kvwatch.core.tokenizer import split_words
from kvwatch.experiment import plot
from kvwatch.experiment import runner as experiment_module
from kvwatch.experiment.design import Experiment, Load, interleave, tag
from kvwatch.experiment.report import plot_panels, report
from kvwatch.experiment.runner import run_experiment
from kvwatch.experiment.tables import load_rows, replica_rows, round_rows, route_rows
from processes import free_port

KEY = "kvw-experiment-7d1e9c42b6a0"  # distinctive, so a grep finds any leak
SESSIONS, ROUNDS = 6, 4


def round_(
    number: int,
    ttft: float = 0.05,
    prompt: int = 1000,
    cached: int | None = 0,
    ideal: int = 0,
    backend="r1",
    started: float = 0.0,
    total: float | None = None,
    generated: int = 8,
) -> RoundResult:
    total = ttft + 0.1 if total is None else total
    return RoundResult(
        number, started, 200, None, None, ttft, total, prompt, cached, ideal, generated, backend, None, None
    )


def failed(number: int, kind: str) -> RoundResult:
    return RoundResult(number, 0.0, None, kind, "detail", *[None] * 9)


def session(label: str, *rounds: RoundResult) -> SessionResult:
    return SessionResult(label, label, "s", 0.0, 1.0, rounds)


def experiment(a: list[SessionResult], b: list[SessionResult]) -> Experiment:
    routes = [
        ProbeSettings(f"http://{label}.example", "m", target=label) for label in ("round_robin", "affinity")
    ]
    rounds = max(len(s.rounds) for s in a + b)
    block = BlockSize(16, "--block-size")
    sessions, arrivals = (tuple(a), tuple(b)), (0.0,) * len(a)
    return Experiment(
        *routes, rounds=rounds, load=Load(), arrivals=arrivals, sessions=sessions, block_size=block
    )


# Statistics.


def test_quantile_interpolates_between_sorted_values_as_numpy_does():
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([10.0, 20.0, 30.0, 40.0, 50.0], 0.9) == pytest.approx(46.0)
    assert quantile([7.0], 0.9) == 7.0
    values = [0.3, 0.1, 0.2, 0.5]
    assert quantile(sorted(values), 0.5) == statistics.median(values)


def test_bootstrap_interval_holds_the_statistic_and_is_seeded():
    rng = random.Random(1)
    values = [rng.lognormvariate(-3, 0.4) for _ in range(20)]
    intervals = bootstrap_cis(values, (0.5, 0.9, 0.99))
    for q, (low, high) in intervals.items():
        assert low <= quantile(sorted(values), q) <= high
        assert low < high
    assert intervals[0.5][1] < intervals[0.99][1] <= max(values)
    # One set of resamples serves every quantile: asking for one alone gives the same interval.
    assert bootstrap_cis(values, (0.9,))[0.9] == intervals[0.9]
    assert bootstrap_cis(values, seed=1) != bootstrap_cis(values, seed=2)


def test_bootstrap_interval_narrows_with_more_data():
    rng = random.Random(2)
    values = [rng.gauss(0.1, 0.02) for _ in range(500)]
    (few,), (many,) = bootstrap_cis(values[:12]).values(), bootstrap_cis(values).values()
    assert many[1] - many[0] < 0.5 * (few[1] - few[0])


def test_bootstrap_interval_of_the_p90_covers_the_true_p90_about_95_times_in_100():
    """Skewed samples (exponential, like TTFT under queueing): 100 seeded trials of 60 values each."""
    true_p90 = -math.log(0.1)  # of an exponential with mean 1
    rng, covered = random.Random(3), 0
    for trial in range(100):
        values = [rng.expovariate(1.0) for _ in range(60)]
        low, high = bootstrap_cis(values, (0.9,), resamples=200, seed=trial)[0.9]
        covered += low <= true_p90 <= high
    assert 85 <= covered <= 99, covered


def test_cached_ratio_is_token_weighted_and_failed_rounds_are_counted_apart():
    a = [
        session("round_robin", round_(1, 0.05), round_(2, 0.10, prompt=1000, cached=900, ideal=960)),
        session("round_robin", round_(1, 0.06), round_(2, 0.20, prompt=3000, cached=0, ideal=2880)),
        session("round_robin", round_(1, 0.07), failed(2, "timeout")),
    ]
    b = [session("affinity", round_(1, 0.04), round_(2, 0.05, prompt=2000, cached=1900, ideal=1920))]
    rows = {(r["route"], r["round"]): r for r in round_rows(experiment(a, b))}
    warm = rows["round_robin", 2]
    assert (warm["sessions"], warm["errors"]) == (3, 1)
    # 900 of 4000 prompt tokens were cached: 0.225, where a mean of the ratios would say 0.45.
    assert warm["cached_ratio"] == pytest.approx(900 / 4000)
    assert warm["ideal_efficiency"] == pytest.approx(900 / 3840)
    assert warm["ttft_median_seconds"] == pytest.approx(0.15)
    assert rows["round_robin", 1]["cached_ratio"] == 0 and rows["round_robin", 1]["ideal_efficiency"] is None
    assert rows["affinity", 2]["ttft_median_ratio_to_a"] == pytest.approx(0.05 / 0.15)
    assert rows["round_robin", 2]["ttft_median_ratio_to_a"] == 1.0


def test_without_cached_tokens_the_cached_ratio_is_the_probes_estimate_from_the_backends():
    """The ideal on the replica of the round before, 0 on another; nothing when no backend is named."""
    a = [
        session("round_robin", round_(1, cached=None), round_(2, cached=None, ideal=960, backend="r2")),
        session("round_robin", round_(1, cached=None), round_(2, cached=None, ideal=960)),
    ]
    b = [session("affinity", round_(1), round_(2, cached=None, ideal=960, backend=None))]
    rows = {(r["route"], r["round"]): r for r in round_rows(experiment(a, b))}
    assert rows["round_robin", 2]["cached_ratio"] == pytest.approx(960 / 2000)
    assert rows["round_robin", 2]["cached_source"] == "estimate"
    assert rows["round_robin", 2]["ideal_efficiency"] is None  # cached / ideal is the engine's alone
    assert (rows["affinity", 1]["cached_source"], rows["affinity", 1]["cached_ratio"]) == ("engine", 0)
    assert (rows["affinity", 2]["cached_source"], rows["affinity", 2]["cached_ratio"]) == (None, None)


def test_route_figures_stickiness_switches_and_errors():
    a = [
        session("round_robin", round_(1, backend="r1"), round_(2, backend="r2"), round_(3, backend="r3")),
        session("round_robin", round_(1, backend="r2"), round_(2, backend="r2"), round_(3, backend="r1")),
        session("round_robin", round_(1, backend="r3"), failed(2, "connection_refused")),
    ]
    b = [session("affinity", *(round_(n, backend="r4", cached=900, ideal=900) for n in (1, 2, 3)))] * 3
    rr, affinity = route_rows(experiment(a, b))
    assert rr == {
        "route": "round_robin",
        "sessions": 3,
        "failed": 1,
        "sticky_share": 0.0,  # the failed session's one known backend says nothing either way
        "backend_switches_per_session": 1.5,
        "warm_ideal_efficiency": None,
        "errors": "connection_refused x1",
    }
    assert (affinity["sticky_share"], affinity["backend_switches_per_session"]) == (1.0, 0)
    assert (affinity["warm_ideal_efficiency"], affinity["errors"]) == (1.0, "")


def test_the_report_names_the_block_size_and_its_source():
    sessions = [session(label, round_(1), round_(2)) for label in ("round_robin", "affinity")]
    run = experiment([sessions[0]], [sessions[1]])
    markdown = report(run, round_rows(run), route_rows(run), load_rows(run), replica_rows(run))
    assert "\n- KV block: 16 tokens (--block-size), for the ideal cached tokens.\n" in markdown


# The plot.

PLOTTED = {  # a line's name after its route's, and the per-round.csv column it draws (ms for TTFT)
    "median": ("ttft_median_seconds", 1000),
    "p90": ("ttft_p90_seconds", 1000),
    "p99": ("ttft_p99_seconds", 1000),
    "cached ratio": ("cached_ratio", 1),
    "cached / ideal": ("ideal_efficiency", 1),
}


@pytest.fixture(scope="module")
def plotted() -> tuple[Experiment, list[dict]]:
    """Five sessions per route of three rounds, TTFTs spread so that each quantile and interval differ."""
    a, b = [], []
    for n in range(5):
        warm = [round_(r, 0.05 * r + 0.01 * n, 1000 * r, cached=300 + 10 * n, ideal=900) for r in (2, 3)]
        a.append(session("round_robin", round_(1, 0.05 + 0.002 * n), *warm))
        kept = [round_(r, 0.04 + 0.003 * n, 1000 * r, cached=900 - 20 * n, ideal=900) for r in (2, 3)]
        b.append(session("affinity", round_(1, 0.05 + 0.003 * n), *kept))
    run = experiment(a, b)
    return run, round_rows(run)


def column(rows: list[dict], route: str, key: str, scale: float = 1) -> list[float | None]:
    """A route's value by round, as a figure holds it (rounded), None where it is unknown."""
    mine = sorted((r for r in rows if r["route"] == route), key=lambda r: r["round"])
    return [None if r[key] is None else round(r[key] * scale, 9) for r in mine]


def shown(values) -> list[float | None]:
    """A figure's values, comparable with `column`: NaN, a gap in the line, is None."""
    return [None if math.isnan(v) else round(float(v), 9) for v in values]


def expected_lines(rows: list[dict]) -> dict[str, list[float | None]]:
    """Every line the plot should draw, by name, from the per-round rows."""
    return {
        f"{group}: {route} {figure}": column(rows, route, key, scale)
        for group, route in (("A", "round_robin"), ("B", "affinity"))
        for figure, (key, scale) in PLOTTED.items()
    }


BANDS = list(itertools.product(["round_robin", "affinity"], ["median", "p90", "p99"]))  # in the order drawn


def bounds(rows: list[dict], route: str, stat: str) -> tuple[list, list]:
    """A TTFT line's interval by round in ms: its lows, its highs."""
    return tuple(column(rows, route, f"ttft_{stat}_{bound}_seconds", 1000) for bound in ("low", "high"))


def test_the_plot_shows_median_p90_and_p99_with_intervals_and_cached_ratio_and_cached_over_ideal(plotted):
    run, rows = plotted
    png = plot.png_figure(plot_panels(run, rows), "title")
    ttft, reuse = png.axes
    drawn = {line.get_label(): shown(line.get_ydata()) for axes in png.axes for line in axes.lines}
    assert drawn == expected_lines(rows)
    assert [line.get_label() for line in reuse.lines] == [
        "A: round_robin cached ratio", "A: round_robin cached / ideal",
        "B: affinity cached ratio", "B: affinity cached / ideal",
    ]  # fmt: skip
    assert (ttft.get_ylabel(), reuse.get_ylim()) == ("TTFT (ms)", (0, 1.05))
    styles = {line.get_label(): line.get_linestyle() for line in ttft.lines}
    assert [styles[f"B: affinity {stat}"] for stat in ("median", "p90", "p99")] == ["-", "--", ":"]
    # Each TTFT line's band spans its interval: at round n, from its low to its high.
    assert len(ttft.collections) == len(BANDS)
    for band, (route, stat) in zip(ttft.collections, BANDS, strict=True):
        lows, highs = bounds(rows, route, stat)
        corners = {(n, y) for n, pair in enumerate(zip(lows, highs, strict=True), start=1) for y in pair}
        outline = {(x, round(y, 9)) for x, y in band.get_paths()[0].vertices}
        assert corners <= outline, (route, stat)


def test_the_interactive_plot_shows_what_the_png_does(plotted):
    run, rows = plotted
    html = plot.html_figure(plot_panels(run, rows), "title")
    lines = [trace for trace in html.data if trace.showlegend is not False]
    assert {t.name: shown(t.y) for t in lines} == expected_lines(rows)
    assert [t.line.dash for t in lines if t.name.startswith("B: affinity p")] == ["dash", "dot"]
    bands = [shown(trace.y) for trace in html.data if trace.fill == "toself"]
    assert bands == [high + low[::-1] for low, high in (bounds(rows, *band) for band in BANDS)]


@pytest.mark.integration
def test_both_routes_share_one_block_size_learned_from_the_engine(start_replica):
    """Two labels for one vLLM replica with 128-token blocks: every warm round gets exactly its ideal."""
    replica = start_replica("cpu", "vllm", "--time-scale", "0.05", "--block-size", "128")
    a, b = (ProbeSettings(replica.url, "lab-model", target=label, max_tokens=8) for label in ("a", "b"))
    run = run_experiment(a, b, synthetic(4, 600, 80, seed=5, sessions=2))

    assert run.block_size == BlockSize(128, f"vllm:cache_config_info at {replica.url}/metrics")
    warm = [r for s in run.all_sessions for r in s.rounds[1:]]
    assert len(warm) == 12 and all(r.ideal_cached_tokens % 128 == 0 for r in warm)
    assert [r.cached_tokens for r in warm] == [r.ideal_cached_tokens for r in warm]
    assert [row["warm_ideal_efficiency"] for row in route_rows(run)] == [1.0, 1.0]


def test_sessions_alternate_which_route_goes_first():
    assert interleave(3) == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]
    plan = interleave(20)
    assert sorted(plan) == [(n, route) for n in range(20) for route in (0, 1)]
    assert sum(route for _, route in plan[::2]) == 10  # B goes first in half of the pairs


def test_the_tag_sets_routes_apart_at_the_same_length():
    (conversation,) = synthetic(3, 50, 20, seed=1, sessions=1)
    a, b = (tag(conversation, "3f9c0a1e", route) for route in (0, 1))
    assert a.system_prompt == b.system_prompt == conversation.system_prompt
    assert a.user_turns[1:] == b.user_turns[1:] == conversation.user_turns[1:]
    assert a.user_turns[0] != b.user_turns[0] and a.user_turns[0].endswith(conversation.user_turns[0])
    assert len(split_words(a.user_turns[0])) == len(split_words(b.user_turns[0]))


# The load.


def test_poisson_arrivals_are_seeded_start_at_once_and_have_exponential_gaps():
    load = Load(request_rate=4.0, seed=3)
    arrivals = load.arrivals(4000)
    assert arrivals == Load(request_rate=4.0, seed=3).arrivals(4000)
    assert arrivals != Load(request_rate=4.0, seed=4).arrivals(4000)
    assert arrivals[0] == 0 and arrivals[:10] == load.arrivals(10)
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert min(gaps) > 0
    assert statistics.mean(gaps) == pytest.approx(1 / 4.0, rel=0.05)
    # Exponential, not evenly spaced: about e^-1 of the gaps are longer than the mean.
    assert sum(g > 1 / 4.0 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)
    assert Load(concurrency=8).arrivals(3) == (0.0, 0.0, 0.0)


def test_sessions_in_flight_per_route():
    assert Load().in_flight(10) == 1 and Load().one_at_a_time  # and one at a time over both routes
    assert not Load(concurrency=1).one_at_a_time and not Load(request_rate=1.0).one_at_a_time
    assert Load(concurrency=4).in_flight(10) == 4 and Load(concurrency=40).in_flight(10) == 10
    assert Load(request_rate=2.0).in_flight(10) == 10  # no cap: every arrival starts at once
    assert Load(concurrency=3, request_rate=2.0).in_flight(10) == 3


@pytest.fixture
def recorded(monkeypatch):
    """run_experiment with a stand-in for the probe's sessions: the events they saw, in order.

    Route A's sessions wait until route B has finished all of its own (at most 5 s), so a scheduler that
    made one route wait for the other would time out instead of finishing.
    """
    events: list[tuple[str, str, int]] = []
    b_done = asyncio.Event()

    async def fake_session(client, settings, conversation):
        conversation_number = int(conversation.user_turns[0].rsplit(" ", 1)[1])
        events.append(("start", settings.target, conversation_number))
        if settings.target == "a":
            async with asyncio.timeout(5):
                await b_done.wait()
        else:
            await asyncio.sleep(0.001)
        events.append(("end", settings.target, conversation_number))
        if sum(e[:2] == ("end", "b") for e in events) == SESSIONS:
            b_done.set()
        return session(settings.target, round_(1, backend="r1"))

    monkeypatch.setattr(experiment_module, "run_target_session", fake_session)

    def run(load: Load) -> tuple[Experiment, list[tuple[str, str, int]]]:
        events.clear()
        b_done.clear()
        conversations = [Conversation("system", (f"Turn. {n}", "next")) for n in range(SESSIONS)]
        a, b = (ProbeSettings(f"http://{label}.example", "m", target=label) for label in "ab")
        sources = BlockSizeSources(override=BlockSize(16, "--block-size"))
        return run_experiment(a, b, conversations, load, block_sources=sources), list(events)

    return run


def in_flight_at_most(events: list[tuple[str, str, int]], route: str) -> int:
    running = peak = 0
    for kind, label, _ in events:
        if label == route:
            running += 1 if kind == "start" else -1
            peak = max(peak, running)
    return peak


@pytest.mark.parametrize("load", [Load(concurrency=2), Load(request_rate=500.0, seed=1)])
def test_both_routes_get_every_session_in_arrival_order_and_neither_waits_for_the_other(recorded, load):
    run, events = recorded(load)
    starts = [(label, n) for kind, label, n in events if kind == "start"]
    for route in "ab":
        assert [n for label, n in starts if label == route] == list(range(SESSIONS))
    # A's sessions all wait, so A fills every slot it has; B's end fast and need fewer.
    assert in_flight_at_most(events, "a") == load.in_flight(SESSIONS)
    assert in_flight_at_most(events, "b") <= load.in_flight(SESSIONS)
    # B, never held up by A, finished everything while A's first sessions were still running.
    assert events.index(("end", "b", SESSIONS - 1)) < events.index(("end", "a", 0))
    assert run.arrivals == load.arrivals(SESSIONS)


def test_sessions_are_handed_out_in_interleaved_order_when_both_routes_have_room(recorded):
    _, events = recorded(Load(concurrency=SESSIONS))
    starts = [(n, "ab".index(label)) for kind, label, n in events if kind == "start"]
    assert starts == interleave(SESSIONS)


def test_without_a_load_one_session_runs_at_a_time_over_both_routes(monkeypatch):
    """Each session ends before the next starts, in interleaved order."""
    events = []

    async def fake_session(client, settings, conversation):
        events.append(("start", settings.target))
        await asyncio.sleep(0.001)
        events.append(("end", settings.target))
        return session(settings.target, round_(1))

    monkeypatch.setattr(experiment_module, "run_target_session", fake_session)
    a, b = (ProbeSettings(f"http://{label}.example", "m", target=label) for label in "ab")
    conversations = [Conversation("system", ("turn", "next"))] * SESSIONS
    sources = BlockSizeSources(override=BlockSize(16, "--block-size"))
    run_experiment(a, b, conversations, Load(), block_sources=sources)
    order = ["ab"[route] for _, route in interleave(SESSIONS)]
    assert events == [(kind, label) for label in order for kind in ("start", "end")]


def load_experiment() -> Experiment:
    """Route A: two sessions of two rounds over 4 s on r1 and r2; B: one session of two rounds on r3."""
    a = [
        session("round_robin", round_(1, 0.1, 1000, started=100.0, total=0.5, backend="r1"),
                round_(2, 0.3, 1500, started=101.0, total=1.0, backend="r2", generated=20)),
        session("round_robin", round_(1, 0.2, 1000, started=100.5, total=0.5, backend="r2"),
                dataclasses.replace(failed(2, "timeout"), started_at=101.5)),
    ]  # fmt: skip
    b = [session("affinity", round_(1, 0.1, 1000, started=100.0, total=1.0, backend="r3"),
                 round_(2, 0.05, 1500, started=101.0, total=1.0, backend=None))]  # fmt: skip
    run = experiment(a, b + b)
    return run


def test_throughput_counts_answered_requests_and_tokens_over_the_measured_span():
    a, b = load_rows(load_experiment())
    # A's span: from its first request (100.0) to its last answer's end (101.0 + 1.0).
    assert (a["requests"], a["answered"], a["span_seconds"]) == (4, 3, pytest.approx(2.0))
    assert a["requests_per_second"] == pytest.approx(3 / 2.0)
    assert a["prompt_tokens_per_second"] == pytest.approx(3500 / 2.0)
    assert a["generated_tokens_per_second"] == pytest.approx((8 + 20 + 8) / 2.0)
    assert a["ttft_median_seconds"] == pytest.approx(0.2)
    assert a["ttft_p99_seconds"] == pytest.approx(0.1 + 0.99 * 2 * 0.1)
    assert a["ttft_p99_low_seconds"] <= a["ttft_p99_seconds"] <= a["ttft_p99_high_seconds"]
    assert (b["answered"], b["requests_per_second"]) == (4, pytest.approx(4 / 2.0))


def test_replica_load_adds_up_to_the_requests_each_route_sent():
    run = load_experiment()
    rows = replica_rows(run)
    assert rows == [
        {"route": "round_robin", "replica": "r1", "requests": 1},
        {"route": "round_robin", "replica": "r2", "requests": 2},
        {"route": "round_robin", "replica": "unknown", "requests": 1},  # the timed-out round
        {"route": "affinity", "replica": "r3", "requests": 2},
        {"route": "affinity", "replica": "unknown", "requests": 2},
    ]
    for load in load_rows(run):
        assert sum(r["requests"] for r in rows if r["route"] == load["route"]) == load["requests"]


def test_the_report_shows_throughput_tail_ttft_and_replica_load():
    run = load_experiment()
    markdown = report(run, round_rows(run), route_rows(run), load_rows(run), replica_rows(run))
    lines = markdown.splitlines()
    assert "| round_robin | 3 | 2.00 | 1.50 | 1750 | 18 | 200 [" in markdown
    assert lines[lines.index("| replica | round_robin | affinity |") + 2 :] == [
        "| r1 | 1 | 0 |", "| r2 | 2 | 0 |", "| r3 | 0 | 2 |", "| unknown | 1 | 2 |",
    ]  # fmt: skip
    assert "interleaved session by session, one at a time over both routes" in markdown
    header = next(line for line in lines if line.startswith("| round |"))
    assert header.endswith("| round_robin p99 TTFT [95 % CI] | affinity p99 TTFT [95 % CI] |")
    round_2 = next(line for line in lines if line.startswith("| 2 |"))
    assert round_2.endswith("| 300 [300–300] | 50 [50–50] | 300 [300–300] | 50 [50–50] |")


# The command line.


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--label-a", "x", "--label-b", "x"], "the two routes need different labels, both are 'x'"),
        (["--rounds", "1"], "rounds must be at least 2: warm rounds are what the experiment compares"),
        (["--concurrency", "0"], "concurrency must be positive"),
        (["--request-rate", "0"], "request rate must be a positive number of sessions per second"),
        (["--request-rate", "inf"], "request rate must be a positive number of sessions per second"),
        (["--api-key-env", "KVW_TEST_UNSET"], "environment variable KVW_TEST_UNSET is not set or empty"),
    ],
)
def test_bad_arguments_exit_2(flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVW_TEST_UNSET", raising=False)
    code = main(
        [
            "experiment",
            "--a",
            "http://127.0.0.1:1",
            "--b",
            "http://127.0.0.1:2",
            "--out",
            str(tmp_path),
            "--model",
            "m",
            *flags,
        ]
    )
    assert code == 2
    assert capsys.readouterr().err == f"kvwatch experiment: {message}\n"


def test_an_api_key_on_the_command_line_is_refused_unrepeated(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["experiment", "--a", "http://127.0.0.1:1", "--b", "http://127.0.0.1:2", "--out", str(tmp_path),
              f"--api-key={KEY}"])  # fmt: skip
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "never taken from the command line" in err and KEY not in err


def test_every_session_failing_exits_1_with_the_error_kinds_and_hints(tmp_path, capsys):
    closed = f"http://127.0.0.1:{free_port()}"
    code = main(["experiment", "--a", closed, "--b", closed + "/v1", "--out", str(tmp_path / "out"),
                 "--model", "m", "--sessions", "2", "--rounds", "2"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    first, hint = captured.err.splitlines()
    assert first == "kvwatch experiment: 4 of 4 sessions failed"
    assert hint.startswith("  connection_refused (") and hint.endswith(HINTS["connection_refused"])
    assert list((tmp_path / "out").iterdir()) == []
