"""`kvwatch config check` runs every check `kvwatch serve` runs before it starts (serve.startup): a config
serve refuses is refused by the check with the same lines; `--online` asks the network."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml
from loopback import QuietHandler, loopback_http

from kvwatch.cli import main
from processes import free_port

TARGET = {"name": "chat", "base_url": "http://127.0.0.1:9", "model": "lab-model"}


def write_config(tmp_path: Path, **sections) -> Path:
    """A config of one target, the exporter on a free port and the store in `tmp_path`, with `sections`
    merged over it (a `target` key over the target)."""
    config = {
        "targets": [TARGET | sections.pop("target", {})],
        "exporter": {"listen": f"127.0.0.1:{free_port()}"},
        "store": {"path": str(tmp_path / "kvwatch.db")},
    }
    for name, section in sections.items():
        config[name] = config.get(name, {}) | section
    path = tmp_path / "kvwatch.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def refusals(path: Path, capsys) -> tuple[list[str], list[str]]:
    """The lines `kvwatch serve` refuses the config with, and those of `kvwatch config check`."""
    assert main.main(["serve", "--config", str(path)]) == 1
    served = capsys.readouterr().err.splitlines()
    assert main.main(["config", "check", str(path)]) == 1
    checked = capsys.readouterr()
    assert checked.out == ""
    return served, checked.err.splitlines()


@pytest.fixture
def unset(monkeypatch):
    for name in ("KVWATCH_TEST_KEY", "KVWATCH_TEST_TOKEN", "KVWATCH_TEST_PASSWORD"):
        monkeypatch.delenv(name, raising=False)


# (what, the sections over the base config, the one problem both say; {tmp} is the test's directory)
REFUSED = [
    (
        "api-key-env",
        {"target": {"api_key_env": "KVWATCH_TEST_KEY"}},
        "target chat: environment variable KVWATCH_TEST_KEY is not set",
    ),
    (
        "api-key-file",
        {"target": {"api_key_file": "{tmp}/key"}},
        "target chat: cannot read API key file {tmp}/key: No such file or directory",
    ),
    (
        "webhook-token-env",
        {"exporter": {"webhook_token_env": "KVWATCH_TEST_TOKEN"}},
        "exporter: environment variable KVWATCH_TEST_TOKEN is not set",
    ),
    (
        "store-password-env",
        {
            "store": {
                "url": "postgresql://kvwatch@127.0.0.1:9/kvwatch",
                "password_env": "KVWATCH_TEST_PASSWORD",
            }
        },
        "store: environment variable KVWATCH_TEST_PASSWORD is not set",
    ),
    (
        "sharegpt",
        {"target": {"workload": {"sharegpt": "{tmp}/sharegpt.json"}}},
        "{tmp}/sharegpt.json: no such file",
    ),
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
    (
        "listen-foreign",
        {"exporter": {"listen": "192.0.2.1:9464"}},
        "cannot listen on 192.0.2.1:9464: {eaddrnotavail}",
    ),
    (
        # /proc takes no new files, even from root; the config cannot know, only opening the store does.
        "store",
        {"store": {"path": "/proc/kvwatch.db"}},
        "cannot open the kvwatch store /proc/kvwatch.db: "
        "cannot create /proc/kvwatch.db-writer.lock: No such file or directory",
    ),
]


def formatted(value, tmp_path: Path):
    if isinstance(value, dict):
        return {key: formatted(item, tmp_path) for key, item in value.items()}
    return value.format(tmp=tmp_path, eaddrnotavail="Cannot assign requested address")


@pytest.mark.parametrize(("what", "sections", "problem"), REFUSED, ids=[what for what, _, _ in REFUSED])
def test_config_check_refuses_what_serve_refuses_with_the_same_message(
    tmp_path, capsys, unset, what, sections, problem
):
    path = write_config(tmp_path, **formatted(sections, tmp_path))
    served, checked = refusals(path, capsys)
    expected = formatted(problem, tmp_path)
    assert (served, checked) == ([f"kvwatch serve: {expected}"], [expected])


def test_an_address_in_use_is_refused_by_both(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        served, checked = refusals(write_config(tmp_path, exporter={"listen": listen}), capsys)
    expected = f"cannot listen on {listen}: Address already in use"
    assert (served, checked) == ([f"kvwatch serve: {expected}"], [expected])


def test_every_problem_is_said_one_a_line_and_the_store_is_left_alone(tmp_path, capsys, unset):
    path = write_config(
        tmp_path,
        target={"api_key_env": "KVWATCH_TEST_KEY"},
        exporter={"webhook_token_env": "KVWATCH_TEST_TOKEN", "listen": "192.0.2.1:9464"},
    )
    served, checked = refusals(path, capsys)
    expected = [
        "target chat: environment variable KVWATCH_TEST_KEY is not set",
        "exporter: environment variable KVWATCH_TEST_TOKEN is not set",
        "cannot listen on 192.0.2.1:9464: Cannot assign requested address",
    ]
    assert (served, checked) == ([f"kvwatch serve: {line}" for line in expected], expected)
    assert not (tmp_path / "kvwatch.db").exists()  # a config that cannot start creates no store


def test_a_config_serve_starts_with_passes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVWATCH_TEST_KEY", "sk-test")
    path = write_config(tmp_path, target={"api_key_env": "KVWATCH_TEST_KEY"})
    assert main.main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: OK (1 target, 0 gateway logs)\n"


def serving_json(routes: dict[str, tuple[int, object]]) -> type[QuietHandler]:
    """A handler answering GET `path` with (status, JSON) from `routes`, 404 elsewhere; it records the
    Authorization header it was sent."""

    class Answer(QuietHandler):
        authorizations: list[str | None] = []

        def do_GET(self) -> None:
            Answer.authorizations.append(self.headers.get("Authorization"))
            status, body = routes.get(self.path, (404, {"detail": "Not Found"}))  # as an OpenAI API server
            self.answer(status, json.dumps(body).encode())

    return Answer


def test_online_names_the_missing_model_and_the_services_that_are_not_what_they_should_be(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("KVWATCH_TEST_KEY", "sk-test")
    models = {"/v1/models": (200, {"data": [{"id": "llama"}, {"id": "qwen"}]})}
    not_alertmanager = {"/api/v2/status": (200, {"status": "success"})}
    handler = serving_json(models)
    with (
        loopback_http(handler) as server,
        loopback_http(serving_json({})) as not_prometheus,
        loopback_http(serving_json(not_alertmanager)) as other,
    ):
        path = write_config(
            tmp_path,
            target={"base_url": server, "api_key_env": "KVWATCH_TEST_KEY"},
            prometheus={"url": not_prometheus},
            alertmanager={"url": other},
        )
        assert main.main(["config", "check", str(path)]) == 0  # offline, nothing is asked
        capsys.readouterr()
        assert main.main(["config", "check", "--online", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"target chat: GET {server}/v1/models does not list model lab-model (it lists: llama, qwen)",
        f"prometheus.url: {not_prometheus} does not answer a query: HTTP 404",
        f"alertmanager.url: GET {other}/api/v2/status answered, but not with Alertmanager's status "
        "(no `cluster` in it)",
    ]
    assert handler.authorizations == ["Bearer sk-test"]


def test_online_says_what_cannot_be_reached(tmp_path, capsys):
    closed = f"http://127.0.0.1:{free_port()}"
    path = write_config(
        tmp_path, target={"base_url": closed}, prometheus={"url": closed}, alertmanager={"url": closed}
    )
    assert main.main(["config", "check", "--online", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"target chat: GET {closed}/v1/models failed: Connection refused",
        f"prometheus.url: {closed} does not answer a query: Connection refused",
        f"alertmanager.url: GET {closed}/api/v2/status failed: Connection refused",
    ]
