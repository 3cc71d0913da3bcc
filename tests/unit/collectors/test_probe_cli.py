"""The probe's settings and command line: keys, URLs, the model chosen, and secrets kept out of its output."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Iterable, Iterator
from urllib.parse import quote

import pytest
from aiohttp import web
from loopback import QuietHandler, loopback_http
from probe_fakes import ANSWER, KEY, MODEL, SMALL, answering, fake_server, run_kvwatch, sse
from prometheus_client import CollectorRegistry, generate_latest

from kvwatch.cli.main import main
from kvwatch.collectors.probe.models import chosen_model
from kvwatch.collectors.probe.records import ERROR_KINDS, SessionResult
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import ProbeSettings, api_url, resolve_api_key
from kvwatch.collectors.probe.targets import run_sessions
from kvwatch.collectors.probe.workload import synthetic
from kvwatch.serve.exporter import ProbeCollector, ProbeResults
from kvwatch.store.history import Store
from processes import free_port, kvwatch_bounded

# Settings.


@pytest.mark.parametrize(
    "base", ["https://example.net/api", "https://example.net/api/", "https://example.net/api/v1"]
)
def test_base_url_gets_v1_unless_it_ends_in_it(base):
    assert api_url(base, "chat/completions") == "https://example.net/api/v1/chat/completions"
    assert api_url(base, "/models") == "https://example.net/api/v1/models"


def test_a_base_urls_query_stays_after_the_path():
    assert api_url("https://h/api?token=x", "chat/completions") == "https://h/api/v1/chat/completions?token=x"
    assert api_url("https://h/api/?token=x", "") == "https://h/api/v1?token=x"
    assert api_url("https://h/api/v1/?token=x&a=b", "/models") == "https://h/api/v1/models?token=x&a=b"


def test_api_key_comes_from_an_environment_variable_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KVW_TEST_KEY", f"  {KEY}\n")
    (tmp_path / "key").write_text(f"{KEY}\n")
    assert resolve_api_key("KVW_TEST_KEY", None) == KEY
    assert resolve_api_key(None, tmp_path / "key") == KEY
    assert resolve_api_key(None, None) is None


@pytest.mark.parametrize(
    "env, file, message",
    [
        ("KVW_TEST_UNSET", None, "environment variable KVW_TEST_UNSET is not set or empty"),
        (KEY, None, "environment variable named for the API key (name not shown) is not set or empty"),
        (None, "missing", "cannot read API key file {tmp}/missing: No such file or directory"),
        (None, "empty", "API key file {tmp}/empty is empty"),
        ("KVW_TEST_UNSET", "empty", "take the API key from an environment variable or from a file, not both"),
    ],
    ids=["unset", "key-as-name", "missing-file", "empty-file", "both"],
)
def test_api_key_errors_name_the_source_never_the_key(tmp_path, monkeypatch, env, file, message):
    monkeypatch.delenv("KVW_TEST_UNSET", raising=False)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError) as raised:
        resolve_api_key(env, file and tmp_path / file)
    assert str(raised.value) == message.format(tmp=tmp_path)


def test_settings_never_show_the_key_and_reject_bad_values():
    assert KEY not in repr(ProbeSettings(base_url="http://gw", model=MODEL, api_key=KEY))
    for bad, message in [
        ({"base_url": "gw:8000"}, "base_url must start with http:// or https://"),
        ({"model": ""}, "model must not be empty"),
        ({"session_mode": "sticky"}, "session_mode must be one of client, server, none"),
        ({"timeout_seconds": 0}, "timeout_seconds must be positive"),
        ({"api_key": f"{KEY} x"}, "^api_key must be printable ASCII without spaces$"),
    ]:
        with pytest.raises(ValueError, match=message):
            ProbeSettings(**{"base_url": "http://gw", "model": MODEL, **bad})


# Characters that JSON, URLs and both base64 alphabets each encode, and letters for the case to change.
ECHOED_KEY = 'kvw/Se+cr"et\\Key=5f1c0e?9a>c'


def echoed_forms(key: str) -> list[str]:
    """The key as a server may echo it, made here independently of the redaction under test."""
    standard, urlsafe = (
        base64.b64encode(key.encode()).decode(),
        base64.urlsafe_b64encode(key.encode()).decode(),
    )
    assert "+" in standard and "/" in standard and standard.endswith("=") and standard != urlsafe
    forms = [key, json.dumps(key)[1:-1], quote(key, safe=""), key.upper(), key.lower(), standard, urlsafe]
    basic_auth = base64.b64encode(f"user:{key}".encode()).decode()  # the key's base64 inside another's
    return [*forms, standard.rstrip("="), urlsafe.rstrip("="), basic_auth]


def leaks(text: str, forms: Iterable[str], size: int = 10) -> set[str]:
    """The pieces of `size` characters of any form of the key that `text` shows, in any case."""
    pieces = {form[i : i + size] for form in forms for i in range(len(form) - size + 1)}
    return {piece for piece in pieces if piece.lower() in text.lower()}


def echoing(forms: list[str]):
    """Session n gets form n of the key echoed: as its backend header and its session id (round 1; a form
    that is no ASCII, which no header carries, as in round 2), as the JSON field naming the backend
    (round 2), and in the error that ends it (round 3)."""
    requests: dict[str, int] = {}  # by session id, in the order the sessions came

    async def handler(request: web.Request) -> web.StreamResponse:
        session = request.headers["X-Session-Id"]
        requests[session] = requests.get(session, 0) + 1
        form = forms[list(requests).index(session) % len(forms)]
        if requests[session] == 1 and form.isascii():
            return await sse(request, ANSWER, {"X-Worker-Id": f"worker-{form}", "X-Session-Id": form})
        if requests[session] <= 2:
            named = json.dumps({"choices": [], "nvext": {"worker_id": f"worker-{form}"}})
            return await sse(request, [*ANSWER[:-1], named, "[DONE]"], {"X-Session-Id": session})
        return await sse(request, ['{"error": {"message": "Incorrect API key provided: ' + form + '"}}'])

    return handler


# A key with a well-known prefix: a server may echo the rest of it alone, or escape it character by character.
PREFIXED_KEY = "sk-proj-Kv7wQ2mZ9xR4tB8nL3pD"


def prefixed_forms(key: str) -> list[str]:
    """The key's core (its prefix cut), and the key escaped, encoded or split as a server may echo it."""
    core = key.removeprefix("sk-proj-")
    escaped = "".join(f"\\u{ord(c):04x}" for c in key)
    half_escaped = "".join(f"\\u{ord(c):04X}" if i % 3 else c for i, c in enumerate(key))
    entities = "".join(f"&#{ord(c)};" if i % 2 else f"&#x{ord(c):x};" for i, c in enumerate(key))
    return [
        core,
        f"sk-{core}",  # another prefix
        escaped,
        half_escaped,
        "".join(f"\\u{ord(c):04x}" for c in core),
        key.encode().hex(),
        entities,
        base64.b32encode(key.encode()).decode(),
        base64.b32encode(f"user:{key}".encode()).decode().rstrip("="),
        "\u200b".join(key),
    ]


