"""The A/B experiment and Doctor pages: reports shown and run, and the directory they stay under."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import streamlit as st
from fake_dashboard import (
    CONFIG,
    LOAD,
    REPLICAS,
    REPORTS,
    metrics,
    open_page,
    texts,
)
from fake_dashboard import fake as fake  # the fixtures
from fake_dashboard import no_component_scan as no_component_scan

from conftest import experiment_replica_bars
from kvwatch.config.settings import DashboardSettings, Target
from kvwatch.dashboard import data
from kvwatch.dashboard.data import Result


def test_experiment_shows_a_report_and_runs_one(fake):
    fake.report = Result(data.Report(Path("/tmp/x"), "## A/B experiment: a vs b\n\n| round |\n|---|\n", None))
    at = open_page("experiment")
    assert not at.exception
    assert "## A/B experiment: a vs b" in texts(at)
    at.number_input(key="experiment_sessions").set_value(3)
    at.button[0].click().run()
    assert "Done: the report is below." in texts(at)
    affinity, round_robin = CONFIG.targets
    assert fake.runs == [(round_robin, affinity, REPORTS, 3, 6, 0, None, None)]  # A spreads, B is sticky


def test_the_experiment_runs_under_the_load_set(fake):
    at = open_page("experiment")
    at.number_input(key="experiment_concurrency").set_value(4)
    at.number_input(key="experiment_request_rate").set_value(2.5)
    at.button[0].click().run()
    affinity, round_robin = CONFIG.targets
    assert fake.runs == [(round_robin, affinity, REPORTS, 20, 6, 0, 4, 2.5)]


def test_experiment_shows_each_routes_throughput_and_p99_and_each_replicas_load(fake):
    fake.report = Result(data.Report(Path("/tmp/x"), "## A/B experiment: rr vs aff\n", None, LOAD, REPLICAS))
    at = open_page("experiment")
    assert not at.exception
    shown = metrics(at)
    assert shown["rr: requests/s"] == ["3.21"] and shown["aff: requests/s"] == ["-"]
    assert shown["rr: TTFT p99 (ms)"] == ["250"] and shown["aff: TTFT p99 (ms)"] == ["-"]
    (p99,) = [m for m in at.metric if m.label == "rr: TTFT p99 (ms)"]
    assert "interval 200–310 ms; median 40 ms, p90 90 ms" in p99.help
    assert experiment_replica_bars(at) == {"rr": {"r0": 60, "r1": 60}, "aff": {"r0": 120}}


def test_an_older_report_without_load_files_shows_its_markdown_only(fake):
    fake.report = Result(data.Report(Path("/tmp/x"), "## A/B experiment: a vs b\n", None))
    at = open_page("experiment")
    assert not at.exception and not at.metric and not at.get("plotly_chart")
    assert "## A/B experiment: a vs b" in texts(at)


def test_the_experiment_runs_configured_targets_with_their_own_key_sources_only(fake):
    """Nothing to type but a report directory: no URL, no variable or file to take a key from."""
    keyed = Target("keyed", "http://127.0.0.1:18100", "m", api_key_env="KEYED_API_KEY")
    filed = Target("filed", "http://127.0.0.1:18101", "m", api_key_file=Path("/run/secrets/filed-key"))
    fake.settings = Result(replace(CONFIG, targets=(*CONFIG.targets, keyed, filed)))
    at = open_page("experiment")
    assert [field.key for field in at.text_input] == ["experiment_dir"]
    assert at.selectbox(key="experiment_a").options == [
        "lab-affinity (affinity, http://127.0.0.1:18000)",
        "lab-round-robin (round_robin, http://127.0.0.1:18001)",
        "keyed (affinity, http://127.0.0.1:18100)",
        "filed (affinity, http://127.0.0.1:18101)",
    ]
    at.selectbox(key="experiment_a").set_value(keyed)
    at.selectbox(key="experiment_b").set_value(filed)
    at.button[0].click().run()
    assert fake.runs == [(keyed, filed, REPORTS, 20, 6, 0, None, None)]  # as configured, key sources and all


def test_reports_are_read_and_written_under_the_report_directory_only(fake, tmp_path):
    root, outside = tmp_path / "reports", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    fake.settings = Result(replace(CONFIG, dashboard=DashboardSettings(root)))
    at = open_page("experiment")
    for name in ("../outside", "link", str(outside)):
        at.text_input(key="experiment_dir").set_value(name).run()
        assert [e.value for e in at.error] == [
            f'"{name}" is outside the report directory {root}: name a directory under it.'
        ]
        assert not at.button  # no form to run one there
    at.text_input(key="experiment_dir").set_value("ab-1").run()
    at.button[0].click().run()
    assert fake.reports_read == [root, root / "ab-1", root / "ab-1"]  # before and after the run
    assert [run[2] for run in fake.runs] == [root / "ab-1"]


def test_a_report_directory_that_cannot_be_resolved_is_named(fake, tmp_path):
    fake.settings = Result(replace(CONFIG, dashboard=DashboardSettings(tmp_path)))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert data.report_directory("loop").error.startswith('"loop" cannot be a report directory: ')
    assert data.report_directory("a\0b").error == '"a\0b" cannot be a report directory: embedded null byte'


LONG_NAME = "r" * 5000
TOO_LONG = f'"{"r" * 79}…" (5,000 characters) cannot be a report directory: File name too long.'


def test_a_report_name_too_long_for_the_file_system_is_named_cut_and_the_page_goes_on(fake, tmp_path):
    fake.settings = Result(replace(CONFIG, dashboard=DashboardSettings(tmp_path)))
    at = open_page("experiment")
    at.text_input(key="experiment_dir").set_value(LONG_NAME).run()
    assert not at.exception
    assert [e.value for e in at.error] == [TOO_LONG]
    assert not at.button and fake.reports_read == [tmp_path]  # nothing read or run there
    at.text_input(key="experiment_dir").set_value("ab-1").run()
    assert not at.error and fake.reports_read == [tmp_path, tmp_path / "ab-1"]


def test_the_report_reader_names_a_directory_it_cannot_look_into(monkeypatch, tmp_path):
    """The real data layer on a real directory: a name over 255 bytes, or a path over 4096, is refused
    with its length; the reader itself answers an error, not an OSError, for such a directory."""
    monkeypatch.setattr(
        data, "settings", lambda: Result(replace(CONFIG, dashboard=DashboardSettings(tmp_path)))
    )
    assert data.report_directory(LONG_NAME).error == TOO_LONG
    deep = "/".join(["d" * 200] * 25)
    assert data.report_directory(deep).error.endswith(
        "(5,024 characters) cannot be a report directory: File name too long."
    )
    st.cache_data.clear()
    assert data.experiment_report(tmp_path / LONG_NAME).error.startswith("Cannot read the experiment report")


def test_doctor_runs_and_lists_its_findings(fake):
    fake.doctor = Result(
        {"checks": [{"name": "reachability", "status": "pass", "evidence": "200", "fix": ""},
                    {"name": "hash key", "status": "fail", "evidence": "4 backends", "fix": "hash on it"}],
         "causes": ["hash_key_not_session"]}
    )  # fmt: skip
    at = open_page("doctor")
    at.button(key="doctor_run").click().run()
    assert not at.exception
    assert fake.runs == [("lab-affinity", "")]
    assert "hash_key_not_session" in at.error[0].value
    assert list(at.table[0].value["status"]) == ["pass", "fail"]
