"""`kvwatch scrape`: good and bad sources side by side, each bad one a clear error naming it.

A tiny HTTP server on 127.0.0.1 plays the sources: a vLLM exposition that has served one more request
at every scrape (the lab's own vLLM metrics flavour), a 404, an endless body and a silent one.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator

import pytest
from loopback import QuietHandler, loopback_http
from prometheus_client import generate_latest
from test_router_flavours import sgl_router_0_2

from kvwatch.cli.main import build_parser, main
from kvwatch.collectors.engines import ENGINE_FLAVOURS
from kvwatch.collectors.engines.scrape import metrics_url, scrape
from kvwatch.lab.flavours import SIMULATED_FLAVOURS, CacheConfig, Prefill
from paths import TESTDATA
from processes import free_port, kvwatch_in_process

TESTDATA = TESTDATA
JSON_KEYS = [
    "source",
    "flavour",
    "window_seconds",
    "hit_ratio",
    "hit_ratio_source",
    "local_hit_ratio",
    "local_hits",
    "local_lookups",
    "prompt_tokens",
    "cached_tokens",
    "ttft_p50_seconds",
    "ttft_p90_seconds",
    "ttft_p99_seconds",
    "requests_running",
    "requests_waiting",
    "kv_cache_usage",
    "prefix_caching_enabled",
    "missing",
    "invalid",
    "per_worker",
    "policy_decisions",
    "router_cache_predictions",
    "predicted_hit_ratio",
    "available_share",
    "routed_share",
    "delivered_share",
    "sticky_outcomes",
    "routing_key_sources",
    "session_table",
    "index_health",
    "router_fallbacks",
    "cache_tiers",
    "counter_reset",
    "error",
]
# Every scrape of /metrics sees one more request: 100 prompt tokens, 64 cached, 30 ms to first token.
REQUEST = Prefill(
    prompt_tokens=100,
    cached_tokens=64,
    prefix_caching=True,
    queue_seconds=0.0,
    ttft_seconds=0.03,
    streaming=False,
)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The sources, on a free loopback port; stopped, with every waiting handler released, at teardown."""
    metrics = SIMULATED_FLAVOURS.lookup("vllm")(
        "lab-model",
        CacheConfig(block_size=16, num_gpu_blocks=1000, prefix_caching=True, max_model_len=8192),
    )
    lock = threading.Lock()
    release = threading.Event()

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            if self.path == "/metrics":
                with lock:
                    metrics.prefill_done(REQUEST)
                    body = generate_latest(metrics.registry)
                self.answer(200, body, "text/plain; version=0.0.4")
            elif self.path == "/endless":
                self._endless()
            elif self.path == "/silent":
                release.wait(timeout=30)
            else:
                self.answer(404, b"not found\n", "text/plain")

        def _endless(self) -> None:
            """A /metrics that never ends: only a size cap enforced while reading stops it."""
            self.send_response(200)
            self.end_headers()
            line = b"# " + b"x" * 2**20 + b"\n"
            try:
                while not release.is_set():
                    self.wfile.write(line)
            except (BrokenPipeError, ConnectionResetError):
                pass

    with loopback_http(Handler) as url:
        yield url
        release.set()


def test_good_and_bad_sources_are_reported_side_by_side(server, tmp_path, capsys):
    not_utf8 = tmp_path / "binary.prom"
    not_utf8.write_bytes(b"\xff\xfe\x00\x01 metrics?")
    unrelated = tmp_path / "node-exporter.prom"
    unrelated.write_text("# TYPE node_load1 gauge\nnode_load1 0.42\n")
    refused = f"http://127.0.0.1:{free_port()}/metrics"
    reasons = {
        str(TESTDATA / "garbage.prom"): "not a Prometheus text exposition",
        str(not_utf8): "not a Prometheus text exposition (not UTF-8 text",
        str(tmp_path / "absent.prom"): "cannot read the file: No such file or directory",
        str(unrelated): "unknown flavour: no series of a known engine or router",
        f"{server}/nothing-here": "HTTP 404 Not Found",
        refused: "cannot connect: Connection refused",
        "http://127.0.0.1:99999/metrics": "not a valid URL: port 99999 is not 1 to 65535",
        f"{server}/endless": "more than 32 MiB (the size cap",
    }
    good = f"{server}/metrics"
    sources = [good, *reasons]

    result = kvwatch_in_process(capsys, "scrape", "--json", *sources)

    assert result.returncode == 1, result.stderr
    objects = json.loads(result.stdout)
    assert [o["source"] for o in objects] == sources
    assert all(list(o) == JSON_KEYS for o in objects)
    first = objects[0]
    assert first["error"] is None
    assert (first["flavour"], first["window_seconds"], first["hit_ratio"]) == ("vllm", None, 0.64)
    assert (first["hit_ratio_source"], first["prefix_caching_enabled"], first["missing"]) == (
        "tokens",
        True,
        [],
    )
    assert first["local_hit_ratio"] == 0.64
    for failed in objects[1:]:
        source, error = failed["source"], failed["error"]
        assert error.startswith(f"{source}: ") and reasons[source] in error, error
        assert failed["flavour"] is None and failed["hit_ratio"] is None


