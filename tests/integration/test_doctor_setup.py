"""`kvwatch doctor --setup` and the Overview against real components: a lab where every link holds, then
each link broken for real. A Prometheus of "their own" that scrapes the lab's engines and evaluates
kvwatch's rules but does not scrape `kvwatch serve`: the doctor names that link, and the Overview in
Chromium shows no healthy banner and names the missing scrape. Other Prometheus and Alertmanager
configurations break the other links; a stopped `kvwatch serve` breaks its own."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from playwright import sync_api

from kvwatch.lab.process import kvwatch_command
from labs import stop_lab_serve
from paths import REPO
from processes import free_port, kvwatch, stop, wait_http

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts"
WAIT_S = 120  # generous: the machine may be busy with other tests
EVERY_LINK = [
    "kvwatch serve answers",
    "Prometheus answers",
    "Prometheus scrapes kvwatch serve",
    "Prometheus scrapes the engines",
    "Prometheus evaluates kvwatch's rules",
    "Prometheus sends alerts to Alertmanager",
    "Alertmanager routes kvwatch's alerts to its webhook",
    "The dashboard reads the store",
]


@pytest.fixture(scope="module")
def lab(start_lab):
    return start_lab("--replicas", "2", "--users", "1")


def lab_yaml(lab, name: str) -> dict:
    return yaml.safe_load((lab.state_dir / name).read_text())


def setup_links(config: Path) -> tuple[int, dict[str, str], str]:
    """`kvwatch doctor --setup`'s exit code, each link's word (PASS, FAIL, UNKNOWN) and its output."""
    result = kvwatch("doctor", "--setup", "--config", str(config))
    words = dict(
        (name, word)
        for word, name in re.findall(r"^(PASS|FAIL|UNKNOWN) +([^:]+):", result.stdout, flags=re.MULTILINE)
    )
    return result.returncode, words, " ".join((result.stdout + result.stderr).split())  # unwrapped


def until_links(config: Path, holds: Callable[[dict[str, str]], bool]) -> tuple[int, dict[str, str], str]:
    """`setup_links` once `holds` (a fresh Prometheus has not scraped yet), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        code, words, said = setup_links(config)
        if holds(words) or time.monotonic() > deadline:
            return code, words, said
        time.sleep(1)


def warmed_up(words: dict[str, str]) -> bool:
    """A fresh Prometheus of the lab's configuration has scraped the engines, evaluated the rules and found
    the Alertmanager."""
    warming = ("Prometheus scrapes the engines", "Prometheus evaluates kvwatch's rules",
               "Prometheus sends alerts to Alertmanager")  # fmt: skip
    return all(words.get(link) == "PASS" for link in warming)


def config_with(lab, tmp_path: Path, **sections: dict) -> Path:
    """The lab's kvwatch config with these sections changed, in a file of its own."""
    config = lab_yaml(lab, "kvwatch.yaml")
    for section, changes in sections.items():
        config[section] = {**config[section], **changes}
    path = tmp_path / "kvwatch.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def start_process(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start a real server from its argv; its base URL once `ready` answers. Stopped after the test."""
    started: list[subprocess.Popen] = []

    def start(name: str, argv: list[str], port: int, ready: str) -> str:
        log = tmp_path / f"{name}.log"
        with log.open("w") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        started.append(process)
        wait_http(f"http://127.0.0.1:{port}{ready}", process, log, timeout=60)
        return f"http://127.0.0.1:{port}"

    yield start
    for process in started:
        stop(process)


@pytest.fixture
def their_prometheus(lab, tmp_path, start_process) -> Callable[..., str]:
    """A real Prometheus of the lab's configuration with some of it left out: `without` scrape jobs,
    and `rule_files` or `alerting` dropped."""

    def start(without_jobs: tuple[str, ...] = (), *without_sections: str) -> str:
        config = lab_yaml(lab, "prometheus.yml")
        config["scrape_configs"] = [j for j in config["scrape_configs"] if j["job_name"] not in without_jobs]
        for section in without_sections:
            del config[section]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        argv = ["/usr/bin/prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--storage.tsdb.path={tmp_path / 'data'}"]  # fmt: skip
        return start_process("prometheus", argv, port, "/-/ready")

    return start


def test_in_a_lab_every_link_holds(lab):
    code, words, said = until_links(lab.state_dir / "kvwatch.yaml", lambda w: set(w.values()) == {"PASS"})
    assert words == dict.fromkeys(EVERY_LINK, "PASS"), said
    assert code == 0 and "every link holds" in said
    assert "with kvwatch's token" in said


def test_a_prometheus_without_engines_rules_or_alertmanager_names_each(lab, tmp_path, their_prometheus):
    prometheus = their_prometheus(("replicas",), "rule_files", "alerting")
    config = config_with(lab, tmp_path, prometheus={"url": prometheus})
    code, words, said = until_links(config, lambda w: w.get("Prometheus scrapes kvwatch serve") == "PASS")
    broken = ("Prometheus scrapes the engines", "Prometheus evaluates kvwatch's rules",
              "Prometheus sends alerts to Alertmanager")  # fmt: skip
    assert words == {**dict.fromkeys(EVERY_LINK, "PASS"), **dict.fromkeys(broken, "FAIL")}, said
    assert code == 1
    assert "Rule groups not loaded: kvwatch-engines (prometheus/rules/kvwatch-engines.yml)" in said
    assert "no vLLM or SGLang engine series" in said and "to no Alertmanager" in said


