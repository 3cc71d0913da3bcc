"""Everything the dashboard reads, in one place and cached: Prometheus, the SQLite store, the lab's fault
log, Alertmanager, the runbook, experiment reports and the doctor.

Every reader returns a `Result`: a value, or an error that names the URL or path it tried and what to
do, never a traceback nor a URL's password. Errors are cached like values, so a dead Prometheus costs
one timeout per refresh, not one per panel. Pages ask for times on the refresh grid (`span`, `now`), so
that every panel of a refresh, and every viewer, hits the same cache entries.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pandas as pd
import streamlit as st

from kvwatch.alerts import verdicts
from kvwatch.collectors.probe import blocksize
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import Target, load_config, resolve_api_key, resolve_store_password
from kvwatch.core.connections import connect_reason, request_sync
from kvwatch.core.errors import QueryRefused, UnexpectedAnswer, Unreachable, UpstreamTimeout
from kvwatch.core.naming import RUNBOOK
from kvwatch.core.promapi import PrometheusApi
from kvwatch.core.redaction import redact
from kvwatch.dashboard import stats
from kvwatch.dashboard.defaults import DEFAULT_CONFIG, DEFAULT_REFRESH_SECONDS
from kvwatch.doctor import checks
from kvwatch.doctor.caching import Cluster
from kvwatch.experiment import runner
from kvwatch.experiment.design import Load, Workload
from kvwatch.experiment.report import FILES
from kvwatch.prometheus import panel_queries, pipeline, promql
from kvwatch.serve.scheduler import probe_settings
from kvwatch.store.databases import ERRORS as STORE_ERRORS
from kvwatch.store.history import ROUND_FIELDS, Store, StoreError


def app_options(argv: list[str]) -> argparse.Namespace:
    """What `kvwatch dashboard` passes the app after `--` (`streamlit run app.py -- --config FILE
    --refresh-seconds S`); the defaults for anything else, such as a test's own command line."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--refresh-seconds", type=int, default=DEFAULT_REFRESH_SECONDS)
    return parser.parse_known_args(argv)[0]


REFRESH_SECONDS = app_options(sys.argv[1:]).refresh_seconds  # cache lifetime, time grid, auto-refresh
SETTLE_SECONDS = 5  # samples scraped just before a time may still be on their way into Prometheus
TIMEOUT_SECONDS = 5
POINTS_PER_CHART = 240
MIN_RATE_WINDOW_SECONDS = 600  # probes run every 30 to 60 s: a narrower window often holds no run
REPO = Path(__file__).resolve().parent.parent
_cached = st.cache_data(ttl=REFRESH_SECONDS, show_spinner=False, max_entries=512)


@dataclass(frozen=True)
class Result:
    """A value, or an error message for the page to show instead; its URL passwords are redacted here,
    so that no message, whoever wrote it, shows one."""

    value: Any = None
    error: str | None = None

    def __post_init__(self):
        if self.error:
            object.__setattr__(self, "error", redact(self.error))


class Span(NamedTuple):
    """A time range in unix seconds on the refresh grid, and the step between its chart points."""

    start: float
    end: float
    step: float


def now() -> float:
    """The latest time on the refresh grid whose samples have settled: what Prometheus says about it
    will not change, so a cached answer stays true."""
    return (time.time() - SETTLE_SECONDS) // REFRESH_SECONDS * REFRESH_SECONDS


def span(seconds: float) -> Span:
    """The last `seconds` up to `now()`, with about POINTS_PER_CHART points."""
    step = max(1, round(seconds / POINTS_PER_CHART / REFRESH_SECONDS)) * REFRESH_SECONDS
    end = now()
    return Span(end - seconds, end, step)


# --- the kvwatch config ----------------------------------------------------------------------------


def config_path() -> Path:
    """The config `kvwatch dashboard` passes after `--`."""
    return app_options(sys.argv[1:]).config


@_cached
def settings() -> Result:
    """The kvwatch config: the URLs and the store path to read, and the probe targets."""
    try:
        return Result(load_config(config_path()))
    except ConfigError as error:
        return Result(error=f"{error}. Start the dashboard with `kvwatch dashboard --config FILE`.")


def _service_url(name: str) -> Result:
    config = settings()
    if config.error:
        return config
    url = getattr(config.value, name).url
    if url is None:
        return Result(error=f"No {name} URL in {config_path()}: set {name}.url to read from it.")
    return Result(url.rstrip("/"))