def test_a_bare_host_url_is_read_at_metrics(server):
    results = asyncio.run(scrape([server, f"{server}/"]))
    assert [(r.source, r.error, r.record.flavour) for r in results] == [
        (f"{server}/metrics", None, "vllm")
    ] * 2


@pytest.mark.parametrize(
    "source",
    ["http://host:8000/stats", "http://host:8000/metrics", "http://host:8000/?format=text", "host.prom"],
)
def test_a_url_with_a_path_or_a_query_and_a_file_are_read_as_given(source):
    assert metrics_url(source) == source


def test_human_output_labels_lifetime_figures_and_errors(server, capsys):
    garbage = str(TESTDATA / "garbage.prom")
    result = kvwatch_in_process(capsys, "scrape", f"{server}/metrics", garbage)
    assert result.returncode == 1
    good, bad = result.stdout.strip().split("\n\n")
    assert good.startswith(f"{server}/metrics  [vllm, lifetime: cumulative since the process started]")
    assert "hit ratio            64.0%  (cached / prompt tokens, from the engine's counters)" in good
    assert "local lookups        64.0%  (prefix-cache hits / lookups)" in good
    assert "prefix caching       on" in good
    assert bad.startswith(f"{garbage}\n  ERROR  {garbage}: not a Prometheus text exposition")


def test_a_routers_prediction_is_printed_next_to_what_its_requests_were_delivered(capsys):
    """The hand-written llm-d EPP exposition: a mean prediction of 80 %, 7,000 of 10,000 tokens cached."""
    result = kvwatch_in_process(capsys, "scrape", str(TESTDATA / "routers" / "llm-d-epp-0.10.prom"), "--json")
    assert result.returncode == 0, result.stderr
    (record,) = json.loads(result.stdout)
    assert (record["flavour"], record["predicted_hit_ratio"], record["hit_ratio"]) == ("llm-d-epp", 0.8, 0.7)
    text = kvwatch_in_process(capsys, "scrape", str(TESTDATA / "routers" / "llm-d-epp-0.10.prom")).stdout
    assert "predicted hit ratio  80.0%  (the router's guess)" in text
    assert "delivered hit ratio  70.0%  (cached / prompt tokens it forwarded)" in text
    assert "vllm-0        6  (60%)" in text


def test_a_router_that_exports_the_legs_prints_its_reuse_decomposition(capsys):
    """The hand-written llm-d EPP exposition with its prefix plugin's token histograms: of 10,000 prompt
    tokens the best endpoint held 8,000, the chosen one 6,000, the engines reused 4,000."""
    path = str(TESTDATA / "routers" / "llm-d-epp-prefix-tokens.prom")
    result = kvwatch_in_process(capsys, "scrape", path, "--json")
    assert result.returncode == 0, result.stderr
    (record,) = json.loads(result.stdout)
    legs = (record["available_share"], record["routed_share"], record["delivered_share"])
    assert legs == (0.8, 0.6, 0.4)
    text = kvwatch_in_process(capsys, "scrape", path).stdout
    assert "reuse of the prompt  80.0% -> 60.0% -> 40.0%  (available -> routed -> delivered)" in text


