"""Conversations through a lab SageMaker front with the real AWS SDK (botocore), as a client of a
SageMaker endpoint holds them: open a session, stream rounds with its SessionId, close it; and kvwatch's
SageMaker target on the command line against such a front."""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvwatch.lab.gateways.sagemaker import LAB_CREDENTIALS, LAB_REGION
from labs import Lab
from paths import REPO
from processes import http_get, kvwatch, wait_for

ENDPOINT = "lab-endpoint"
JSON = "application/json"


def read_whole(answer: dict) -> dict:
    """An InvokeEndpoint answer with its body read (bytes) and closed: its connection goes back to the
    client's pool now, not to the garbage collector in whichever test runs then."""
    with contextlib.closing(answer["Body"]) as body:
        return {**answer, "Body": body.read()}


def open_session(client) -> tuple[str, dict]:
    """A new session's id and the whole InvokeEndpoint answer."""
    answer = read_whole(client.invoke_endpoint(
        EndpointName=ENDPOINT, Body=json.dumps({"requestType": "NEW_SESSION"}), ContentType=JSON,
        SessionId="NEW_SESSION",
    ))  # fmt: skip
    return answer["NewSessionId"].split(";", 1)[0], answer


def close_session(client, session_id: str) -> dict:
    answer = client.invoke_endpoint(
        EndpointName=ENDPOINT,
        Body=json.dumps({"requestType": "CLOSE"}),
        ContentType=JSON,
        SessionId=session_id,
    )
    return read_whole(answer)


def stream_text(client, body: dict, session_id: str | None = None) -> tuple[str, dict]:
    """The text of a streamed answer (its PayloadParts joined) and the answer's other fields."""
    options = {"SessionId": session_id} if session_id else {}
    answer = client.invoke_endpoint_with_response_stream(
        EndpointName=ENDPOINT, Body=json.dumps(body), ContentType=JSON, **options
    )
    with contextlib.closing(answer["Body"]) as events:
        text = b"".join(event["PayloadPart"]["Bytes"] for event in events).decode()
    return text, answer


def usage_of(sse: str) -> dict:
    """The usage chunk of an SSE chat stream."""
    chunks = [json.loads(line[6:]) for line in sse.split("\n\n") if line.startswith("data: {")]
    return next(chunk["usage"] for chunk in reversed(chunks) if chunk.get("usage"))


