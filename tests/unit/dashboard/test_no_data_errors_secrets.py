"""Every page with no data or no series to judge, in each error state, and never showing a secret."""

from __future__ import annotations

from dataclasses import replace

import pytest
import streamlit as st
from fake_dashboard import (
    ALERTMANAGER,
    BAD_CONFIG,
    CONFIG,
    DOWN,
    KEY,
    KEY_ENV,
    NO_ALERTMANAGER,
    NO_FRAME,
    NO_STORE,
    PAGES,
    PROMETHEUS,
    REPORTS,
    URL_PASSWORD,
    metrics,
    open_page,
    texts,
)
from fake_dashboard import config_file as config_file  # the fixtures
from fake_dashboard import fake as fake
from fake_dashboard import no_component_scan as no_component_scan
from streamlit.testing.v1 import AppTest

from kvwatch.alerts.verdicts import (
    CLUSTER_HIT_RATIO_DROP,
    INSTANCE_HIT_RATIO_DROP,
    LISTENER_SPREAD,
    LOAD_IMBALANCE,
    ROUTE_STICKY,
    ROUTE_WARM_ROUNDS,
    ROUTER_PREDICTION_MISS,
    VERDICTS,
)
from kvwatch.config.settings import Service
from kvwatch.dashboard import data
from kvwatch.dashboard.data import Result
from kvwatch.prometheus import queries

# --- empty ---------------------------------------------------------------------------------------------


EMPTY = {
    "overview": "no data",
    "per_round": "No successful probe rounds in this range yet",
    "replicas": "No engine served prompt tokens in this range",
    "sessions": "No probe sessions through lab-affinity in this range yet",
    "alerts": "Alertmanager holds no kvwatch alert",
    "experiment": f"No experiment report in {REPORTS} yet",
    "doctor": "The doctor sends a few short multi-turn sessions through http://127.0.0.1:18000",
}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_says_when_there_is_no_data_yet(fake, page):
    fake.empty = True
    at = open_page(page)
    assert not at.exception and not at.error
    assert EMPTY[page] in texts(at) + str(metrics(at))


def test_the_overview_without_data_says_so_in_every_tile(fake):
    fake.empty = True
    shown = metrics(open_page("overview"))
    assert shown.pop("Cluster hit ratio") == ["no data"]
    assert shown == dict.fromkeys(
        ["Sessions on one replica", "Warm / cold TTFT", "Affinity efficiency"], ["no data", "no data"]
    )  # per target; no gateway listener seen yet
    assert texts(open_page("overview")).count("No session came back through the gateway log") == 2


@pytest.mark.parametrize("page", ["overview", "replicas"])
def test_every_verdict_whose_series_is_absent_says_it_is_not_watching(fake, page):
    """No state of a verdict's alert: Prometheus holds no series it judges. Never green, never "fine"."""
    for verdict in (*VERDICTS, ROUTER_PREDICTION_MISS):
        fake.values[verdict.state] = NO_FRAME
    said = texts(open_page(page))
    assert ":green[" not in said
    judged = {"overview": (CLUSTER_HIT_RATIO_DROP, ROUTE_STICKY, ROUTE_WARM_ROUNDS, LISTENER_SPREAD),
              "replicas": (INSTANCE_HIT_RATIO_DROP, LOAD_IMBALANCE)}[page]  # fmt: skip
    for verdict in judged:
        assert (
            f":gray[Not watching: Prometheus holds no series {verdict.alert.name} judges here now.]" in said
        )


# --- errors --------------------------------------------------------------------------------------------

PROMETHEUS_PAGES = ("overview", "replicas")
STORE_PAGES = ("per_round", "sessions", "alerts")


@pytest.mark.parametrize(
    "source, error, page",
    [("prometheus", DOWN, page) for page in PROMETHEUS_PAGES]
    + [("store", NO_STORE, page) for page in STORE_PAGES],
)
def test_an_unreachable_prometheus_or_a_missing_store_is_named(fake, source, error, page):
    setattr(fake, source, error)
    at = open_page(page)
    assert not at.exception
    assert at.error[0].value == error


def test_an_unreachable_alertmanager_leaves_the_received_alerts(fake):
    fake.alertmanager = NO_ALERTMANAGER
    at = open_page("alerts")
    assert [e.value for e in at.error] == [NO_ALERTMANAGER]
    assert list(at.dataframe[0].value["state"]) == ["firing"]


@pytest.mark.parametrize("page", PAGES)
def test_a_bad_config_is_named(fake, page):
    fake.settings = Result(error=BAD_CONFIG)
    at = open_page(page)
    assert not at.exception
    assert at.error[0].value == BAD_CONFIG


def test_an_unreadable_experiment_report_is_named(fake):
    fake.report = Result(error="Cannot read the experiment report in /tmp/x: [Errno 13] Permission denied")
    assert "Permission denied" in open_page("experiment").error[0].value


def test_a_failing_doctor_run_is_named(fake):
    fake.doctor = Result(error="target lab-affinity: environment variable LAB_KEY is not set")
    at = open_page("doctor")
    at.button(key="doctor_run").click().run()
    assert at.error[0].value == "target lab-affinity: environment variable LAB_KEY is not set"


# --- secrets -------------------------------------------------------------------------------------------


def with_password(url: str) -> str:
    return url.replace("://", f"://probe:{URL_PASSWORD}@")


SECRET_CONFIG = replace(
    CONFIG,
    targets=tuple(
        replace(t, base_url=with_password(t.base_url), api_key_env=KEY_ENV) for t in CONFIG.targets
    ),
    prometheus=Service(with_password(PROMETHEUS)),
    alertmanager=Service(with_password(ALERTMANAGER)),
)


def rendered(at: AppTest) -> str:
    """Everything the page sent to the browser, each element's whole message: texts, labels, options,
    tables, charts and exceptions."""

    def walk(node) -> list[str]:
        children = getattr(node, "children", {}).values()
        return [str(node.proto or ""), *(text for child in children for text in walk(child))]

    return "\n".join(text for root in (at.main, at.sidebar) for text in walk(root))


@pytest.mark.parametrize("page", PAGES)
def test_no_page_shows_a_url_password_or_the_api_key(fake, monkeypatch, page):
    monkeypatch.setenv(KEY_ENV, KEY)
    fake.settings = Result(SECRET_CONFIG)
    shown = rendered(open_page(page))
    assert "probe:" + URL_PASSWORD not in shown and URL_PASSWORD not in shown and KEY not in shown
    if page in ("overview", "experiment", "doctor"):  # they name the URLs, without the password
        assert "probe:[redacted]@127.0.0.1" in shown


def test_the_data_layer_names_urls_without_their_passwords(config_file):
    text = config_file.read_text().replace("http://", f"http://probe:{URL_PASSWORD}@")
    config_file.write_text(text)
    errors = [data.series(queries.CLUSTER_HIT_RATIO, data.span(900)).error, data.alerts().error]
    assert all(e.startswith("Cannot reach ") and "probe:[redacted]@127.0.0.1" in e for e in errors), errors
    assert not any(URL_PASSWORD in e for e in errors)
    config_file.write_text(text.replace("http://", "ftp://", 1))  # refused, and quoted in the error
    st.cache_data.clear()
    assert "probe:[redacted]@127.0.0.1" in data.settings().error
    assert URL_PASSWORD not in data.settings().error