def strings(value: object) -> Iterator[str]:
    """Every string in a parsed JSON document: `--json` escapes what the grep must see unescaped."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from strings(item)


@pytest.mark.parametrize(
    "key, forms",
    [(ECHOED_KEY, echoed_forms(ECHOED_KEY)), (PREFIXED_KEY, prefixed_forms(PREFIXED_KEY))],
    ids=["encoded", "core-and-escaped"],
)
def test_a_key_echoed_in_any_form_reaches_no_output_label_or_store(key, forms, tmp_path):
    sessions = ["--sessions", str(len(forms)), "--rounds", "3"]

    async def scenario() -> tuple[list[tuple], list[SessionResult]]:
        async with fake_server(echoing(forms)) as url:
            flags = ["probe", "--base-url", url, *SMALL, *sessions, "--api-key-env", "KVW_TEST_KEY"]
            env = {"KVW_TEST_KEY": key}
            runs = [await run_kvwatch(*flags, *json_flag, env=env) for json_flag in ([], ["--json"])]
            settings = ProbeSettings(base_url=url, model=MODEL, api_key=key, max_tokens=8)
            return runs, await run_sessions(settings, synthetic(3, 50, 10, 0, len(forms)))

    runs, results = asyncio.run(scenario())
    assert [code for code, _, _ in runs] == [1, 1], runs  # every session fails in round 3
    report = json.loads(runs[1][1])
    assert [s["backends"] for s in report["sessions"]] == [["[redacted]", "[redacted]"]] * len(forms)
    assert all("[redacted]" in s["rounds"][2]["error_detail"] for s in report["sessions"])
    with Store(tmp_path / "kvwatch.db") as store:
        for session in results:
            store.add_session(session)
        rows = store.sessions() + store.rounds()
    exporter, registry = ProbeResults(), CollectorRegistry()
    registry.register(ProbeCollector(exporter, {}))
    exporter.add_run(("probe", "unknown"), results, 0, 1)

    stored = "\n".join(str(value) for row in rows for value in row.values())
    printed = [out + err for _, out, err in runs] + ["\n".join(strings(report))]
    for output in (*printed, stored, generate_latest(registry).decode()):
        assert not leaks(output, forms), output


# The command line.


def test_cli_failure_exits_1_with_a_hint_per_error_kind(capsys):
    nowhere = f"http://127.0.0.1:{free_port()}"
    code = main(["probe", "--base-url", nowhere, "--model", MODEL, "--sessions", "2"])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out.splitlines()[1] == "KV block: 16 tokens (default; no engine evidence)"
    assert captured.out.splitlines()[4].split() == "1 - 0 / 0 unknown connection_refused x2".split()
    assert captured.err.splitlines()[0] == "kvwatch probe: 2 of 2 sessions failed"
    assert captured.err.splitlines()[1].startswith("  connection_refused (cannot connect to 127.0.0.1:")
    assert captured.err.splitlines()[1].endswith(HINTS["connection_refused"])
    assert set(HINTS) == set(ERROR_KINDS)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rounds", "0", "--timeout", "-1"], "--rounds must be positive; --timeout must be positive"),
        (["--api-key-env", "KVW_TEST_UNSET"], "environment variable KVW_TEST_UNSET is not set or empty"),
        (["--base-url", "127.0.0.1:8000"], "base_url must start with http:// or https://"),
        (
            ["--base-url", "http://kvw:pw@127.0.0.1:99999"],
            "base_url http://kvw:[redacted]@127.0.0.1:99999 is not a valid URL: port 99999 is not 1 to 65535",
        ),
        (["--sharegpt", "/nonexistent.json"], "/nonexistent.json: no such file"),
    ],
)
def test_cli_rejects_bad_arguments_with_exit_2(flags, message, capsys, monkeypatch):
    monkeypatch.delenv("KVW_TEST_UNSET", raising=False)
    assert main(["probe", "--base-url", "http://127.0.0.1:1", "--model", MODEL, *flags]) == 2
    assert capsys.readouterr().err == f"kvwatch probe: {message}\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--api-key", KEY], "the API key is never taken from the command line"),
        ([f"--api-key={KEY}"], "the API key is never taken from the command line"),
        (["--api-key-env", "X", "--api-key-file", "y"], "argument --api-key-file: not allowed with argument"),
        (["--session-mode", "sticky"], "argument --session-mode: invalid choice: 'sticky'"),
    ],
    ids=["api-key", "api-key=", "env-and-file", "bad-mode"],
)
def test_argparse_errors_exit_2_and_a_key_on_argv_is_refused_unrepeated(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["probe", "--base-url", "http://127.0.0.1:1", "--model", MODEL, *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and KEY not in err


# The model, when --model is not given.

LISTINGS = {
    "/one/v1/models": (200, {"object": "list", "data": [{"id": "m1"}]}),
    "/two/v1/models": (200, {"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]}),
    "/none/v1/models": (200, {"object": "list", "data": []}),
    "/broken/v1/models": (500, {"error": "boom"}),
    "/other/v1/models": (200, {"models": ["m1"]}),
}


@pytest.fixture(scope="module")
def listings() -> Iterator[str]:
    """A loopback server with a model listing under each path of LISTINGS, and one that never answers."""
    release = threading.Event()

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            if self.path == "/silent/v1/models":
                release.wait(timeout=30)
                return
            status, answer = LISTINGS.get(self.path, (404, {}))
            self.answer(status, json.dumps(answer).encode())

    with loopback_http(Handler) as url:
        yield url
        release.set()


def test_the_one_model_served_is_chosen_and_said(listings, capsys):
    assert chosen_model(None, f"{listings}/one", None, 5, "probe") == "m1"
    assert capsys.readouterr().err == f"kvwatch probe: model m1, the one {listings}/one/v1/models lists\n"
    assert chosen_model("given", "http://127.0.0.1:1", None, 5, "probe") == "given"  # asks nothing


@pytest.mark.parametrize(
    "path, message",
    [
        ("two", "/two/v1/models lists 2 models (m1, m2): name the one to use with --model"),
        ("none", "/none/v1/models lists no model: name the one to use with --model"),
        ("broken", "/broken/v1/models answered HTTP 500: name the model with --model"),
        # A server that lists no models and answers no chat request is said to be no API.
        ("other", "/other/v1/models answers no model list: no `data` of objects with an `id`; the server"),
        ("silent", "/silent/v1/models failed: no complete answer within 0.5 s: name the model with --model"),
    ],
)
def test_no_model_chosen_when_the_route_serves_several_or_none_or_its_listing_fails(listings, path, message):
    started = time.monotonic()
    with pytest.raises(ValueError) as raised:
        chosen_model(None, f"{listings}/{path}", None, 0.5, "probe")
    assert message in str(raised.value) and time.monotonic() - started < 5


def test_a_refused_listing_says_so():
    with pytest.raises(ValueError) as raised:
        chosen_model(None, f"http://127.0.0.1:{free_port()}", None, 5, "probe")
    assert str(raised.value).endswith("/v1/models failed: Connection refused: name the model with --model")


@pytest.mark.parametrize(
    "command",
    [
        ["probe", "--base-url"],
        ["doctor", "--base-url"],
        ["experiment", "--out", "{tmp}", "--b", "{url}", "--a"],
    ],
    ids=lambda command: command[0],
)
def test_every_command_without_a_model_asks_for_one_among_those_served(listings, command, tmp_path, capsys):
    args = [arg.format(tmp=tmp_path, url=f"{listings}/two") for arg in command]
    assert main([*args, f"{listings}/two"]) == 2
    listed = f"{listings}/two/v1/models lists 2 models (m1, m2)"
    assert capsys.readouterr().err == f"kvwatch {command[0]}: {listed}: name the one to use with --model\n"


def test_a_password_in_the_base_url_is_never_printed(tmp_path):
    password = "pw-9d1e5c7a3f0b"

    async def scenario() -> list[tuple[int | None, str, str]]:
        async with fake_server(answering(ANSWER)) as url:
            base = url.replace("://", f"://kvw:{password}@")
            experiment = ["experiment", "--a", base, "--b", base, "--out", str(tmp_path), *SMALL]
            return await asyncio.gather(
                *(run_kvwatch(command, "--base-url", base, "--model", MODEL, *flags)
                  for command in ("probe", "doctor") for flags in ([], ["--json"])),
                run_kvwatch(*experiment, "--sessions", "2", "--rounds", "2"),
            )  # fmt: skip

    runs = asyncio.run(scenario())
    assert [code for code, _, _ in runs[:2] + runs[4:]] == [0, 0, 0], runs  # the doctor may find causes
    assert not [err for _, _, err in runs if "Traceback" in err]
    assert "kvw:[redacted]@127.0.0.1:" in runs[0][1].splitlines()[0]
    written = [path.read_bytes().decode(errors="replace") for path in tmp_path.iterdir()]
    assert not [text for _, out, err in runs for text in (out, err, *written) if password in text]


def test_a_token_in_the_base_urls_query_is_sent_after_the_path_and_never_printed():
    token = "tk-3e8a1c5f9b7d"
    received: list[str] = []  # each request's path and query, as the server got them

    async def handler(request: web.Request) -> web.StreamResponse:
        received.append(request.path_qs)
        return await sse(request, ANSWER)

    async def scenario() -> list[tuple[int | None, str, str]]:
        async with fake_server(handler) as url:
            base = f"{url}/?token={token}"
            probe = ["probe", "--base-url", base, *SMALL, "--sessions", "1", "--rounds", "2"]
            return [await run_kvwatch(*probe, *flags) for flags in ([], ["--json"])]

    runs = asyncio.run(scenario())
    assert [code for code, _, _ in runs] == [0, 0], runs
    assert set(received) == {f"/v1/chat/completions?token={token}"}
    assert "/v1/chat/completions?token=[redacted]" in runs[0][1].splitlines()[0]
    assert not [text for _, out, err in runs for text in (out, err) if token in text]


def test_a_key_file_that_is_not_text_is_named_without_quoting_the_key(tmp_path):
    (tmp_path / "binary").write_bytes(b"sk-\xff\xfe-secret")
    with pytest.raises(ValueError) as raised:
        resolve_api_key(None, tmp_path / "binary")
    assert str(raised.value) == f"API key file {tmp_path}/binary is not UTF-8 text"


def test_an_api_key_file_that_holds_no_key_is_refused_at_once_in_one_line(not_a_secret_file):
    path, problem = not_a_secret_file
    probed = kvwatch_bounded("probe", "--base-url", "http://127.0.0.1:9", *SMALL, "--api-key-file", str(path))
    said = f"kvwatch probe: API key file {path} {problem.format(secret='API key')}\n"
    assert (probed.returncode, probed.stderr) == (2, said)  # a bad argument