# --- Prometheus --------------------------------------------------------------------------------------


def filled(query: str, over: Span) -> str:
    """A query of collectors.queries with Grafana's variables set for `over`: every label matches, the
    rate window is at least MIN_RATE_WINDOW_SECONDS and at least one step, `$__range` is the span."""
    window = max(MIN_RATE_WINDOW_SECONDS, over.step)
    return panel_queries.fill_variables(
        query, window=f"{window:g}s", time_range=f"{over.end - over.start:g}s"
    )


def instant(query: str, over: Span, cluster: str | None = None) -> Result:
    """The query's value at the end of `over`, in `cluster` or else the picked one: one row per series, a
    column per label, and `value`."""
    return instant_query(in_cluster(query, cluster), over)


def series(query: str, over: Span, cluster: str | None = None) -> Result:
    """The query over a span, in `cluster` or else the picked one: one row per point, a column per label,
    `time` (UTC) and `value`."""
    return range_query(in_cluster(query, cluster), over)


@_cached
def instant_query(query: str, over: Span) -> Result:
    """`instant` of a query already narrowed: cached by it, so each cluster has its own answers."""
    expr = filled(query, over)
    return _ask_prometheus(lambda prometheus: prometheus.query(expr, at=over.end))


@_cached
def range_query(query: str, over: Span) -> Result:
    """`series` of a query already narrowed: cached by it, so each cluster has its own answers."""
    expr = filled(query, over)
    return _ask_prometheus(lambda prometheus: prometheus.query_range(expr, over.start, over.end, over.step))


@_cached
def blind_spots() -> Result:
    """The links of kvwatch's pipeline that do not hold (prometheus.pipeline): what kvwatch cannot see,
    and why, as Prometheus reports it; none while it sees everything."""
    api = _prometheus_api()
    if api.error:
        return api
    found = pipeline.links(api.value, settings().value.exporter.port)
    return Result(tuple(link for link in found if link.status != pipeline.OK))


FIRING_NONE = pd.DataFrame(columns=["alertname", "stopped_at", "clears_at", "keep_firing_for"])


@_cached
def firing_alerts(at: float) -> Result:
    """The alerts Prometheus' rules API says fire now, asked once per refresh (`at`, the page's time, is
    the cache's key): a column per label; for those its rule's keep_firing_for holds after their
    expression stopped matching, `stopped_at` (the evaluation that first found it empty), `clears_at`
    (the one that will resolve it) and `keep_firing_for` in seconds as Prometheus loaded the rule (scaled
    in a lab started with --rule-time-scale); NaT and NaN for the others."""

    def firing(prometheus: PrometheusApi) -> pd.DataFrame:
        rows = [
            {**alert["labels"], **verdicts.held(alert, rule)}
            for rule in prometheus.alerting_rules()
            for alert in rule.get("alerts", [])
            if alert.get("state") == "firing"
        ]
        return _times(pd.DataFrame(rows), "stopped_at", "clears_at") if rows else FIRING_NONE

    return _call_prometheus(firing)


# --- the cluster picked in the sidebar ----------------------------------------------------------------

PICKED_CLUSTER = "cluster"  # the sidebar's key in the session state
ALL_CLUSTERS = "all"


def clusters() -> Result:
    """The clusters Prometheus scrapes now: the values of the config's cluster_label on `up`, sorted;
    none where no target carries the label."""
    config = settings()
    if config.error:
        return config
    found = instant_query(panel_queries.clusters(config.value.cluster_label), span(REFRESH_SECONDS))
    if found.error:
        return found
    label = config.value.cluster_label
    return Result(sorted(found.value[label].dropna().unique()) if label in found.value else [])


def cluster_label() -> str | None:
    """The label that tells clusters apart (the config's cluster_label); None while the config fails."""
    config = settings()
    return None if config.error else config.value.cluster_label


def picked_cluster() -> str | None:
    """The cluster picked in the sidebar; None while every cluster is shown."""
    picked = st.session_state.get(PICKED_CLUSTER, ALL_CLUSTERS)
    return None if picked == ALL_CLUSTERS else picked


def clusters_apart() -> list[str | None]:
    """The clusters whose own figures the Overview shows one by one: every cluster while all are shown
    and Prometheus scrapes several, so that no figure sums them; else [None], the picked or only one."""
    found = clusters()
    several = picked_cluster() is None and not found.error and len(found.value) > 1
    return found.value if several else [None]