def test_a_routers_session_table_and_kv_event_index_are_printed_and_in_the_json(capsys):
    sessions = str(TESTDATA / "routers" / "llm-d-epp-0.10-sessions.prom")
    index = str(TESTDATA / "routers" / "smg-1.13-kv-events.prom")
    result = kvwatch_in_process(capsys, "scrape", sessions, index, "--json")
    assert result.returncode == 0, result.stderr
    table, health = (
        record[key]
        for record, key in zip(json.loads(result.stdout), ("session_table", "index_health"), strict=True)
    )
    assert (table["bindings"], table["bind_rejections"], table["invalidations"]["pod_delete"]) == (40, 3, 5)
    assert (health["lag_seconds"], health["gaps"], health["degraded_ranks"]) == (2.5, 3, 1)
    text = kvwatch_in_process(capsys, "scrape", sessions, index).stdout
    assert "bindings dropped     close 6, error 2, idle 12, pod_delete 5" in text
    assert "KV-event index lag   2.5 s  (its worst worker)" in text


def test_interval_gives_the_windowed_figures_of_the_requests_in_between(server, capsys):
    result = kvwatch_in_process(capsys, "scrape", "--json", "--interval", "0.3", f"{server}/metrics")
    assert result.returncode == 0, result.stdout + result.stderr
    (record,) = json.loads(result.stdout)
    assert 0.3 <= record["window_seconds"] < 5
    # Exactly one request between the two scrapes.
    assert (record["prompt_tokens"], record["cached_tokens"], record["hit_ratio"]) == (100, 64, 0.64)
    # Its 30 ms TTFT is the only observation in (0.02, 0.04]: the median interpolates to the middle.
    assert record["ttft_p50_seconds"] == pytest.approx(0.03)
    assert record["counter_reset"] is False


def test_a_silent_source_times_out_and_the_others_still_print(server, capsys):
    result = kvwatch_in_process(capsys, "scrape", "--timeout", "0.5", f"{server}/silent", f"{server}/metrics")
    assert result.returncode == 1
    assert f"{server}/silent: no complete answer within 0.5 s" in result.stdout
    assert f"{server}/metrics  [vllm, lifetime" in result.stdout


def test_tls_to_a_plain_http_port_is_said_to_be_so(server):
    (result,) = asyncio.run(scrape([f"{server.replace('http', 'https', 1)}/metrics"]))
    assert result.error.endswith(": cannot connect: TLS handshake failed: is the server speaking plain HTTP?")


VLLM = """\
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0"}} {hits}
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0"}} {queries}
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0"}} 1000
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0"}} {running}
"""


HITS = "vllm:prefix_cache_hits_total"