@dataclass
class Conversation:
    """A growing chat whose rounds stream through the front; `usages` holds each round's usage."""

    client: object
    topic: str
    system_words: int = 300
    max_tokens: int = 8
    session_id: str | None = None
    messages: list[dict] = field(default_factory=list)
    usages: list[dict] = field(default_factory=list)

    def __post_init__(self):
        system = " ".join(f"{self.topic}{i}" for i in range(self.system_words))
        self.messages = [{"role": "system", "content": system}]

    def round(self, question: str) -> dict:
        self.messages.append({"role": "user", "content": question})
        body = {
            "messages": self.messages, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        text, answer = stream_text(self.client, body, self.session_id)
        self.usages.append(usage_of(text))
        self.messages.append({"role": "assistant", "content": f"answer {len(self.usages)}"})
        return answer


# --- kvwatch's SageMaker target ------------------------------------------------------------------------

MODEL = "lab-model"


def use_lab_credentials(monkeypatch, tmp_path) -> None:
    """The lab's dummy credentials in the environment the commands inherit; never the user's files."""
    for name, value in LAB_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def endpoint(url: str, model: str = MODEL) -> list[str]:
    return ["--sagemaker-endpoint", ENDPOINT, "--region", LAB_REGION, "--endpoint-url", url, "--model", model]


def probe_json(lab: Lab, *options: str, timeout: float = 180) -> tuple[dict, subprocess.CompletedProcess]:
    result = kvwatch(
        "probe", *endpoint(lab.affinity, lab.status.get("model", MODEL)), "--prometheus",
        lab.status["prometheus"], "--json", *options, timeout=timeout,
    )  # fmt: skip
    assert result.stdout, result.stderr
    return json.loads(result.stdout), result


# A fault or heal that restarts a real vLLM container: the lab's bound on its start (5 min) and more.
RESTART_TIMEOUT_S = 600


def fault(lab: Lab, *args: str) -> str:
    result = lab.cli("fault", *args, timeout=RESTART_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    return result.stdout


def assert_sticky_by_reuse(report: dict, block: int) -> None:
    """Every session sticky, judged by reuse: each warm round cached all its ideal tokens, block-aligned,
    and each first round none: the session's marker keeps every other session's cached system prompt
    from serving it (sessions run one after the other, so the earlier one's blocks are still cached)."""
    assert report["block_size"]["tokens"] == block, report["block_size"]
    for session in report["sessions"]:
        assert session["ok"] and session["closed"], session
        assert (session["sticky"], session["evidence"], session["session_losses"]) == (True, "reuse", [])
        first, *warm = session["rounds"]
        assert first["ideal_cached_tokens"] == 0 and first["ttft_seconds"] > 0
        assert first["cached_tokens"] == 0, first
        for r in warm:
            assert r["ttft_seconds"] > 0 and r["session_id_sent"] == session["session_id"], r
            assert r["ideal_cached_tokens"] > 0 and r["ideal_cached_tokens"] % block == 0, r
            assert r["cached_tokens"] == r["ideal_cached_tokens"], r


def probe_through_an_expiry(lab: Lab, options: list[str], expire: Callable[[subprocess.Popen], None]):
    """`kvwatch probe --json`, one session of 8 rounds, in the background; once the session's first round
    is served, `expire(the probe's process)` expires it. Checks the probe counted one loss (not_found:
    before its Expires), ran the rounds before it in the first session and the rest in one new one, the
    first there cold by design; returns the session, the id first opened and that round's index."""
    pins = f"{lab.affinity}/-/lab-sessions"
    before, model = set(http_get(pins, timeout=5).json()), lab.status.get("model", MODEL)
    command = [
        sys.executable, "-m", "kvwatch.cli.main", "probe", *endpoint(lab.affinity, model), "--json",
        "--sessions", "1", "--rounds", "8", *options,
    ]  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(command, cwd=REPO, **pipes) as run:
        try:
            (opened,) = wait_for(
                lambda: set(http_get(pins, timeout=5).json()) - before, "its session", timeout=120, every=0.1
            )
            wait_for(lambda: rounds_of(lab, opened, 200), "its first round", timeout=120, every=0.1)
            expire(run)
            out, err = run.communicate(timeout=RESTART_TIMEOUT_S)
        finally:
            if run.poll() is None:
                run.kill()
    assert run.returncode == 0, err
    (session,) = json.loads(out)["sessions"]
    assert session["ok"] and len(session["rounds"]) == 8, session
    assert [loss["kind"] for loss in session["session_losses"]] == ["not_found"], session
    reopened_at = session["session_losses"][0]["round"] - 1
    ids = [r["session_id_sent"] for r in session["rounds"]]
    assert ids[0] == opened and set(ids[:reopened_at]) == {opened}, ids
    assert len(set(ids[reopened_at:])) == 1 and session["session_id"] == ids[-1] != opened, ids
    assert session["rounds"][reopened_at]["ideal_cached_tokens"] == 0  # cold by design in the new session
    return session, opened, reopened_at


def active_alerts(lab: Lab, name: str) -> list[dict]:
    """The alerts of that name the lab's Alertmanager holds active, neither silenced nor inhibited."""
    params = {"active": "true", "silenced": "false", "inhibited": "false"}
    alerts = http_get(f"{lab.status['alertmanager']}/api/v2/alerts", params=params, timeout=5).json()
    return [a for a in alerts if a["labels"]["alertname"] == name]


def rounds_of(lab: Lab, session_id: str, status: int | None = None) -> list[dict]:
    """The front's access-log lines of the session's streamed rounds (of that status)."""
    return [
        e
        for e in lab.access_log("affinity")
        if e["session_id"] == session_id and e["request"].endswith("-response-stream")
        if status is None or e["status"] == status
    ]


def experiment_tables(out: Path, sessions: int, rounds: int) -> tuple[dict, dict]:
    """`kvwatch experiment`'s per-round rows by (route, round) and its routes by name, once both arms are
    checked to have run every round of every session, without an error, on the same seeded prompts."""
    with (out / "per-round.csv").open() as file:
        rows = {(r["route"], int(r["round"])): r for r in csv.DictReader(file)}
    numbers = range(1, rounds + 1)
    assert set(rows) == {(route, n) for route in ("no_session", "session") for n in numbers}
    assert all((r["sessions"], r["errors"]) == (str(sessions), "0") for r in rows.values()), rows
    for number in numbers:  # the same seeded conversations through both
        assert rows["session", number]["prompt_tokens"] == rows["no_session", number]["prompt_tokens"]
    with (out / "routes.csv").open() as file:
        routes = {r["route"]: r for r in csv.DictReader(file)}
    return rows, routes