def of_picked_cluster(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of `frame` (alerts, by their labels) of the picked cluster; every row while all are shown."""
    picked, config = picked_cluster(), settings()
    if picked is None or config.error:
        return frame
    label = config.value.cluster_label
    return frame[frame[label] == picked] if label in frame else frame.iloc[0:0]


def in_cluster(query: str, cluster: str | None = None) -> str:
    """`query` with every series selector narrowed to `cluster`, else to the picked one; as it is while
    all are shown."""
    cluster, config = cluster or picked_cluster(), settings()
    if cluster is None or config.error:
        return query
    return promql.with_matcher(query, panel_queries.one_cluster(config.value.cluster_label, cluster))


def _ask_prometheus(ask: Callable[[PrometheusApi], list[dict]]) -> Result:
    """One query to Prometheus, within TIMEOUT_SECONDS in all: its answer as a frame, or its failure in
    one line."""
    return _call_prometheus(lambda prometheus: _frame(ask(prometheus)))


def _prometheus_api() -> Result:
    """The client of prometheus.url, asking prometheus.rules_url for the rules and alerts where set."""
    url = _service_url("prometheus")
    if url.error:
        return url
    config = settings()
    rules_url = None if config.error else config.value.prometheus.rules_url
    return Result(PrometheusApi(url.value, TIMEOUT_SECONDS, rules_url))


def _call_prometheus(ask: Callable[[PrometheusApi], pd.DataFrame]) -> Result:
    """One call of Prometheus' API, within TIMEOUT_SECONDS in all: its frame, or its failure in one line."""
    api = _prometheus_api()
    if api.error:
        return api
    where = f"Prometheus at {api.value.url}"
    try:
        return Result(ask(api.value))
    except UpstreamTimeout:
        return Result(error=f"{where} did not answer within {TIMEOUT_SECONDS} s.")
    except Unreachable as error:
        return Result(error=f"Cannot reach {where}: {error}. Is it running?")
    except QueryRefused as error:
        return Result(error=f"{where} refused the query: {error}")
    except UnexpectedAnswer as error:
        return Result(error=f"{where} did not answer like the Prometheus API: {error}")


def _frame(result: list[dict]) -> pd.DataFrame:
    rows = [
        {**item["metric"], "time": float(t), "value": float(v)}
        for item in result
        for t, v in (item["values"] if "values" in item else [item["value"]])
    ]
    frame = pd.DataFrame(rows) if rows else pd.DataFrame(columns=["time", "value"])
    frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
    return frame


# --- the SQLite store --------------------------------------------------------------------------------


@_cached
def sessions(since: float) -> Result:
    """Probe sessions that started at `since` or later, newest first (columns of the sessions table)."""
    return _read_store(lambda store: _times(pd.DataFrame(store.sessions(since=since)), "started_at"))


@_cached
def rounds(since: float, target: str | None = None, session: int | None = None) -> Result:
    """The rounds of the probe sessions that started at `since` or later (of one target, or the one
    session, when given), newest session first."""
    return _read_rounds(ROUND_FIELDS, target=target, since=since, session=session)


def _read_rounds(columns: tuple[str, ...], **matching) -> Result:
    def read(store: Store) -> pd.DataFrame:
        return _times(
            pd.DataFrame(store.rounds(**matching, columns=columns), columns=list(columns)), "started_at"
        )

    return _read_store(read)


@_cached
def received_alerts(since: float) -> Result:
    """Alerts kvwatch's webhook received at `since` or later, newest first, in the shape of `alerts()`."""

    def read(store: Store) -> pd.DataFrame:
        frame = _alert_frame(
            {
                **alert["labels"],
                **alert["annotations"],
                "state": alert["status"],
                "starts_at": alert["starts_at"],
                "ends_at": alert["ends_at"],
                "received_at": alert["received_at"],
            }
            for alert in store.alerts(since=since)
        )
        return _times(frame, "received_at", "starts_at", "ends_at")

    return _read_store(read)


# What the per-round statistics read of a round: a day of rounds is read several times faster than whole.
TTFT_COLUMNS = ("target", "route_mode", "round", "started_at", "error_kind", "ttft_seconds")


@_cached
def ttft_by_round(since: float, split: float | None = None) -> Result:
    """Median and p90 TTFT per target and round of the probe sessions since `since`, before and after
    `split` when it is given (dashboard.stats)."""
    found = _read_rounds(TTFT_COLUMNS, since=since)
    if found.error or found.value.empty:
        return found
    return Result(stats.ttft_by_round(found.value, split))


FAULT_COLUMNS = ["unix", "action", "fault", "replica", "address"]


@_cached
def faults(since: float) -> Result:
    """The faults and heals at `since` or later, oldest first (time, action, fault, replica, address),
    from the faults.log the lab keeps beside its store; none for a store that is not the lab's."""
    config = settings()
    if config.error:
        return config
    path = Path(config.value.store.path).parent / "faults.log"
    try:
        entries = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
        frame = pd.DataFrame(
            [entry for entry in entries if entry["unix"] >= since],
            columns=FAULT_COLUMNS,
        )
    except FileNotFoundError:
        frame = pd.DataFrame(columns=FAULT_COLUMNS)
    except OSError as error:
        return Result(error=f"Cannot read the lab's fault log {path}: {error.strerror}")
    except (ValueError, KeyError, TypeError):
        return Result(error=f"{path} is not the lab's fault log: a JSON object with `unix` per line.")
    return Result(_times(frame.rename(columns={"unix": "time"}), "time"))


def _read_store(read: Callable[[Store], pd.DataFrame]) -> Result:
    config = settings()
    if config.error:
        return config
    store_settings = config.value.store
    try:
        password = resolve_store_password(store_settings)
        with Store(store_settings.location, readonly=True, password=password) as store:
            return Result(read(store))
    except ConfigError as error:
        return Result(error=str(error))
    except StoreError as error:
        key = "url" if store_settings.url else "path"
        return Result(error=f"{error}: `kvwatch serve` creates it (store.{key} in {config_path()}).")
    except STORE_ERRORS as error:
        return Result(error=f"Cannot read the kvwatch store {redact(str(store_settings.location))}: {error}")


def _times(frame: pd.DataFrame, *columns: str) -> pd.DataFrame:
    for column in columns:
        if column in frame:
            frame[column] = pd.to_datetime(frame[column], unit="s", utc=True)
    return frame


# --- Alertmanager and the runbook --------------------------------------------------------------------

ALERT_COLUMNS = (
    "alertname",
    "severity",
    "state",
    "target",
    "instance",
    "starts_at",
    "ends_at",
    "summary",
    "runbook_url",
)


@_cached
def alerts() -> Result:
    """The alerts Alertmanager holds now (state: active, suppressed), from its v2 API."""
    base = _service_url("alertmanager")
    if base.error:
        return base
    url = f"{base.value}/api/v2/alerts"
    try:
        response = request_sync("GET", url, TIMEOUT_SECONDS)
        response.raise_for_status()
        held = response.json()
        return Result(
            _alert_frame(
                {
                    **a["labels"],
                    **a["annotations"],
                    "state": a["status"]["state"],
                    "starts_at": pd.Timestamp(a["startsAt"]),
                }
                for a in held
            )
        )
    except httpx.TimeoutException:
        return Result(error=f"Alertmanager at {url} did not answer within {TIMEOUT_SECONDS} s.")
    except httpx.HTTPStatusError as error:
        return Result(error=f"Alertmanager at {url} answered HTTP {error.response.status_code}.")
    except httpx.HTTPError as error:
        return Result(error=f"Cannot reach Alertmanager at {url}: {connect_reason(error)}. Is it running?")
    except (ValueError, KeyError, TypeError):
        return Result(error=f"{url} did not answer like Alertmanager's v2 API.")


def _alert_frame(rows) -> pd.DataFrame:
    frame = pd.DataFrame(list(rows))
    for column in ALERT_COLUMNS:
        if column not in frame:
            frame[column] = None
    return frame


@_cached
def runbook(url: str) -> Result:
    """The Markdown section of kvwatch's runbook an alert's runbook_url points at (the config's
    dashboard.runbook_url, then #anchor), read from the copy kvwatch ships; None for another runbook."""
    config = settings()
    if config.error:
        return config
    page, _, anchor = url.partition("#")
    if page != config.value.dashboard.runbook_url:
        return Result(None)
    path = REPO / RUNBOOK
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        return Result(error=f"Cannot read the runbook {path}: {error.strerror}")
    sections = re.split(r"^(?=## )", text, flags=re.MULTILINE)
    for section in sections:
        heading = section.partition("\n")[0].removeprefix("## ")
        if re.sub(r"[^\w -]", "", heading.lower()).replace(" ", "-") == anchor.lower():
            return Result(section)
    return Result(error=f"No section #{anchor} in the runbook {path}.")


# --- experiment reports and the doctor ------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    directory: Path
    markdown: str
    plot: bytes | None  # the PNG, when it was drawn
    load: pd.DataFrame | None = None  # load.csv: throughput and TTFT per route; None in older reports
    replicas: pd.DataFrame | None = None  # replicas.csv: the requests each replica served per route


MAX_SHOWN_NAME = 80  # characters of a report directory's name in a message


def _shown_name(name: str) -> str:
    """A name as a message quotes it: cut, with its length, when it is long."""
    if len(name) <= MAX_SHOWN_NAME:
        return f'"{name}"'
    return f'"{name[: MAX_SHOWN_NAME - 1]}…" ({len(name):,} characters)'


def report_directory(name: str) -> Result:
    """The directory `name` under the configured report directory, resolved; an error when `name` leads
    out of it (`..`, an absolute path, a symlink): viewers read and write reports there only. A name the
    file system cannot hold (a component over 255 bytes, a path over 4096) is an error here too, not an
    OSError where the report is read."""
    config = settings()
    if config.error:
        return config
    root = config.value.dashboard.report_directory
    try:
        path = (root / name).resolve()
        inside = path.is_relative_to(root.resolve())
        path.exists()  # raises for a name too long; the answer itself is the report reader's concern
    except OSError as error:
        return Result(error=f"{_shown_name(name)} cannot be a report directory: {error.strerror or error}.")
    except (ValueError, RuntimeError) as error:  # a NUL byte, a symlink loop
        return Result(error=f"{_shown_name(name)} cannot be a report directory: {error}")
    if not inside:
        return Result(
            error=f"{_shown_name(name)} is outside the report directory {root}: name a directory under it."
        )
    return Result(path)


@_cached
def experiment_report(directory: Path) -> Result:
    """The report `kvwatch experiment --out DIR` wrote into `directory`; None when there is none yet."""
    files = {name: directory / FILES[name] for name in ("report", "png", "load", "replicas")}
    try:
        if not files["report"].exists():
            return Result(None)
        markdown = files["report"].read_text(encoding="utf-8")
        plot = files["png"].read_bytes() if files["png"].is_file() else None
        load, replicas = (pd.read_csv(files[n]) if files[n].is_file() else None for n in ("load", "replicas"))
        return Result(Report(directory, markdown, plot, load, replicas))
    except (OSError, UnicodeDecodeError, ValueError) as error:  # pandas' parse errors are ValueErrors
        return Result(error=f"Cannot read the experiment report in {directory}: {error}")


def run_experiment(
    a: Target,
    b: Target,
    out: Path,
    sessions: int,
    rounds: int,
    seed: int,
    concurrency: int | None = None,
    request_rate: float | None = None,
) -> Result:
    """The A/B experiment of two configured targets, written into `out` (from `report_directory`), under
    the load `kvwatch experiment --concurrency --request-rate` sets. Each route gets only its own URL, API
    key and session settings from the config. The value says what went wrong with failed sessions, []
    when none failed. Not cached: it measures."""
    config = settings()
    if config.error:
        return config
    try:
        routes = [probe_settings(target, resolve_api_key(target)) for target in (a, b)]
        workload = Workload(sessions, rounds, seed=seed)
        load = Load(concurrency, request_rate, seed)
        sources = blocksize.sources_for([a.base_url, b.base_url], config.value.prometheus.url)
        ran, markdown = runner.run_into(*routes, workload, out, load, block_sources=sources)
    except (ConfigError, ValueError, OSError) as error:
        return Result(error=f"The experiment cannot run: {error}")
    finally:
        experiment_report.clear()
    said = runner.failures(ran)
    return Result(said) if markdown is not None else Result(error="; ".join(said))


def run_doctor(target: Target, requests_sample: str | None = None) -> Result:
    """`kvwatch doctor` against one configured target (and the configured Prometheus, in the picked
    cluster alone when one is picked): its checks and causes. Not cached: each run examines the route
    anew."""
    config = settings()
    if config.error:
        return config
    try:
        probe = probe_settings(target, resolve_api_key(target))
    except ConfigError as error:
        return Result(error=str(error))
    if requests_sample and not Path(requests_sample).is_file():
        return Result(error=f"No request sample at {requests_sample}.")
    picked = picked_cluster()
    cluster = Cluster(picked, config.value.cluster_label)
    prometheus = config.value.prometheus.url
    return Result(checks.diagnose(probe, prometheus, requests_sample or None, cluster=cluster).as_json())