@pytest.mark.parametrize(
    "hits, queries, running, invalid, unknown",
    [
        pytest.param("NaN", 1000, 2, {HITS: "NaN"}, "hit_ratio", id="nan"),
        pytest.param("+Inf", 1000, 2, {HITS: "+Inf"}, "hit_ratio", id="inf"),
        pytest.param(  # a hit ratio of 10000 %, were they taken as counts
            -100,
            -1,
            2,
            {HITS: "-100.0", "vllm:prefix_cache_queries_total": "-1.0"},
            "hit_ratio",
            id="negative",
        ),
        pytest.param(
            100, 1000, "-Inf", {"vllm:num_requests_running": "-Inf"}, "requests_running", id="gauge"
        ),
    ],
)
def test_a_nan_infinite_or_negative_series_is_named_invalid_and_never_printed_as_a_number(
    tmp_path, capsys, hits, queries, running, invalid, unknown
):
    path = tmp_path / "metrics.prom"
    path.write_text(VLLM.format(hits=hits, queries=queries, running=running))

    assert main(["scrape", "--json", str(path)]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["invalid"] == invalid and record[unknown] is None
    assert not set(invalid) & set(record["missing"])  # there, but bad
    assert main(["scrape", str(path)]) == 0
    rows = dict(line.strip().split("  ", 1) for line in capsys.readouterr().out.splitlines()[1:])
    named = ", ".join(f"{name} = {value}" for name, value in invalid.items())
    assert rows["invalid series"].strip() == f"{named} (no measurement: not counted)"
    figures = " ".join(rows[label] for label in ("hit ratio", "tokens", "requests")).lower()
    assert not re.search(r"\b(nan|inf)\b|-\d|\d{3}\.\d%", figures), figures


# Expositions a broken exporter serves: each breaks what one figure is built on.
BROKEN = {
    "/invalid-lookups": VLLM.format(hits="NaN", queries=-5, running=2),
    "/usage-negative": VLLM.format(hits=64, queries=100, running=2)
    + '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} -0.5\n',
    "/usage-over-one": VLLM.format(hits=64, queries=100, running=2)
    + '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.2\n'
    + 'vllm:kv_cache_usage_perc{engine="1"} 3\n',
    "/duplicate": VLLM.format(hits=64, queries=100, running=2) + 'vllm:prompt_tokens_total{engine="0"} 5\n',
    "/no-lookups-yet": VLLM.format(hits=0, queries=0, running=0),
    "/router-invalid": sgl_router_0_2({"http://w1:8000": "NaN", "http://w2:8000": 5}, 0, 0),
}


@pytest.fixture(scope="module")
def broken() -> Iterator[str]:
    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            self.answer(200, BROKEN[self.path].encode(), "text/plain; version=0.0.4")

    with loopback_http(Handler) as url:
        yield url


def scraped(url: str, capsys) -> tuple[dict, dict[str, str]]:
    """`kvwatch scrape` of one URL: its --json record and its text rows by label."""
    assert main(["scrape", "--json", url]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert main(["scrape", url]) == 0
    rows = dict(line.strip().split("  ", 1) for line in capsys.readouterr().out.splitlines()[1:])
    return record, {label: value.strip() for label, value in rows.items()}


@pytest.mark.parametrize(
    "path, invalid, figure, row, shown",
    [
        ("/invalid-lookups", {HITS: "NaN", "vllm:prefix_cache_queries_total": "-5.0"}, "local_hit_ratio",
         "local lookups", "unknown: no usable lookup counter"),
        ("/usage-negative", {"vllm:kv_cache_usage_perc": "-0.5"}, "kv_cache_usage", "KV cache usage", "n/a"),
        ("/usage-over-one", {"vllm:kv_cache_usage_perc": "3.0"}, "kv_cache_usage", "KV cache usage", "n/a"),
        ("/duplicate", {"vllm:prompt_tokens_total": 'duplicate {engine="0"}'}, "prompt_tokens", "tokens",
         "n/a prompt, 64 cached"),
    ],
)  # fmt: skip
def test_a_figure_built_on_an_invalid_or_duplicated_series_is_unknown_and_the_series_named(
    broken, capsys, path, invalid, figure, row, shown
):
    record, rows = scraped(f"{broken}{path}", capsys)
    assert record["invalid"] == invalid and record[figure] is None, record
    assert rows[row] == shown
    named = ", ".join(f"{name} = {value}" for name, value in invalid.items())
    assert rows["invalid series"] == f"{named} (no measurement: not counted)"


def test_a_routers_invalid_per_worker_counter_is_no_count_of_none(broken, capsys):
    record, rows = scraped(f"{broken}/router-invalid", capsys)
    assert record["per_worker"] == {} and record["invalid"]["sgl_router_processed_requests_total"] == "NaN"
    assert rows["requests per worker"] == "unknown: see invalid series"


def test_no_lookups_is_said_only_when_the_lookup_counter_says_so(broken, capsys):
    record, rows = scraped(f"{broken}/no-lookups-yet", capsys)
    assert (record["local_lookups"], record["invalid"]) == (0, {})
    assert rows["local lookups"] == "none since start"


def test_the_size_cap_applies_to_files(tmp_path):
    path = tmp_path / "metrics.prom"
    path.write_text("".join(f'vllm:kv_cache_usage_perc{{engine="{i}"}} 0.1\n' for i in range(10)))
    (result,) = asyncio.run(scrape([str(path)], max_bytes=100))
    assert result.error == f"{path}: more than 100 bytes (the size cap; see --max-bytes)"
    (result,) = asyncio.run(scrape([str(path)], max_bytes=1000))
    assert result.error is None and result.record.kv_cache_usage == pytest.approx(0.1)


def test_an_explicit_flavour_reads_what_detection_would_refuse(tmp_path):
    """An exposition with nothing kvwatch knows: named as vLLM, every expected series is missing."""
    path = tmp_path / "node-exporter.prom"
    path.write_text("# TYPE node_load1 gauge\nnode_load1 0.42\n")
    (result,) = asyncio.run(scrape([str(path)], flavour=ENGINE_FLAVOURS["vllm"]))
    assert result.error is None
    assert result.record.hit_ratio is None
    assert "vllm:prefix_cache_hits_total" in result.record.missing


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--interval", "0"], "must be positive, not 0"),
        (["--timeout", "-1"], "must be positive, not -1"),
        (["--flavour", "triton"], "invalid choice: 'triton'"),
    ],
)
def test_bad_options_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["scrape", *args, "metrics.prom"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
