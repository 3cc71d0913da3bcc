"""The config's secrets: API keys, the store's password, the webhook token, from the environment or a file."""

from __future__ import annotations

import pytest
import yaml
from config_cases import KEY, target

from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import (
    ExporterSettings,
    StoreSettings,
    resolve_api_key,
    resolve_store_password,
    resolve_webhook_token,
)
from kvwatch.core.credentials import MAX_SECRET_FILE_BYTES
from processes import free_port, kvwatch_bounded_each


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("KVWATCH_TEST_KEY", f" {KEY}\n")
    assert resolve_api_key(target(api_key_env="KVWATCH_TEST_KEY")) == KEY


def test_api_key_from_file(tmp_path):
    (tmp_path / "key").write_text(f"{KEY}\n")
    assert resolve_api_key(target(api_key_file=tmp_path / "key")) == KEY


def test_no_api_key_configured():
    assert resolve_api_key(target()) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (None, "target chat: environment variable KVWATCH_TEST_KEY is not set"),
        ("  \n", "target chat: environment variable KVWATCH_TEST_KEY is empty"),
        (
            f"{KEY} {KEY}",
            "target chat: "
            "environment variable KVWATCH_TEST_KEY must hold one API key, without spaces or line breaks",
        ),
    ],
)
def test_api_key_environment_errors(monkeypatch, env, message):
    monkeypatch.delenv("KVWATCH_TEST_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("KVWATCH_TEST_KEY", env)
    with pytest.raises(ConfigError) as error:
        resolve_api_key(target(api_key_env="KVWATCH_TEST_KEY"))
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read API key file {path}: No such file or directory"),
        ("directory", "cannot read API key file {path}: Is a directory"),
        (b"", "API key file {path} is empty"),
        (
            f"{KEY}\n{KEY}\n".encode(),
            "API key file {path} must hold one API key, without spaces or line breaks",
        ),
        (KEY.encode() + b"\xff", "API key file {path} is not UTF-8 text"),
    ],
)
def test_api_key_file_errors(tmp_path, content, problem):
    path = tmp_path / "key"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as error:
        resolve_api_key(target(api_key_file=path))
    assert str(error.value) == "target chat: " + problem.format(path=path)
    assert KEY not in str(error.value)


def test_store_password_from_environment_or_file_and_where_the_store_is(monkeypatch, tmp_path):
    url = "postgresql://kvwatch@127.0.0.1:5432/kvwatch"
    monkeypatch.setenv("KVWATCH_TEST_STORE_PASSWORD", f"{KEY}\n")
    from_env = StoreSettings(url=url, password_env="KVWATCH_TEST_STORE_PASSWORD")
    assert (resolve_store_password(from_env), from_env.location) == (KEY, url)
    (tmp_path / "password").write_text(f"{KEY}\n")
    assert resolve_store_password(StoreSettings(url=url, password_file=tmp_path / "password")) == KEY
    assert (resolve_store_password(StoreSettings()), StoreSettings().location) == (None, StoreSettings().path)
    monkeypatch.delenv("KVWATCH_TEST_STORE_PASSWORD")
    with pytest.raises(
        ConfigError, match="^store: environment variable KVWATCH_TEST_STORE_PASSWORD is not set$"
    ):
        resolve_store_password(from_env)


def test_webhook_token_from_environment_or_file(monkeypatch, tmp_path):
    monkeypatch.setenv("KVWATCH_TEST_TOKEN", f"{KEY}\n")
    assert resolve_webhook_token(ExporterSettings(webhook_token_env="KVWATCH_TEST_TOKEN")) == KEY
    (tmp_path / "token").write_text(f"{KEY}\n")
    assert resolve_webhook_token(ExporterSettings(webhook_token_file=tmp_path / "token")) == KEY
    assert resolve_webhook_token(ExporterSettings()) is None


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"webhook_token_env": "KVWATCH_UNSET_TOKEN"}, "environment variable KVWATCH_UNSET_TOKEN is not set"),
        ({"webhook_token_file": "token"}, "webhook token file {path} is empty"),
        (
            {"webhook_token_file": "missing"},
            "cannot read webhook token file {path}: No such file or directory",
        ),
    ],
)
def test_webhook_token_errors(tmp_path, source, message):
    (tmp_path / "token").write_text("\n")
    if "webhook_token_file" in source:
        source = {"webhook_token_file": tmp_path / source["webhook_token_file"]}
    with pytest.raises(ConfigError) as error:
        resolve_webhook_token(ExporterSettings(**source))
    assert str(error.value) == "exporter: " + message.format(path=source.get("webhook_token_file"))


SECRET_FILE_KEYS = [  # key, the section that names it, the secret it holds
    ("api_key_file", "target chat", "API key"),
    ("webhook_token_file", "exporter", "webhook token"),
    ("password_file", "store", "password"),
]


def test_serve_refuses_a_secret_file_that_holds_no_secret_at_once_in_one_line(tmp_path, not_a_secret_file):
    path, problem = not_a_secret_file
    commands, said = [], []
    for key, owner, secret in SECRET_FILE_KEYS:
        target = {"name": "chat", "base_url": "http://127.0.0.1:9", "model": "lab-model"}
        exporter = {"listen": f"127.0.0.1:{free_port()}"}
        # The password is read before the store is opened: nothing need listen on port 9.
        store = {"url": "postgresql://kvwatch@127.0.0.1:9/kvwatch"} if key == "password_file" else {}
        {"api_key_file": target, "webhook_token_file": exporter, "password_file": store}[key][key] = str(path)
        config = tmp_path / f"{key}.yaml"
        store.setdefault("path", str(tmp_path / "kvwatch.db"))
        config.write_text(yaml.safe_dump({"targets": [target], "exporter": exporter, "store": store}))
        commands.append(["serve", "--config", str(config)])
        said.append(f"kvwatch serve: {owner}: {secret} file {path} {problem.format(secret=secret)}\n")

    served = kvwatch_bounded_each(commands, tmp_path)
    assert [(s.returncode, s.stderr) for s in served] == [(1, line) for line in said]


def test_a_secret_file_at_the_size_limit_is_read(tmp_path):
    (tmp_path / "key").write_text("k" * MAX_SECRET_FILE_BYTES)
    assert resolve_api_key(target(api_key_file=tmp_path / "key")) == "k" * MAX_SECRET_FILE_BYTES