@pytest.mark.parametrize("receiver", ["no webhook", "another token"])
def test_an_alertmanager_that_does_not_reach_the_webhook_with_the_token_is_named(
    lab, tmp_path, start_process, receiver
):
    """A real Alertmanager whose running configuration `amtool config routes test` reads from its API."""
    config = lab_yaml(lab, "alertmanager.yml")
    (kvwatch_receiver,) = [r for r in config["receivers"] if r["name"] == "kvwatch"]
    if receiver == "no webhook":
        kvwatch_receiver.pop("webhook_configs")
    else:
        (tmp_path / "token").write_text("not-kvwatchs-token\n")
        hook = kvwatch_receiver["webhook_configs"][0]
        hook["http_config"]["authorization"]["credentials_file"] = str(tmp_path / "token")
    (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = ["/usr/bin/prometheus-alertmanager", f"--config.file={tmp_path / 'alertmanager.yml'}",
            f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address="]  # fmt: skip
    alertmanager = start_process("alertmanager", argv, port, "/-/ready")
    code, words, said = setup_links(config_with(lab, tmp_path, alertmanager={"url": alertmanager}))
    link = "Alertmanager routes kvwatch's alerts to its webhook"
    assert (code, words[link]) == (1, "FAIL"), said
    expected = {
        "no webhook": "none posts to kvwatch's webhook",
        "another token": "a token that is not kvwatch's",
    }
    assert expected[receiver] in said
    assert "not-kvwatchs-token" not in said


def test_a_store_that_is_not_there_is_named(lab, tmp_path):
    config = config_with(lab, tmp_path, store={"path": str(tmp_path / "nowhere.db")})
    code, words, said = setup_links(config)
    assert (code, words["The dashboard reads the store"]) == (1, "FAIL"), said
    assert f"no kvwatch store at {tmp_path / 'nowhere.db'}" in said


# The banner, and a verdict of the routes' tiles below the cache tiles: the page has drawn them.
DRAWN_LAST = (
    'the link "Prometheus scrapes kvwatch serve" is broken',
    "Not watching: Prometheus holds no series KVWatchWarmRoundNoGain",
)


# --- a Prometheus that does not scrape serve: the doctor, and the Overview in Chromium ------------------


def test_with_serve_unscraped_the_doctor_and_the_overview_name_the_missing_scrape(
    lab, tmp_path, their_prometheus, start_process
):
    """The issue's blind kvwatch: their Prometheus scrapes the engines, evaluates the rules and alerts
    Alertmanager, but not `kvwatch serve`."""
    assert CHROMIUM.exists(), "Debian's chromium is not installed (make bootstrap installs it)"
    config = config_with(lab, tmp_path, prometheus={"url": their_prometheus(("kvwatch",))})
    exporter_port = lab_yaml(lab, "kvwatch.yaml")["exporter"]["listen"].rpartition(":")[2]
    code, words, said = until_links(config, warmed_up)
    assert words == {**dict.fromkeys(EVERY_LINK, "PASS"), "Prometheus scrapes kvwatch serve": "FAIL"}, said
    assert code == 1
    assert f"no scrape target on port {exporter_port}" in said
    assert f"fix: Add a scrape job for kvwatch serve's /metrics on port {exporter_port}" in said

    port = free_port()
    argv = kvwatch_command(
        "dashboard", "--config", str(config), "--port", str(port), "--refresh-seconds", "2"
    )
    dashboard = start_process("dashboard", argv, port, "/_stcore/health")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(dashboard)
            for text in DRAWN_LAST:
                page.get_by_text(text).first.wait_for(timeout=WAIT_S * 1000)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "overview-not-watching.png"), full_page=True)
            shown = page.inner_text("body")
        finally:
            browser.close()
    assert f"no scrape target on port {exporter_port}" in shown
    assert "No kvwatch alert is firing" not in shown
    assert shown.count("is broken.") == 1  # the one link the doctor names
    # The probe's verdicts, whose series never reach this Prometheus, say so.
    assert "Not watching: Prometheus holds no series KVWatchSessionAffinityBroken judges here now." in shown


# Last: it stops the lab's `kvwatch serve`.
def test_a_stopped_serve_is_named_and_prometheus_sees_its_target_down(lab):
    stop_lab_serve(lab)
    config = lab.state_dir / "kvwatch.yaml"
    code, words, said = until_links(config, lambda w: w.get("Prometheus scrapes kvwatch serve") == "FAIL")
    assert words["kvwatch serve answers"] == words["Prometheus scrapes kvwatch serve"] == "FAIL", said
    assert code == 1
    assert "Nothing answers at http://127.0.0.1:" in said and "kvwatch serve's scrape target is down" in said
