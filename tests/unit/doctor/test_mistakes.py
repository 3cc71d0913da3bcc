"""Each common mistake in pointing kvwatch at a route gets its own diagnosis, in `kvwatch probe` and in
the doctor: a host name that does not resolve, a scheme the port does not speak, a server that is no
OpenAI-compatible API (a real Prometheus among them), a pasted endpoint, a wrong model. And the doctor
passes no check it could not judge.

Loopback servers stand for the odd answers; a real Prometheus and a real lab replica for the real ones.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiohttp import web
from loopback import QuietHandler, loopback_http, serving

from kvwatch.cli.main import main
from kvwatch.collectors.probe import session as probe_session
from kvwatch.collectors.probe.report import HINTS
from kvwatch.collectors.probe.session import ProbeSettings
from kvwatch.config.loading import ConfigError
from kvwatch.config.settings import load_config
from kvwatch.doctor.checks import diagnose, examine
from kvwatch.doctor.findings import Check, Diagnosis
from processes import free_port, stop, wait_http

MODEL = "lab-model"
PROMETHEUS_TITLE = "'Prometheus Time Series Collection and Processing Server'"


def doctor(url: str, model: str = MODEL, **settings) -> Diagnosis:
    return diagnose(ProbeSettings(base_url=url, model=model, timeout_seconds=10, **settings))


def check(diagnosis: Diagnosis, name: str) -> Check:
    (found,) = [c for c in diagnosis.checks if c.name == name]
    return found


def probe_cli(url: str, capsys, model: str = MODEL) -> tuple[int, str]:
    """`kvwatch probe` of one short session: its exit code and what it said on stderr."""
    code = main(["probe", "--base-url", url, "--model", model, "--sessions", "1", "--rounds", "2"])
    return code, capsys.readouterr().err


def reachability_fails_with(diagnosis: Diagnosis, cause: str) -> Check:
    found = check(diagnosis, "reachability")
    assert (found.status, found.cause, diagnosis.causes) == ("fail", cause, [cause]), found
    assert check(diagnosis, "auth").status == "skipped"
    return found


# --- a host name that does not resolve --------------------------------------------------------------


@pytest.fixture
def nxdomain(monkeypatch):
    """The resolver answering every name as it answers a typo (NXDOMAIN), without asking any DNS."""

    def answer(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", answer)


def test_a_typod_host_is_a_dns_error_in_the_probe_and_the_doctor(nxdomain, capsys):
    code, said = probe_cli("http://gatewy.example:8000/v1", capsys)
    assert code == 1
    assert (
        "dns_error (gatewy.example:8000: the host name does not resolve (Name or service not known))" in said
    )
    found = reachability_fails_with(doctor("http://gatewy.example:8000/v1"), "dns_error")
    assert found.evidence == "gatewy.example:8000: the host name does not resolve (Name or service not known)"
    assert found.fix.startswith(HINTS["dns_error"])


def test_the_real_resolver_failing_a_name_is_a_dns_error(capsys):
    # glibc refuses a label that starts with "-" without a query (checked with strace): the real resolver
    # answers, and no packet leaves the machine. A `.invalid` name would be sent to the DNS server.
    found = reachability_fails_with(doctor("http://-gateway.invalid:8000"), "dns_error")
    assert found.evidence.startswith("-gateway.invalid:8000: the host name does not resolve (")


# --- a scheme the port does not speak ---------------------------------------------------------------


def test_https_to_a_plain_http_server_is_a_tls_mismatch(capsys):
    async def scenario() -> tuple[str, Diagnosis]:
        async with serving(web.Application()) as url:
            https = url.replace("http://", "https://")
            return https, await examine(ProbeSettings(base_url=https, model=MODEL, timeout_seconds=10))

    url, diagnosis = asyncio.run(scenario())
    found = reachability_fails_with(diagnosis, "tls_mismatch")
    assert "the server answered the TLS handshake with no TLS, as a plain-HTTP server does: use http://" in (
        found.evidence
    )
    assert found.fix.startswith(HINTS["tls_mismatch"])


def test_https_to_a_real_replica_is_a_tls_mismatch_in_the_probe(start_replica, capsys):
    replica = start_replica("r1")
    code, said = probe_cli(replica.url.replace("http://", "https://"), capsys)
    assert code == 1 and "tls_mismatch (127.0.0.1:" in said
    assert "use http:// (it sent 'HTTP/1.0 400 Bad Request')" in said, said  # aiohttp's answer


# --- a server that is no OpenAI-compatible API ------------------------------------------------------


class TeamWiki(QuietHandler):
    """A web server that is no LLM API: a home page, and 404 for everything else."""

    def do_GET(self) -> None:
        if self.path == "/":
            self.answer(200, b"<html><head><title>Team wiki</title></head></html>", "text/html")
        else:
            self.answer(404, b"not found", "text/plain")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.answer(404, b"not found", "text/plain")


def test_a_web_server_that_is_no_llm_api_is_named_as_it_names_itself(capsys):
    with loopback_http(TeamWiki) as url:
        diagnosis = doctor(url)
        code, said = probe_cli(url, capsys)
    found = reachability_fails_with(diagnosis, "not_openai_api")
    assert found.evidence == (
        f"no OpenAI-compatible API answers at {url}/v1: POST {url}/v1/chat/completions answers HTTP 404 "
        "(text/plain), "
        f"no OpenAI error object, and GET {url}/v1/models answers HTTP 404; "
        "the server calls itself 'Team wiki'"
    )
    assert found.fix.startswith("set the base URL to the API root of the gateway or engine that serves ")
    assert code == 1 and f"  {found.evidence}\n" in said
    with loopback_http(TeamWiki) as url:
        code = main(["probe", "--base-url", url])  # no --model: the model list is asked for first
    said = capsys.readouterr().err
    assert code == 2 and said.startswith("kvwatch probe: no --model given, and no OpenAI-compatible API ")
    assert said.endswith("; the server calls itself 'Team wiki'\n"), said


@contextmanager
def real_prometheus(tmp_path: Path) -> Iterator[str]:
    """The prometheus binary on a free 127.0.0.1 port: its URL; stopped by its PID on leaving."""
    port, config, log = free_port(), tmp_path / "prometheus.yml", tmp_path / "prometheus.log"
    config.write_text("global:\n  scrape_interval: 1m\n")
    with log.open("w") as out:
        process = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/-/ready", process, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)


@pytest.mark.integration
def test_a_prometheus_given_as_the_base_url_is_named_not_an_llm_api(tmp_path, capsys):
    with real_prometheus(tmp_path) as url:
        diagnosis = doctor(url)
        code, said = probe_cli(url, capsys)
    found = reachability_fails_with(diagnosis, "not_openai_api")
    assert found.evidence.startswith(f"no OpenAI-compatible API answers at {url}/v1: POST {url}/v1/chat/")
    assert found.evidence.endswith(f"; the server calls itself {PROMETHEUS_TITLE}"), found.evidence
    assert code == 1 and f"no OpenAI-compatible API answers at {url}/v1" in said and PROMETHEUS_TITLE in said
    assert [c.name for c in diagnosis.checks if c.status == "pass"] == []  # no `PASS auth` any more


# --- a pasted endpoint ------------------------------------------------------------------------------

PASTED = {
    "http://127.0.0.1:1/v1/chat/completions": ("/chat/completions", "http://127.0.0.1:1/v1"),
    "http://127.0.0.1:1/chat/completions/": ("/chat/completions", "http://127.0.0.1:1"),
    "http://127.0.0.1:1/v1/models": ("/models", "http://127.0.0.1:1/v1"),
}


def pasted_message(url: str) -> str:
    ending, root = PASTED[url]
    return f"ends in {ending}, an endpoint: give the API root, {root} (kvwatch appends /chat/completions"


@pytest.mark.parametrize("url", PASTED)
@pytest.mark.parametrize(
    "command",
    [["probe", "--base-url", "{url}"], ["probe", "--base-url", "{url}", "--model", MODEL],
     ["doctor", "--base-url", "{url}", "--model", MODEL],
     ["experiment", "--a", "{url}", "--b", "http://127.0.0.1:2/v1", "--model", MODEL, "--out", "{out}"]],
    ids=["probe-no-model", "probe", "doctor", "experiment"],
)  # fmt: skip
def test_a_pasted_endpoint_is_refused_naming_the_api_root(url, command, tmp_path, capsys):
    args = [part.format(url=url, out=tmp_path / "out") for part in command]
    assert main(args) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"kvwatch {command[0]}: base") and pasted_message(url) in said, said


def test_a_pasted_endpoint_in_the_config_is_refused_naming_the_api_root(tmp_path):
    config = tmp_path / "kvwatch.yaml"
    url = "http://127.0.0.1:1/v1/chat/completions"
    config.write_text(f"targets:\n  - name: a\n    base_url: {url}\n    model: {MODEL}\n")
    with pytest.raises(ConfigError, match="targets\\[0\\].base_url: ends in /chat/completions"):
        load_config(config)


# --- a wrong model ----------------------------------------------------------------------------------


def api_serving(*models: str) -> web.Application:
    """An OpenAI-compatible API that serves `models` and answers any other with vLLM's 404."""

    async def chat(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        error = {"object": "error", "message": f"The model `{model}` does not exist.", "code": 404}
        return web.json_response(error, status=404)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", lambda _: web.json_response({"data": [{"id": m} for m in models]}))
    return app


def test_a_wrong_model_is_shown_the_models_served_by_the_probe_and_the_doctor(capsys):
    async def scenario() -> tuple[str, Diagnosis]:
        async with serving(api_serving(MODEL, "other-model")) as url:
            settings = ProbeSettings(base_url=url, model="lab-modle", timeout_seconds=10)
            return url, await examine(settings)

    url, diagnosis = asyncio.run(scenario())
    reached = check(diagnosis, "reachability")
    assert (reached.status, reached.evidence.split(" (")[0]) == (
        "pass",
        f"GET {url}/v1/models lists 2 models: the base URL is the API root",
    )
    assert check(diagnosis, "auth").evidence == f"GET {url}/v1/models lists 2 models without an API key"
    shape = check(diagnosis, "response shape")
    assert diagnosis.causes == ["model_not_found"]
    assert shape.evidence.endswith(
        f"; model lab-modle is not served here: GET {url}/v1/models lists lab-model, other-model"
    ), shape.evidence


def test_the_probe_names_the_served_models_after_a_404(capsys):
    async def scenario() -> tuple[str, int, str]:
        async with serving(api_serving(MODEL)) as url:
            code, said = await asyncio.to_thread(probe_cli, url, capsys, "lab-modle")
            return url, code, said

    url, code, said = asyncio.run(scenario())
    assert (
        code == 1 and f"  model lab-modle is not served here: GET {url}/v1/models lists lab-model\n" in said
    )


def test_a_real_replica_shows_a_wrong_model_the_one_it_serves(start_replica, capsys):
    replica = start_replica("r1")
    code, said = probe_cli(replica.url, capsys, model="lab-modle")
    assert code == 1 and "not_found (HTTP 404 (wrong model or base URL): " in said
    assert f"  model lab-modle is not served here: GET {replica.url}/v1/models lists lab-model\n" in said


# --- no pass without a judgement -------------------------------------------------------------------


def test_auth_is_not_passed_when_no_answer_of_the_api_could_judge_it():
    async def overloaded(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    async def scenario() -> Diagnosis:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", overloaded)  # and no /v1/models
        async with serving(app) as url:
            return await examine(ProbeSettings(base_url=url, model=MODEL, timeout_seconds=10))

    diagnosis = asyncio.run(scenario())
    assert check(diagnosis, "reachability").status == "pass"  # an OpenAI error object answered
    auth = check(diagnosis, "auth")
    assert (auth.status, auth.evidence) == (
        "skipped",
        "not judged: no request without an API key got an answer of the API (http_error)",
    )


def test_where_sessions_land_is_not_judged_when_nothing_tells_it():
    """No echoed id, no header naming the replica, no cached tokens: neither the id's propagation nor
    the hash key can be judged, and neither passes nor fails."""

    async def anonymous(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n')
        await answer.write(b"data: [DONE]\n\n")
        return answer

    async def scenario() -> Diagnosis:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", anonymous)
        async with serving(app) as url:
            return await examine(ProbeSettings(base_url=url, model=MODEL, timeout_seconds=10))

    diagnosis = asyncio.run(scenario())
    propagation, hash_key = check(diagnosis, "session id propagation"), check(diagnosis, "hash key")
    assert (propagation.status, hash_key.status, diagnosis.causes) == ("skipped", "skipped", [])
    assert propagation.evidence == (
        "not judged: X-Session-Id is not echoed, and no backend header or cached tokens say where the "
        "sessions landed"
    )
    assert hash_key.evidence.startswith("not judged: no response header (")


def test_reachability_is_not_passed_when_kvwatch_itself_failed_the_round(monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug of kvwatch's")

    monkeypatch.setattr(probe_session, "_stream", broken)
    with loopback_http(TeamWiki) as url:
        found = check(doctor(url), "reachability")
    assert found.status == "skipped" and found.evidence.startswith(
        "not judged: internal_error (RuntimeError at "
    )
