"""What a user sees through a lab gateway, checked: which replica served each round, whether sessions
stay pinned, and the lab's faults and heals as they must succeed."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from kvwatch.lab import stack
from kvwatch.lab.process import LabError
from kvwatch.lab.state import LabState
from labs import Lab

# Kept-alive connections to the labs' gateways and replicas: both gateways apply a change to new requests
# on old connections too (nginx closes them as its old workers exit, Envoy routes each request anew).
LAB_CLIENT = httpx.Client(timeout=30)


def chat(url: str, session: str | None = None, content: str = "hello") -> httpx.Response:
    """One short round through a lab gateway or to a replica, with the session header when given."""
    headers = {"X-Session-Id": session} if session else {}
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return LAB_CLIENT.post(f"{url}/v1/chat/completions", json=body, headers=headers)


def upstreams(url: str, sessions: list[str], rounds: int = 3) -> dict[str, list[str]]:
    """The upstream that served each round of each session, all sessions a round (from X-Upstream)."""
    seen: dict[str, list[str]] = {s: [] for s in sessions}
    for _ in range(rounds):
        for session in sessions:
            response = chat(url, session)
            assert response.status_code == 200, response.text
            seen[session].append(response.headers["X-Upstream"])
    return seen


# The replicas' admin API by every spelling of its path.
ADMIN_REQUESTS = [
    *(("GET", path) for path in ("/lab/state", "/lab/ground-truth", "//lab/state", "/%6Cab/state")),
    ("GET", "/v1/../lab/state"),
    *(("POST", path) for path in ("/lab/faults", "/lab/reset-cache")),
]


def assert_admin_api_unproxied(lab: Lab, listener: str) -> None:
    """The lab gateway's `listener` proxies no spelling of the replicas' admin API: no fault took."""
    url = getattr(lab, listener)
    for method, path in ADMIN_REQUESTS:
        response = LAB_CLIENT.request(method, url + path, json={"prefix_caching": False})
        assert response.status_code == 404, (method, path, response.text)
    for replica in lab.status["replicas"]:
        assert LAB_CLIENT.get(f"{replica['url']}/lab/state").json()["faults"]["prefix_caching"] is True


def assert_round_robin(url: str, sessions: list[str]) -> None:
    """Strict round robin: each round of each session (three, replicas enough) went to another replica."""
    seen = upstreams(url, sessions)
    assert all(len(set(rounds)) == len(rounds) for rounds in seen.values()), seen


def assert_spread(url: str, sessions: list[str]) -> None:
    """The gateway does not keep sessions: the rounds of some session went to more than one replica."""
    seen = upstreams(url, sessions)
    assert any(len(set(rounds)) > 1 for rounds in seen.values()), seen


def session_pinned_to(lab: Lab, upstream: str) -> str:
    """A session id the lab's affinity listener sends to `upstream` (host:port), out of 200 tried."""
    candidates = (f"pinned-{i}" for i in range(200))
    pinned = next((s for s in candidates if chat(lab.affinity, s).headers["X-Upstream"] == upstream), None)
    assert pinned, f"no session pinned to {upstream}"
    return pinned


def fault(lab: Lab, *args: str) -> None:
    """`kvwatch lab fault ...`, which must succeed."""
    result = lab.cli("fault", *args)
    assert result.returncode == 0, result.stderr


def assert_baseline(lab: Lab, sessions: list[str]) -> None:
    """Affinity pins every session to one replica and echoes its id; every replica is up; no fault."""
    seen = upstreams(lab.affinity, sessions)
    assert all(len(set(rounds)) == 1 for rounds in seen.values()), seen
    assert chat(lab.affinity, "echo-me").headers["X-Session-Id"] == "echo-me"
    status = lab.cli("status", "--json").json
    assert status["faults"] == [] and all(r["url"] for r in status["replicas"])
    assert len(status["replicas"]) == len(lab.status["replicas"])


def heal(lab: Lab, sessions: list[str]) -> None:
    """`kvwatch lab heal`, which must succeed and leave the baseline."""
    result = lab.cli("heal")
    assert result.returncode == 0, result.stderr
    assert_baseline(lab, sessions)


def heal_if_faulted(lab: Lab, sessions: list[str]) -> None:
    """After a test of a shared lab: one that failed before its own heal leaves no fault for the next."""
    if LabState.load(lab.state_dir).faults:
        heal(lab, sessions)


def fault_with_gateway_stopped(lab: Lab, gateway: str, match: str) -> str:
    """`break-affinity` while the gateway's process is stopped (SIGSTOP), so that it cannot take the new
    config: the LabError the fault must fail with, which matches `match`."""
    pid = lab.status["processes"][gateway]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(LabError, match=match) as raised:
            stack.fault(LabState.load(lab.state_dir), "break-affinity")
    finally:
        os.kill(pid, signal.SIGCONT)
    return str(raised.value)
